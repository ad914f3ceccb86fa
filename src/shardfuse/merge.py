"""Fuse a run's per-rank models into one, streaming tensor by tensor.

By hand::

    python -m shardfuse.merge --gather results/runs/ddp/gather.json --method consolidate \
        --out-weights results/runs/ddp/merged.safetensors --out-json results/runs/ddp/merge.json

Methods:
  consolidate  synchronous (ddp) runs: checks every rank equals rank 0 within --tolerance, keeps rank 0
  uniform      mean of the ranks' parameters (model soup / one-shot parameter averaging)
  weighted     mean weighted by each rank's shard rows (FedAvg)

Only one tensor of each rank is in memory at a time (safetensors is memory-mapped), so memory grows
with the model, not with the number of ranks. Sums are accumulated in float64.
"""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Any

import torch

from shardfuse.checkpoint import open_weights, read_metadata, save_weights
from shardfuse.io import StageParser, UserError, read_json, run_cli, sha256_file, write_json

METHODS = ("consolidate", "uniform", "weighted")


def merge_weights(method: str, rows: list[int]) -> list[float]:
    if method == "weighted":
        total = sum(rows)
        if total <= 0:
            raise UserError("weighted merge needs ranks with rows > 0; use merge_method uniform")
        return [r / total for r in rows]
    return [1.0 / len(rows)] * len(rows)


def merge_tensors(
    paths: list[Path], method: str, weights: list[float], tolerance: float
) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """Return the merged tensors and, per tensor, the largest |rank - rank 0| difference."""
    if method not in METHODS:
        raise UserError(f"unknown merge method {method!r}; use one of {', '.join(METHODS)}")
    merged: dict[str, torch.Tensor] = {}
    spread: dict[str, float] = {}
    with contextlib.ExitStack() as stack:
        handles = [stack.enter_context(open_weights(path)) for path in paths]
        for name in handles[0].keys():
            reference = handles[0].get_tensor(name)
            acc = reference.to(torch.float64) * weights[0]
            worst = 0.0
            for handle, weight in zip(handles[1:], weights[1:], strict=True):
                tensor = handle.get_tensor(name)
                if reference.numel():
                    worst = max(
                        worst, (tensor.to(torch.float64) - reference.to(torch.float64)).abs().max().item()
                    )
                acc.add_(tensor.to(torch.float64), alpha=weight)
            spread[name] = worst
            if method == "consolidate":
                if worst > tolerance:
                    raise UserError(
                        f"consolidate: tensor {name!r} differs between ranks by up to {worst:.3g} "
                        f"(merge_tolerance {tolerance:.3g}); the ranks are not synchronous — use "
                        "merge_method uniform/weighted or raise merge_tolerance"
                    )
                merged[name] = reference.clone()
            else:
                merged[name] = acc.to(reference.dtype)
    return merged, spread


def merge(gather_path: Path, method: str, tolerance: float, out_weights: Path, out_json: Path) -> dict:
    info = read_json(gather_path, "gather record")
    ranks = info["ranks"]
    paths = [Path(rank["path"]) for rank in ranks]
    for rank, path in zip(ranks, paths, strict=True):
        if not path.is_file() or sha256_file(path) != rank["sha256"]:
            raise UserError(
                f"rank {rank['rank']}: {path} is missing or changed since gather; re-run "
                "gather (snakemake -R gather)"
            )
    weights = merge_weights(method, [rank["rows"] for rank in ranks])
    started = time.perf_counter()
    merged, spread = merge_tensors(paths, method, weights, tolerance)
    digest = save_weights(
        out_weights, merged, {**read_metadata(paths[0]), "rank": None, "merge_method": method}, sidecar=False
    )
    record: dict[str, Any] = {
        "run": info["run"],
        "method": method,
        "num_ranks": len(ranks),
        "weights": weights,
        "rows": [rank["rows"] for rank in ranks],
        "tolerance": tolerance,
        "max_abs_diff_between_ranks": max(spread.values(), default=0.0),
        "seconds": time.perf_counter() - started,
        "output": out_weights.name,
        "sha256": digest,
        "num_tensors": len(merged),
        "num_parameters": sum(t.numel() for t in merged.values()),
    }
    write_json(out_json, record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.merge", description=__doc__.splitlines()[0])
    parser.add_argument("--gather", type=Path, required=True, help="gather.json of the run")
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--tolerance", type=float, default=1e-6, help="consolidate: max |rank - rank 0|")
    parser.add_argument("--out-weights", type=Path, required=True, help="merged.safetensors to write")
    parser.add_argument("--out-json", type=Path, required=True, help="merge.json to write")
    args = parser.parse_args(argv)
    if args.tolerance < 0:
        raise UserError(f"--tolerance {args.tolerance} must be >= 0")
    record = merge(args.gather, args.method, args.tolerance, args.out_weights, args.out_json)
    print(
        f"merged {record['num_ranks']} ranks with {args.method}: {record['num_parameters']} parameters, "
        f"max |rank - rank 0| = {record['max_abs_diff_between_ranks']:.3g}"
    )


if __name__ == "__main__":
    run_cli(main)
