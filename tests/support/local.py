"""Helpers of the local-score tests (each rank scored on its own test distribution): a hand-made dataset of
grouped rows as prepare leaves it, and a training's stages after training on a real shard set, with
hand-made rank checkpoints trained on that shard set's rows."""

from __future__ import annotations

import json
from pathlib import Path

from shardfuse.io import sha256_file, write_json
from tests.support.data import write_grouped_rows
from tests.support.extensions import write_ranks
from tests.support.helpers import call_stage


def grouped_dataset(
    directory: Path, train_rows: int = 2000, test_rows: int = 600, test_groups: int = 12
) -> Path:
    """train.parquet and test.parquet of :func:`write_grouped_rows` (4 classes; ``user`` groups 0..11 in
    train, 0..test_groups-1 in test) and the dataset.json that records their rows and sha256."""
    directory.mkdir(parents=True, exist_ok=True)
    write_grouped_rows(directory / "train.parquet", train_rows, num_classes=4)
    write_grouped_rows(directory / "test.parquet", test_rows, num_classes=4, num_groups=test_groups, seed=1)
    rows = {"train": train_rows, "test": test_rows}
    sha256 = {split: sha256_file(directory / f"{split}.parquet") for split in rows}
    write_json(directory / "dataset.json", {"name": "grouped", "rows": rows, "sha256": sha256})
    return directory


def stage_ok(stage: str, *args: object) -> str:
    proc = call_stage(stage, *args)
    assert proc.returncode == 0, f"{stage} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def evaluate_on_shard_set(root: Path, dataset: Path, shards: Path, *extra: object) -> tuple[int, str, Path]:
    """A training on ``shards`` as its stages leave it (hand-made mlp ranks, each recording its shard's
    rows), gathered, merged uniformly and evaluated on the test split with ``extra`` arguments (e.g.
    ``--set local=MANIFEST``): (evaluate's exit status, its stderr, eval.json)."""
    manifest = json.loads((shards / "manifest.json").read_text())
    ranks, gather, run = root / "ranks", root / "gather.json", root / "run"
    if not gather.exists():
        write_ranks(
            ranks, dataset, manifest["world_size"], rows=[shard["rows"] for shard in manifest["shards"]]
        )
        stage_ok("gather", "--train-dir", ranks, "--world-size", manifest["world_size"], "--out", gather)
        stage_ok(
            "merge", "--gather", gather, "--method", "uniform",
            "--out-weights", run / "merged.safetensors", "--out-json", run / "merge.json",
        )  # fmt: skip
    out = run / "eval.json"
    proc = call_stage(
        "evaluate", "--run", "r", "--test", dataset / "test.parquet", "--gather", gather,
        "--merged", run / "merged.safetensors", "--batch-size", 97, *extra, "--out", out,
    )  # fmt: skip
    return proc.returncode, proc.stderr, out
