"""Fabricate the files the train/gather/merge/evaluate stages leave in a run directory.

The shapes follow what those stages write, so tracking tests exercise the real file contracts without
running torchrun.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
from safetensors.numpy import save_file

from shardfuse.io import sha256_file


def run_config(run_name: str, merge_method: str = "average", world_size: int = 2) -> dict:
    """A resolved run config as the workflow passes it: nested, with lists and nulls."""
    return {
        "run": run_name,
        "dataset": {"name": "synthetic", "num_features": 8, "num_classes": 3, "path": None},
        "world_size": world_size,
        "seed": 0,
        "model": {"name": "mlp", "hidden_sizes": [16, 16], "dropout": 0.0},
        "train": {"strategy": "ddp", "sync_every": 1, "epochs": 2, "batch_size": 32, "lr": 0.01},
        "merge": {"method": merge_method, "weights": None},
    }


def make_run_dir(
    root: Path,
    run_name: str,
    world_size: int = 2,
    num_steps: int = 7,
    merge_method: str = "average",
) -> tuple[Path, Path]:
    """Write a complete run directory plus its shard manifest under ``root``; return both paths."""
    run_dir = root / "results" / "runs" / run_name
    metrics_dir = run_dir / "train" / "metrics"
    metrics_dir.mkdir(parents=True)
    shard_dir = root / "results" / "shards" / "synthetic" / f"w{world_size}-seed0"
    shard_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = shard_dir / "manifest.json"
    shard_rows = [719 + rank for rank in range(world_size)]
    manifest = {
        "dataset": "synthetic",
        "world_size": world_size,
        "seed": 0,
        "shards": [{"rank": r, "path": f"shard-{r}.parquet", "rows": n} for r, n in enumerate(shard_rows)],
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))

    rng = np.random.default_rng(len(run_name))
    ranks = []
    for rank in range(world_size):
        steps = np.arange(num_steps, dtype=np.int64)
        table = pa.table(
            {
                "step": steps,
                "epoch": steps * 2 // num_steps,
                "loss": 1.1 - 0.1 * steps - 0.01 * rank,
                "samples_per_second": 1000.0 + rng.random(num_steps),
                "lr": np.full(num_steps, 0.01),
                "timestamp_ms": 1_700_000_000_000 + 250 * steps,
            }
        )
        pq.write_table(table, metrics_dir / f"rank-{rank}.parquet")
        checkpoint = run_dir / "ranks" / f"rank-{rank}.safetensors"
        checkpoint.parent.mkdir(exist_ok=True)
        save_file({"fc.weight": rng.random((3, 8), dtype=np.float32)}, str(checkpoint))
        ranks.append({"rank": rank, "rows": shard_rows[rank], "checkpoint": str(checkpoint)})

    train = {
        "run": run_name,
        "world_size": world_size,
        "strategy": "ddp",
        "sync_every": 1,
        "num_steps": num_steps,
        "epochs": 2,
        "train_seconds": 12.5,
        "backend": "gloo",
        "ranks": [
            {"rank": r["rank"], "rows": r["rows"], "checkpoint": Path(r["checkpoint"]).name} for r in ranks
        ],
        "model": {"name": "mlp", "hidden_sizes": [16, 16]},
    }
    (run_dir / "train" / "train.json").write_text(json.dumps(train, indent=2))
    gather = {
        "run": run_name,
        "world_size": world_size,
        "ranks": [
            {
                "rank": r["rank"],
                "path": r["checkpoint"],
                "sha256": sha256_file(r["checkpoint"]),
                "bytes": Path(r["checkpoint"]).stat().st_size,
                "rows": r["rows"],
            }
            for r in ranks
        ],
        "tensors": {"fc.weight": {"shape": [3, 8], "dtype": "F32"}},
    }
    (run_dir / "gather.json").write_text(json.dumps(gather, indent=2))
    merged = run_dir / "merged.safetensors"
    save_file({"fc.weight": np.full((3, 8), 0.5, dtype=np.float32)}, str(merged))
    weights = [r["rows"] / sum(shard_rows) for r in ranks]
    merge = {
        "run": run_name,
        "method": merge_method,
        "num_ranks": world_size,
        "weights": weights,
        "seconds": 0.25,
        "output": "merged.safetensors",
        "sha256": sha256_file(merged),
    }
    (run_dir / "merge.json").write_text(json.dumps(merge, indent=2))
    rank_results = [
        {"rank": r, "loss": 0.6 + 0.05 * r, "accuracy": 0.70 + 0.02 * r} for r in range(world_size)
    ]
    evaluation = {
        "run": run_name,
        "test_rows": 300,
        "merged": {"loss": 0.5, "accuracy": 0.8},
        "ranks": rank_results,
        "best_rank_accuracy": max(r["accuracy"] for r in rank_results),
        "mean_rank_accuracy": float(np.mean([r["accuracy"] for r in rank_results])),
        "mean_rank_loss": float(np.mean([r["loss"] for r in rank_results])),
    }
    (run_dir / "eval.json").write_text(json.dumps(evaluation, indent=2))
    return run_dir, manifest_path
