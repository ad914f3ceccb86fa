"""Unequal shards made by hand, as a user would make them (a Dirichlet split, rows counted out): the
prepared training split cut into consecutive blocks of given sizes by a toy partitioner record run
through the real partition stage, and their trainings through the real launcher."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardfuse import partition
from shardfuse.data.partitioners import registry
from tests.support.helpers import run_stage


def _blocks(sizes: list[int]):
    """A partitioner's assign: rank r takes the next sizes[r] rows of the split; the rest are dropped."""

    def assign(layout, counts, params):
        bounds = np.cumsum(sizes)
        dealt = 0

        def deal(num_rows: int, shown) -> np.ndarray:
            nonlocal dealt
            positions = np.arange(dealt, dealt + num_rows)
            dealt += num_rows
            return np.searchsorted(bounds, positions, side="right")  # past the last block: dropped

        return deal

    return assign


def sized_shards(out_dir: Path, dataset_dir: Path, sizes: list[int]) -> Path:
    """A shard set of ``sizes`` rows per rank from ``dataset_dir``'s training split, written by the
    partition stage (in this process) with a toy record for the deal."""
    record = registry.Partitioner("blocks", _blocks(sizes), "consecutive blocks of given sizes (a test's)")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(registry, "RECORDS", (*registry.RECORDS, record))
        partition.main(
            ["--input", str(dataset_dir / "train.parquet"), "--world-size", str(len(sizes)), "--seed", "0",
             "--partitioner", "blocks", "--out-dir", str(out_dir)]
        )  # fmt: skip
    return out_dir


def launch(out: Path, dataset: Path, shards: Path, cfg: dict, world_size: int = 2, check: bool = True):
    """A real gloo training of ``cfg`` through the launcher; its process (stderr kept)."""
    proc = run_stage(
        "launch", "--nproc-per-node", world_size, "--out-dir", out, "--", "--run-name", "r",
        "--shard-dir", shards, "--dataset-dir", dataset, "--config-json", json.dumps(cfg),
    )  # fmt: skip
    if check:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return proc
