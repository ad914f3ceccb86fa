"""Benchmark fusing LoRA adapters in update space against fusing the same models as whole checkpoints.

    python bench/lora.py                         # 16 modules of 2048 x 2048 (256 MiB), r 16, N = 2, 8
    python bench/lora.py --width 1024 --ranks 2  # smaller
    python bench/lora.py --quick                 # CI smoke: 4 modules of 256 x 256, N = 2, once

A training directory of each kind is written under --dir (default: a temporary directory, removed
afterwards), as the train stage writes them, and gathered by the gather stage:
  adapter   base.safetensors (the frozen model) and N rank files holding each rank's LoRA factors
            (A [r, d], B [d, r], alpha 2r) of every module: what `adapter:` runs publish
  dense     the same base and N rank files holding each rank's whole model W0 + (alpha/r)·B·A (float32):
            what full fine-tuning to the same weights publishes, and what fusing LoRA as whole models reads
Then `python -m shardfuse.merge` runs on each (uniform and TIES, density 0.5), each in its own child
process, interleaved and repeated; seconds and peak RSS are the child's (merge.json's seconds exclude
the interpreter's start, RSS includes it). Both fuse the same updates: the merged models agree to float32
rounding (checked once per size, the largest difference printed).
Reported: bytes per rank checkpoint, and merge seconds and peak RSS of each path, paired per repetition,
medians. Targets (the exit status counts them): adapter rank files <= 1/20 of the dense ones, and the
adapter merge's peak RSS flat in N (at the largest N at most 1.25 x that at the smallest: one module's
update at a time, whatever the number of ranks). The seconds are reported against the dense path's
without a target: the update-space merge forms every rank's B·A (2·r multiply-adds per weight and rank,
in float64), which on a few CPU cores costs more than reading a whole model from the page cache; the
dense path reads N whole models, which it does not have to store, hash in gather, or read from disk.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

import common

METHODS = {"uniform": {}, "ties": {"density": 0.5}}


def write_training(out: Path, kind: str, base: dict, factors: list[dict], alpha: float, r: int) -> Path:
    """A training directory as the train stage writes it (headers, sidecars, train.json)."""
    import torch

    from shardfuse.checkpoints.weights import save_weights

    ranks = out / "ranks"
    ranks.mkdir(parents=True)
    width = next(iter(base.values())).shape[0]
    spec = {"model": "mlp", "args": {"hidden_sizes": [width]}, "description": {}}
    meta = {"run": kind, "world_size": len(factors), "strategy": "localsgd", "model": spec}
    meta["init_sha256"] = "0" * 64
    base_sha = save_weights(ranks / "base.safetensors", base, {**meta, "rank": None})
    adapter = None
    if kind == "adapter":
        targets = {
            name.removesuffix(".weight"): {"shape": list(t.shape), "fan_in_fan_out": False}
            for name, t in base.items()
        }
        adapter = {"type": "lora", "r": r, "alpha": alpha, "dropout": 0.0, "init": "per_rank",
                   "target_modules": "all-linear", "targets": targets, "base": "base.safetensors",
                   "base_sha256": base_sha}  # fmt: skip
    scaling = alpha / r
    for rank, rank_factors in enumerate(factors):
        rank_meta = {**meta, "rank": rank, "rows": 100, "num_steps": 1}
        if kind == "adapter":
            tensors = {}
            for name, (a, b) in rank_factors.items():
                module = name.removesuffix(".weight")
                tensors[f"{module}.lora_A.weight"], tensors[f"{module}.lora_B.weight"] = a, b
            save_weights(ranks / f"rank-{rank}.safetensors", tensors, {**rank_meta, "adapter": adapter})
        else:
            tensors = {}
            for name, weight in base.items():
                a, b = rank_factors[name]
                tensors[name] = (weight.double() + scaling * (b.double() @ a.double())).to(torch.float32)
            save_weights(ranks / f"rank-{rank}.safetensors", tensors, rank_meta)
    train = {"run": kind, "world_size": len(factors), "strategy": "localsgd", "model": spec}
    if adapter is not None:
        train["adapter"] = adapter
    (ranks / "train.json").write_text(json.dumps(train))
    proc = common.measure(
        common.python_cmd("-m", "shardfuse.gather", "--train-dir", ranks, "--world-size", len(factors),
                          "--out", out / "gather.json")
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout
    return out / "gather.json"


def merge_once(gather: Path, method: str, out: Path) -> tuple[float, float]:
    """(merge.json's seconds, the child's peak RSS in MiB) of one merge."""
    measured = common.measure(
        common.python_cmd("-m", "shardfuse.merge", "--gather", gather, "--method", method,
                          "--params-json", json.dumps(METHODS[method]), "--out-weights", out,
                          "--out-json", out.with_suffix(".json"))
    )  # fmt: skip
    return json.loads(out.with_suffix(".json").read_text())["seconds"], measured.peak_rss_mb


def run(width: int, modules: int, r: int, num_ranks: int, reps: int, work: Path) -> dict:
    import torch

    from shardfuse.checkpoints.weights import load_weights

    generator = torch.Generator().manual_seed(0)
    base = {
        f"layers.{i}.weight": torch.randn(width, width, generator=generator) / width**0.5
        for i in range(modules)
    }

    def pair() -> tuple:
        a = torch.randn(r, width, generator=generator) / width**0.5
        return a, torch.randn(width, r, generator=generator) * 0.01

    factors = [{name: pair() for name in base} for _ in range(num_ranks)]
    gathers = {
        kind: write_training(work / kind, kind, base, factors, 2.0 * r, r) for kind in ("adapter", "dense")
    }
    rank_bytes = {kind: (work / kind / "ranks" / "rank-0.safetensors").stat().st_size for kind in gathers}
    results: dict = {"rank_bytes": rank_bytes, "methods": {}}
    for method in METHODS:
        times = {kind: [] for kind in gathers}
        rss = {kind: [] for kind in gathers}
        for _ in range(reps):
            for kind, gather in gathers.items():  # interleaved: a busy machine slows both alike
                seconds, peak = merge_once(gather, method, work / f"{kind}-{method}.safetensors")
                times[kind].append(seconds)
                rss[kind].append(peak)
        ours = load_weights(work / f"adapter-{method}.safetensors")[0]
        theirs = load_weights(work / f"dense-{method}.safetensors")[0]
        diff = max(float((ours[n] - theirs[n]).abs().max()) for n in ours)
        ratio = common.median([a / d for a, d in zip(times["adapter"], times["dense"], strict=True)])
        results["methods"][method] = {
            "adapter_seconds": common.median(times["adapter"]),
            "dense_seconds": common.median(times["dense"]),
            "ratio": ratio,
            "adapter_rss_mb": common.median(rss["adapter"]),
            "dense_rss_mb": common.median(rss["dense"]),
            "max_abs_diff": diff,
        }
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--width", type=int, default=2048)
    parser.add_argument("--modules", type=int, default=16)
    parser.add_argument("--r", type=int, default=16)
    parser.add_argument("--ranks", default="2,8")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--dir", type=Path, default=None)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    if args.quick:
        args.width, args.modules, args.ranks, args.reps = 256, 4, "2", 1
    root = Path(tempfile.mkdtemp(prefix="shardfuse-lora-", dir=args.dir))
    rows, failures, adapter_rss = [], 0, {}
    try:
        for num_ranks in [int(n) for n in args.ranks.split(",")]:
            work = root / f"n{num_ranks}"
            work.mkdir()
            result = run(args.width, args.modules, args.r, num_ranks, args.reps, work)
            rb = result["rank_bytes"]
            for method, m in result["methods"].items():
                sizes = [rb["adapter"] / 2**20, rb["dense"] / 2**20]
                seconds = [m["adapter_seconds"], m["dense_seconds"], m["ratio"]]
                rss = [m["adapter_rss_mb"], m["dense_rss_mb"]]
                rows.append([num_ranks, method, *sizes, *seconds, *rss, m["max_abs_diff"]])
                adapter_rss.setdefault(method, []).append(m["adapter_rss_mb"])
            failures += not (rb["adapter"] <= rb["dense"] / 20)
            shutil.rmtree(work)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    model_mib = args.width * args.width * args.modules * 4 / 2**20
    print(
        f"LoRA fusion in update space vs the same models as whole checkpoints: {args.modules} modules of "
        f"{args.width} x {args.width} float32 ({model_mib:.0f} MiB), r {args.r}, medians of {args.reps}"
    )
    header = ["N", "method", "rank file MiB (adapter)", "rank file MiB (dense)", "merge s (adapter)"]
    header += ["merge s (dense)", "adapter / dense time", "peak RSS MiB (adapter)", "peak RSS MiB (dense)"]
    print(common.table([*header, "max |adapter - dense|"], rows))
    failures += sum(not (peaks[-1] <= 1.25 * peaks[0]) for peaks in adapter_rss.values())
    verdict = common.verdict(failures == 0)
    print(f"targets (adapter rank files <= 1/20 of dense; adapter merge RSS flat in N, <= 1.25x): {verdict}")
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    main()
