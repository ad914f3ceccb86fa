"""Unequal shards, trained right: real 2-rank trainings (torchrun, gloo) on hand-made shards of 300 and 60
rows. batch_size stays the rows of a step on every rank, epoch_steps decides how the ranks line up, and
train.json records each rank's steps and rows seen and the true effective batch; weighted merges by rows
seen; a killed cycling (or own-steps) run resumes bitwise."""

from __future__ import annotations

import json

import pyarrow.parquet as pq
import pytest

from tests.support.helpers import call_stage
from tests.support.training import (
    RESUME_CFG,
    SMALL_TRAIN_CFG,
    assert_resumed_bitwise,
    kill_a_rank_and_resume,
    train_reference,
)
from tests.support.unequal import launch, sized_shards

SIZES = [300, 60]
CFG = {**SMALL_TRAIN_CFG, "batch_size": 32, "epochs": 2, "checkpoint_every": 0}
WARNING = "warning: shards of 60 to 300 rows (more than 2x apart): epoch_steps min (the default)"


@pytest.fixture(scope="module")
def shards(tmp_path_factory, digits_dataset):
    return sized_shards(tmp_path_factory.mktemp("unequal") / "shards", digits_dataset, SIZES)


def ranks_of(out) -> list[tuple[int, int, int]]:
    """(shard rows, optimiser steps, rows seen) of each rank, from train.json."""
    return [(entry["rows"], entry["num_steps"], entry["rows_seen"]) for entry in read(out)["ranks"]]


def read(out) -> dict:
    return json.loads((out / "train.json").read_text())


# (mode, strategy keys, each rank's (rows, steps, rows seen) over 2 epochs of batch 32, the clock's steps)
MODES = [
    ("min", {"strategy": "ddp"}, [(300, 4, 120), (60, 4, 120)], 4),  # 60 rows an epoch: 300 stops early
    ("max", {"strategy": "ddp"}, [(300, 20, 600), (60, 20, 600)], 20),  # 300 an epoch: 60 cycles 5 times
    ("mean", {"strategy": "localsgd", "sync_every": 3}, [(300, 12, 360), (60, 12, 360)], 12),
    ("own", {"strategy": "localsgd", "sync_every": 0}, [(300, 20, 600), (60, 4, 120)], 20),
]


@pytest.mark.parametrize(("mode", "keys", "ranks", "clock"), MODES, ids=[mode for mode, *_ in MODES])
def test_train_json_records_each_ranks_steps_and_rows_seen_and_the_true_effective_batch(
    tmp_path, digits_dataset, shards, mode, keys, ranks, clock
):
    out = tmp_path / "train"
    extra = {} if mode == "min" else {"epoch_steps": mode}  # min: left at its default
    proc = launch(out, digits_dataset, shards, {**CFG, "sync_every": 0, **keys, **extra})
    info = read(out)
    assert ranks_of(out) == ranks
    assert info["epoch_steps"] == mode and info["num_steps"] == clock
    assert info["steps_per_epoch"] == clock // 2
    # 30 rows a step on each rank (an epoch's rows spread evenly over its steps of at most 32)
    assert info["rows_per_step"] == pytest.approx(60.0) and info["effective_batch_size"] == 64
    # The one-line warning at the default only, on rank 0's stderr.
    assert proc.stderr.count(WARNING) == (1 if mode == "min" else 0)
    # Each rank logs a row per optimiser step it took, numbered on the shared clock.
    steps = [pq.read_table(out / "metrics" / f"rank-{r}.parquet")["step"].to_pylist() for r in (0, 1)]
    assert [len(s) for s in steps] == [steps for _, steps, _ in ranks]
    if mode == "own":  # rank 1 takes its 2 steps an epoch, then waits out the epoch's other 8
        assert steps[1] == [1, 2, 11, 12]


def test_own_steps_with_ranks_that_meet_stop_the_train_stage_with_one_line(tmp_path, digits_dataset, shards):
    cfg = {**CFG, "strategy": "ddp", "epoch_steps": "own"}
    proc = launch(tmp_path / "train", digits_dataset, shards, cfg, check=False)
    assert proc.returncode != 0
    assert (
        "shardfuse.train: error: epoch_steps: own lets each rank take its own number of steps, but "
        "strategy ddp keeps the ranks in step; set strategy localsgd with sync_every 0, or epoch_steps "
        "min, max or mean"
    ) in proc.stderr


def test_weighted_merges_the_ranks_by_the_rows_they_trained_on(tmp_path, digits_dataset, shards):
    out = tmp_path / "ranks"
    cfg = {**CFG, "strategy": "localsgd", "sync_every": 0, "epoch_steps": "max"}
    launch(out, digits_dataset, shards, cfg)
    gather = tmp_path / "gather.json"
    assert call_stage("gather", "--train-dir", out, "--world-size", 2, "--out", gather).returncode == 0
    gathered = json.loads(gather.read_text())["ranks"]
    assert [(rank["rows"], rank["rows_seen"]) for rank in gathered] == [(300, 600), (60, 600)]
    merge_json = tmp_path / "merge.json"
    proc = call_stage(
        "merge", "--gather", gather, "--method", "weighted",
        "--out-weights", tmp_path / "merged.safetensors", "--out-json", merge_json,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # Both ranks saw 600 rows (the small shard cycled): equal weights, not FedAvg's 300 : 60.
    assert json.loads(merge_json.read_text())["weights"] == [0.5, 0.5]


@pytest.mark.parametrize(
    ("mode", "keys"),
    [("max", {"strategy": "ddp"}), ("own", {"strategy": "localsgd", "sync_every": 0})],
)
def test_a_killed_cycling_or_own_steps_run_resumes_bitwise_identical(
    tmp_path, digits_dataset, shards, mode, keys
):
    # 12 epochs of 19 steps (batch 16 over 300 rows), a checkpoint every 40: killed mid-run. With max the
    # 60-row rank is several passes into a cycling epoch; with own it waits out 15 of every 19 steps.
    cfg = {**RESUME_CFG, "sync_every": 0, **keys, "epoch_steps": mode, "lr_schedule": "cosine"}
    reference = train_reference(tmp_path / "reference", digits_dataset, shards, cfg)
    resumed = tmp_path / "resumed"
    kill_a_rank_and_resume(resumed, digits_dataset, shards, cfg)
    assert_resumed_bitwise(reference, resumed)
    assert ranks_of(resumed) == ranks_of(reference)
