"""Benchmark 6 (GPU machines only): the train stage on the GPU, NCCL, fp32 vs bf16 autocast.

    python bench/gpu.py                      # 2M synthetic rows x 64 features, 2 epochs, batch 512
    python bench/gpu.py --rows 50000 --epochs 1 --reps 1   # smoke size

Runs ``python -m shardfuse.launch`` (torchrun --standalone, one rank per GPU, NCCL) on a synthetic
dataset with ``precision: fp32`` and ``precision: auto`` (bf16 autocast where the GPU supports it),
interleaved, and reports samples/s (rows x epochs / train_seconds of train.json: the training loop of
the slowest rank) and rank 0's peak GPU memory (``torch.cuda.max_memory_allocated``, in train.json).
Exits 2 with one line when this machine has no CUDA device; on a CPU machine the same code path is
covered by tests/unit/rank/test_dist.py (device, backend and precision selection).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common
import scaling

PRECISIONS = ("fp32", "auto")


def run(rows: int, features: int, epochs: int, batch_size: int, reps: int, work_dir: Path) -> dict:
    import torch

    gpus = torch.cuda.device_count()
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = work_dir / "dataset"
    common.make_dataset(dataset, rows, features)
    shards = common.make_shards(dataset, gpus, work_dir / "shards")
    results: dict[str, list[dict]] = {precision: [] for precision in PRECISIONS}
    for _ in range(reps):
        for precision in PRECISIONS:
            cfg = {**scaling.train_config("ddp", epochs), "batch_size": batch_size, "precision": precision}
            out = work_dir / f"run-{precision}"
            common.measure(
                common.python_cmd(
                    "-m", "shardfuse.launch", "--nproc-per-node", gpus, "--out-dir", out, "--",
                    "--run-name", f"gpu-{precision}", "--shard-dir", shards, "--dataset-dir", dataset,
                    "--config-json", json.dumps(cfg),
                )
            )  # fmt: skip
            info = json.loads((out / "train.json").read_text())
            samples = sum(rank["rows"] for rank in info["ranks"]) * info["epochs"]
            results[precision].append(
                {
                    "samples_per_s": samples / info["train_seconds"],
                    "peak_mb": (info["peak_gpu_memory_bytes"] or 0) / 2**20,
                    "used": info["precision"],
                }
            )
            common.remove(out)
    rows_out = [
        [
            precision,
            results[precision][0]["used"],
            common.median([r["samples_per_s"] for r in results[precision]]),
            common.median([r["peak_mb"] for r in results[precision]]),
        ]
        for precision in PRECISIONS
    ]
    markdown = common.table(
        ["precision setting", "ran as", "samples/s", "peak GPU memory MB (rank 0)"], rows_out
    )
    markdown += (
        f"\n\n{torch.cuda.get_device_name(0)} x {gpus}, NCCL; synthetic {rows:,} rows x {features} features, "
        f"{epochs} epochs, batch {batch_size}, default MLP; median of {reps} repetitions."
    )
    return {"title": "6. GPU", "markdown": markdown, "checks": [], "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=2_000_000)
    parser.add_argument("--features", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=512)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/gpu"))
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("bench/gpu.py: no CUDA device on this machine; run it on a GPU node", file=sys.stderr)
        sys.exit(2)
    try:
        section = run(args.rows, args.features, args.epochs, args.batch_size, args.reps, args.work_dir)
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])


if __name__ == "__main__":
    main()
