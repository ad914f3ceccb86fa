"""The shard reader's epochs of another length than the shard (epoch_steps): an epoch that stops early
takes distinct rows in a new order each epoch, one that cycles passes over the whole shard again in a
new seeded order, and both resume mid-epoch (also mid-pass) with the batches of an uninterrupted run."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch

from shardfuse.data import shard_writer
from shardfuse.data.reader import ShardReader, load_shard
from shardfuse.partition import partition_parquet
from shardfuse.prepare import prepare

SPEC = {"source": "synthetic", "num_rows": 800, "num_features": 4, "num_classes": 3, "seed": 5}


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> Path:
    """Two shards of about 320 rows, in row groups of 32 (so an epoch spans many)."""
    root = tmp_path_factory.mktemp("epochs")
    prepare("syn", SPEC, root / "dataset")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shard_writer, "MAX_ROW_GROUP_ROWS", 32)
        partition_parquet(root / "dataset" / "train.parquet", root / "shards", world_size=2, seed=0)
    return root / "shards"


def epoch_rows(reader: ShardReader, epoch: int, num_batches: int, num_rows: int, start: int = 0) -> list:
    """The epoch's batches, each as its rows' ids (a synthetic row's first feature is unique)."""
    return [
        [float(value) for value in features[:, 0]]
        for features, _ in reader.epoch(epoch, num_batches, start, num_rows)
    ]


def shard_ids(shards: Path) -> list[float]:
    return [float(value) for value in load_shard(shards, 0)[0][:, 0]]


@pytest.mark.parametrize("cache", [False, True])
def test_an_epoch_that_stops_early_takes_distinct_rows_and_other_ones_the_next_epoch(shards, cache):
    ids = shard_ids(shards)
    with ShardReader(shards, 0, seed=3, cache=cache) as reader:
        first = epoch_rows(reader, 0, 4, 100)
        second = epoch_rows(reader, 1, 4, 100)
    for batches in (first, second):
        taken = [row for batch in batches for row in batch]
        assert [len(batch) for batch in batches] == [25] * 4
        assert len(set(taken)) == 100 and set(taken) <= set(ids)
    assert {row for b in first for row in b} != {row for b in second for row in b}


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("epoch", [0, 1])
def test_a_cycling_epoch_passes_over_the_whole_shard_again_in_a_new_order(shards, cache, epoch):
    ids = shard_ids(shards)
    num_rows = 2 * len(ids) + 50
    with ShardReader(shards, 0, seed=3, cache=cache) as reader:
        for earlier in range(epoch):
            epoch_rows(reader, earlier, 7, num_rows)
        batches = epoch_rows(reader, epoch, 7, num_rows)
    taken = [row for batch in batches for row in batch]
    assert len(taken) == num_rows and max(map(len, batches)) - min(map(len, batches)) <= 1
    passes = [taken[: len(ids)], taken[len(ids) : 2 * len(ids)], taken[2 * len(ids) :]]
    assert sorted(passes[0]) == sorted(ids) and sorted(passes[1]) == sorted(ids)  # every row, each pass
    assert passes[0] != passes[1]  # in a new order
    assert len(set(passes[2])) == 50 and max(Counter(taken).values()) == 3


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("epoch", [0, 2])
@pytest.mark.parametrize("num_rows", [150, 700])
def test_an_epoch_of_another_length_resumes_mid_epoch_with_the_uninterrupted_batches(
    shards, cache, epoch, num_rows
):
    with ShardReader(shards, 0, seed=2, cache=cache) as reader:
        for earlier in range(epoch):
            epoch_rows(reader, earlier, 9, num_rows)
        uninterrupted = epoch_rows(reader, epoch, 9, num_rows)
    for start in (1, 4, 6, 9):  # 700 rows: batch 4 and 6 lie in the second pass, 6 spans into the third
        with ShardReader(shards, 0, seed=2, cache=cache) as fresh:  # a restarted process
            assert epoch_rows(fresh, epoch, 9, num_rows, start) == uninterrupted[start:]


@pytest.mark.parametrize("cache", [False, True])
def test_an_epoch_of_the_shards_own_length_is_the_epoch_it_always_was(shards, cache):
    with ShardReader(shards, 1, seed=7, cache=cache) as reader:
        given = [[torch.clone(f) for f in batch] for epoch in range(2) for batch in reader.epoch(epoch, 5)]
    with ShardReader(shards, 1, seed=7, cache=cache) as reader:
        rows = reader.num_rows
        told = [[torch.clone(f) for f in batch] for e in range(2) for batch in reader.epoch(e, 5, 0, rows)]
    pairs = [pair for left, right in zip(given, told, strict=True) for pair in zip(left, right, strict=True)]
    assert all(torch.equal(a, b) for a, b in pairs)
