"""Adding a partitioner is one module and one record: a toy written to a temporary module, registered by
extending the registry's RECORDS, runs through the real partition stage on a real prepared dataset, and
the shards it writes are its rule's, not iid's; its local rule (each rank's local test distribution)
reaches the real evaluate stage, and without one evaluate has no local sets to score."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import sys
import textwrap

import pyarrow.parquet as pq
import pytest

from shardfuse import partition
from shardfuse.data.manifest import read_manifest
from shardfuse.data.partitioners import registry
from shardfuse.experiment.keys import partition_args, shardset_name, training_name
from shardfuse.experiment.load import load_experiment
from tests.support.helpers import base_config
from tests.support.local import evaluate_on_shard_set

# The toy: rows sorted by label, dealt to the ranks in contiguous blocks of the sorted order (FedAvg's
# sort-and-deal with one block per rank). Streamed as the contract asks: the counting pass gives each
# label's rows, so a row's place in the sorted order is its label's offset plus the rows of that label
# already dealt.
TOY_MODULE = """
import numpy as np

from shardfuse.data.partitioners.assignment import Cells


def columns(params):
    return ("label",)


def assign(layout, counts, params):
    offsets, start = {}, 0
    for value, rows in counts["label"].items():
        offsets[value] = start
        start += rows
    dealt = dict.fromkeys(offsets, 0)

    def deal(num_rows, shown):
        labels = shown["label"]
        ranks = np.empty(num_rows, dtype=np.int64)
        for value in np.unique(labels):
            where = np.flatnonzero(labels == value)
            places = offsets[value] + dealt[value] + np.arange(len(where))
            dealt[value] += len(where)
            ranks[where] = places * layout.world_size // layout.num_rows
        return ranks

    return deal


def local(layout, shards, params):
    # Each rank's local test distribution: the classes it was dealt, each weighing alike (not in its
    # training proportions, as the built-in label partitions weigh them).
    names = sorted({label for shard in shards for label in shard["label_counts"]}, key=int)
    index = {name: cell for cell, name in enumerate(names)}
    weights = [
        tuple(1 / len(shard["label_counts"]) if name in shard["label_counts"] else 0.0 for name in names)
        for shard in shards
    ]
    cell_of = lambda num_rows, shown: np.array([index.get(str(v), -1) for v in shown["label"].tolist()])
    return Cells(tuple(names), tuple(weights), cell_of)
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's record, its module imported from tmp_path and its record added to RECORDS."""
    path = tmp_path / "toy_partitioner.py"
    path.write_text(textwrap.dedent(TOY_MODULE))
    spec = importlib.util.spec_from_file_location("toy_partitioner", path)
    module = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, "toy_partitioner", module)
    spec.loader.exec_module(module)
    record = registry.Partitioner(
        "sorted_blocks",
        module.assign,
        "sort by label, deal contiguous blocks",
        columns=module.columns,
        local=module.local,
    )
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, record))
    return record


def shard_labels(out_dir, world_size: int) -> list[list[int]]:
    return [
        sorted(set(pq.read_table(out_dir / f"shard-{rank}.parquet", columns=["label"])["label"].to_pylist()))
        for rank in range(world_size)
    ]


def test_a_toy_partitioner_in_a_temporary_module_deals_the_shards_of_the_real_stage(
    toy, digits_dataset, tmp_path
):
    out_dir = tmp_path / "shards"
    partition.main(
        ["--input", str(digits_dataset / "train.parquet"), "--world-size", "2", "--seed", "0",
         "--partitioner", "sorted_blocks", "--out-dir", str(out_dir)]
    )  # fmt: skip

    manifest = read_manifest(out_dir)
    labels = shard_labels(out_dir, 2)
    # Sorted and cut once: rank 0 holds the low digits, rank 1 the high ones, sharing at most the digit
    # the cut falls in. iid would give both ranks all ten.
    assert labels[0][0] == 0 and labels[1][-1] == 9
    assert labels[0][-1] <= labels[1][0] and len(set(labels[0]) & set(labels[1])) <= 1
    rows = [shard["rows"] for shard in manifest["shards"]]
    assert abs(rows[0] - rows[1]) <= 1 and sum(rows) == manifest["source"]["rows"]
    assert manifest["partition"] == {"name": "sorted_blocks", "params": {}}
    counts = [manifest["shards"][rank]["label_counts"] for rank in range(2)]
    assert [sorted(map(int, c)) for c in counts] == labels


def test_a_toy_partitioner_names_its_shard_set_and_training_and_reaches_the_partition_command(toy):
    run = load_experiment(base_config({"r": {"world_size": 4}}), environ={}).runs["r"]
    toy_run = {**run, "partition": "sorted_blocks"}  # the schema's enum would list it: one line there
    assert run["partition"] == "iid" and shardset_name(run) == "w4-seed0"
    assert shardset_name(toy_run) == "w4-seed0-sorted_blocks"
    assert partition_args(run) == "--world-size 4 --seed 0"
    assert partition_args(toy_run) == "--world-size 4 --seed 0 --partitioner sorted_blocks --params-json '{}'"
    assert training_name(toy_run) != training_name(run)
    assert toy.identity({}) == {"partition": "sorted_blocks"}
    assert dataclasses.replace(toy, named=False).identity({}) == {}


def test_a_toy_partitioners_local_rule_gives_the_real_evaluate_stage_its_local_sets(
    toy, digits_dataset, tmp_path, monkeypatch
):
    shards = tmp_path / "shards"
    partition.main(
        ["--input", str(digits_dataset / "train.parquet"), "--world-size", "2", "--seed", "0",
         "--partitioner", "sorted_blocks", "--out-dir", str(shards)]
    )  # fmt: skip
    local = ("--set", f"local={shards}/manifest.json")
    status, stderr, out = evaluate_on_shard_set(tmp_path, digits_dataset, shards, *local)
    assert status == 0, stderr
    evaluation = json.loads(out.read_text())
    for rank, labels in enumerate(shard_labels(shards, 2)):
        weights = evaluation["sets"][f"local_rank_{rank}"]["weights"]
        assert weights == {str(label): pytest.approx(1 / len(labels)) for label in labels}  # the toy's mix
        own = evaluation["sets"][f"local_rank_{rank}"]["ranks"][rank]["accuracy"]
        assert evaluation[f"local_accuracy_rank_{rank}"] == own
    assert "normalized_accuracy" in evaluation

    # Without a local rule, the same shard set has no local sets (as iid's has none).
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS[:-1], dataclasses.replace(toy, local=None)))
    status, stderr, _ = evaluate_on_shard_set(tmp_path, digits_dataset, shards, *local)
    assert (
        status == 2 and "is partitioned sorted_blocks, whose ranks have no local test distribution" in stderr
    )
