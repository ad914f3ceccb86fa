"""Each rank's local test distribution as its partitioner defines it, read off a real shard set and a
hand-made test split: label partitions weigh the classes by the rank's training label mix, column takes
the test rows of the rank's groups, size the whole split, continuous cuts the test rows by the same rule;
an iid shard set has none, and a test split without the partitioner's column is one line."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.data.local_sets import local_cells
from shardfuse.io import UserError
from shardfuse.partition import partition_parquet
from tests.support.local import grouped_dataset

WORLD_SIZE = 3


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    return grouped_dataset(tmp_path_factory.mktemp("grouped") / "dataset", test_groups=14)


def shard_set(dataset, out, name: str, params: dict, source: str = "train.parquet") -> dict:
    return partition_parquet(dataset / source, out, WORLD_SIZE, 5, partitioner=name, params=params)


def test_label_partitions_weigh_the_classes_by_each_ranks_training_label_mix(dataset, tmp_path):
    manifest = shard_set(dataset, tmp_path / "shards", "dirichlet", {"alpha": 0.3})
    cells = local_cells(tmp_path / "shards" / "manifest.json", dataset / "test.parquet")
    assert cells.names == ("0", "1", "2", "3")
    for rank, shard in enumerate(manifest["shards"]):
        counts = np.array([shard["label_counts"].get(name, 0) for name in cells.names], dtype=np.float64)
        np.testing.assert_array_equal(cells.weights[rank], counts / counts.sum())
    labels = pq.read_table(dataset / "test.parquet")["label"].to_numpy()
    np.testing.assert_array_equal(cells.of_row, labels)  # cell k: the test rows of class k


def test_column_takes_the_test_rows_of_each_ranks_groups_and_none_of_a_group_no_rank_had(dataset, tmp_path):
    manifest = shard_set(dataset, tmp_path / "shards", "column", {"column": "user"})
    cells = local_cells(tmp_path / "shards", dataset / "test.parquet")  # the directory will do
    owner = {int(v): s["rank"] for s in manifest["shards"] for v in s["value_counts"]["user"]}
    users = pq.read_table(dataset / "test.parquet")["user"].to_pylist()
    assert cells.of_row.tolist() == [owner.get(user, -1) for user in users]
    assert {12, 13} <= set(users) and -1 in cells.of_row  # groups only the test split has: in no cell
    np.testing.assert_array_equal(cells.weights, np.eye(WORLD_SIZE))


def test_size_is_the_whole_split_for_every_rank(dataset, tmp_path):
    shard_set(dataset, tmp_path / "shards", "size", {"law": "linear"})
    cells = local_cells(tmp_path / "shards" / "manifest.json", dataset / "test.parquet")
    assert cells.names == ("all",) and not cells.of_row.any() and len(cells.of_row) == 600
    np.testing.assert_array_equal(cells.weights, np.ones((WORLD_SIZE, 1)))


def test_continuous_cuts_the_test_rows_by_the_rule_that_cut_the_training_rows(dataset, tmp_path):
    params = {"column": "x0", "strictness": 0.7}
    shard_set(dataset, tmp_path / "shards", "continuous", params)
    cells = local_cells(tmp_path / "shards" / "manifest.json", dataset / "test.parquet")
    # The same rule (params and seed; a test run needs one row) dealing the test split itself.
    shard_set(dataset, tmp_path / "test-cut", "continuous", {**params, "min_rows": 1}, source="test.parquet")
    rank_of = {
        row_id: rank
        for rank in range(WORLD_SIZE)
        for row_id in pq.read_table(tmp_path / "test-cut" / f"shard-{rank}.parquet")["id"].to_pylist()
    }
    ids = pq.read_table(dataset / "test.parquet")["id"].to_pylist()
    assert cells.of_row.tolist() == [rank_of[row_id] for row_id in ids]
    assert sorted(set(cells.of_row.tolist())) == [0, 1, 2]


def test_an_iid_shard_set_has_no_local_distributions(dataset, tmp_path):
    shard_set(dataset, tmp_path / "shards", "iid", {})
    with pytest.raises(
        UserError, match=r"is partitioned iid, whose ranks have no local test distribution but the global"
    ):
        local_cells(tmp_path / "shards" / "manifest.json", dataset / "test.parquet")


def test_a_test_split_without_the_group_column_says_to_prepare_again(dataset, tmp_path):
    shard_set(dataset, tmp_path / "shards", "column", {"column": "user"})
    bare = tmp_path / "bare"
    bare.mkdir()
    pq.write_table(pq.read_table(dataset / "test.parquet").drop_columns(["user"]), bare / "test.parquet")
    (bare / "dataset.json").write_text((dataset / "dataset.json").read_text())
    with pytest.raises(
        UserError,
        match=r"^partitioner column finds each rank's local test rows by column 'user', which test split .* "
        r"does not have \(it has id, x0, x1, label\); re-run the prepare stage so that the splits carry it",
    ):
        local_cells(tmp_path / "shards" / "manifest.json", bare / "test.parquet")


def test_a_shard_set_of_another_dataset_is_refused(dataset, tmp_path):
    shard_set(dataset, tmp_path / "shards", "dirichlet", {"alpha": 1.0})
    other = grouped_dataset(tmp_path / "other", train_rows=1000)
    with pytest.raises(UserError, match=r"the shard set is not of this test split's dataset"):
        local_cells(tmp_path / "shards" / "manifest.json", other / "test.parquet")
    assert json.loads((other / "dataset.json").read_text())["rows"]["train"] == 1000
