"""Adding a way to line up epochs (``epoch_steps``) is one record: a toy written into a temporary module
and added to the registry's RECORDS trains through the real train stage (one gloo rank, in this process)
and its epochs are the toy's, as train.json's steps and rows seen show."""

from __future__ import annotations

import json

from shardfuse.data import epoch_steps
from tests.support.extension import import_toy_module, stage_ok, train_one_rank

# The toy: every epoch passes twice over the largest shard (a smaller shard cycles more).
TOY_MODULE = """
from shardfuse.data.epoch_steps import EpochSteps

RECORD = EpochSteps("twice", lambda rows, shard: 2 * max(rows), "the largest shard's rows twice over")
"""


def test_a_toy_epoch_steps_record_sets_the_epochs_of_the_real_train_stage(
    tmp_path, monkeypatch, digits_dataset
):
    toy = import_toy_module(tmp_path, "toy_epoch_steps", TOY_MODULE)
    monkeypatch.setattr(epoch_steps, "RECORDS", (*epoch_steps.RECORDS, toy.RECORD))
    shards = tmp_path / "shards"
    stage_ok(
        "partition", "--input", digits_dataset / "train.parquet", "--world-size", 1, "--seed", 0,
        "--out-dir", shards,
    )  # fmt: skip
    out = tmp_path / "train"
    train_one_rank(monkeypatch, digits_dataset, shards, out, epoch_steps="twice", batch_size=64, epochs=2)

    info = json.loads((out / "train.json").read_text())
    (rank,) = info["ranks"]
    per_epoch = -(-2 * rank["rows"] // 64)  # ceil(2 x rows / batch_size) micro-batches an epoch
    assert info["epoch_steps"] == "twice" and info["steps_per_epoch"] == per_epoch
    assert rank["num_steps"] == 2 * per_epoch and rank["rows_seen"] == 2 * 2 * rank["rows"]
