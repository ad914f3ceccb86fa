"""Data: manifest checks, shard verification and Parquet -> tensor loading for one rank."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from shardfuse.data import (
    load_shard,
    load_table,
    num_features,
    read_dataset_info,
    read_manifest,
    verify_shard,
)
from shardfuse.io import UserError
from shardfuse.partition import partition_parquet
from shardfuse.prepare import prepare

NUM_FEATURES = 12  # > 10, so a string sort of x0..x11 would put x10 before x2
SPEC = {"source": "synthetic", "num_rows": 500, "num_features": NUM_FEATURES, "num_classes": 3, "seed": 1}


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> tuple[Path, Path]:
    """(dataset dir, shard dir): a small synthetic dataset whose train split is cut into 3 shards."""
    root = tmp_path_factory.mktemp("data")
    prepare("syn", SPEC, root / "dataset")
    partition_parquet(root / "dataset" / "train.parquet", root / "shards", world_size=3, seed=0)
    return root / "dataset", root / "shards"


@pytest.fixture
def shard_copy(prepared, tmp_path) -> Path:
    """A private copy of the shard dir that a test may damage."""
    return Path(shutil.copytree(prepared[1], tmp_path / "shards"))


def rows_as_sorted_array(features: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    rows = np.column_stack([features.numpy(), labels.numpy()])
    return rows[np.lexsort(rows.T[::-1])]


def test_load_table_returns_float32_features_and_int64_labels_in_file_row_order(prepared):
    path = prepared[0] / "train.parquet"
    features, labels = load_table(path)
    table = pq.read_table(path)
    assert features.dtype == torch.float32 and labels.dtype == torch.int64
    assert features.shape == (table.num_rows, NUM_FEATURES) and labels.shape == (table.num_rows,)
    for j in range(NUM_FEATURES):
        assert np.array_equal(features[:, j].numpy(), table[f"x{j}"].to_numpy())
    assert np.array_equal(labels.numpy(), table["label"].to_numpy())


def test_load_table_orders_feature_columns_numerically_whatever_the_file_order(tmp_path):
    columns = {"label": np.array([0, 1], dtype=np.int32)}
    for j in (10, 2, 0, 11, 1, 3, 4, 5, 6, 7, 8, 9):
        columns[f"x{j}"] = np.full(2, j, dtype=np.float64)  # float64 and int32 get converted too
    pq.write_table(pa.table(columns), tmp_path / "shuffled.parquet")
    features, labels = load_table(tmp_path / "shuffled.parquet")
    assert features[0].tolist() == [float(j) for j in range(12)]
    assert (features.dtype, labels.dtype, labels.tolist()) == (torch.float32, torch.int64, [0, 1])


def test_load_table_gives_the_same_tensors_for_any_batch_size(prepared):
    path = prepared[0] / "test.parquet"
    features, labels = load_table(path)
    small_features, small_labels = load_table(path, batch_size=7)
    assert torch.equal(features, small_features) and torch.equal(labels, small_labels)


@pytest.mark.parametrize(
    ("columns", "message"),
    [
        ({"x0": [1.0], "x1": [2.0]}, "has no 'label' column"),
        ({"x0": [1.0], "x2": [2.0], "label": [0]}, "lacks feature column.* x1"),
        ({"a": [1.0], "label": [0]}, r"has no feature columns x0, x1, \.\.\. \(columns found: a, label\)"),
        ({"x0": [1.0], "label": ["cat"]}, "column 'label' .* has type string, expected an integer"),
        ({"x0": [None, 1.0], "label": [0, 1]}, "column 'x0' .* has 1 missing value"),
    ],
)
def test_load_table_rejects_files_not_made_by_prepare(tmp_path, columns, message):
    pq.write_table(pa.table(columns), tmp_path / "odd.parquet")
    with pytest.raises(UserError, match=message):
        load_table(tmp_path / "odd.parquet")


def test_load_table_on_a_missing_or_corrupt_file_is_a_user_error(tmp_path):
    with pytest.raises(UserError, match="does not exist"):
        load_table(tmp_path / "nope.parquet")
    (tmp_path / "text.parquet").write_text("not parquet")
    with pytest.raises(UserError, match="is not a readable Parquet file"):
        load_table(tmp_path / "text.parquet")


def test_shards_loaded_per_rank_add_up_to_the_train_split(prepared):
    dataset_dir, shard_dir = prepared
    loaded = [load_shard(shard_dir, rank) for rank in range(3)]
    assert [len(labels) for _, labels in loaded] == [
        shard["rows"] for shard in read_manifest(shard_dir)["shards"]
    ]
    all_features = torch.cat([features for features, _ in loaded])
    all_labels = torch.cat([labels for _, labels in loaded])
    assert np.array_equal(
        rows_as_sorted_array(all_features, all_labels),
        rows_as_sorted_array(*load_table(dataset_dir / "train.parquet")),
    )


def test_load_shard_needs_only_its_own_shard_file(shard_copy):
    (shard_copy / "shard-0.parquet").unlink()
    (shard_copy / "shard-2.parquet").unlink()
    features, labels = load_shard(shard_copy, 1)
    assert features.shape[0] == labels.shape[0] == read_manifest(shard_copy)["shards"][1]["rows"]
    with pytest.raises(UserError, match=r"shard of rank 0 .* is missing; re-run the partition stage"):
        load_shard(shard_copy, 0)


def test_verify_shard_detects_a_tampered_shard_of_the_same_size(shard_copy):
    path = shard_copy / "shard-1.parquet"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    manifest = read_manifest(shard_copy)
    with pytest.raises(
        UserError, match=r"shard of rank 1 .* does not match its sha256 .*snakemake -R partition"
    ):
        verify_shard(shard_copy, 1, manifest)
    with pytest.raises(UserError, match="rank 1"):
        load_shard(shard_copy, 1)
    assert verify_shard(shard_copy, 1, manifest, checksum=False) == path  # size alone cannot tell
    assert verify_shard(shard_copy, 0, manifest) == shard_copy / "shard-0.parquet"


def test_verify_shard_detects_a_truncated_shard_without_reading_it(shard_copy):
    path = shard_copy / "shard-2.parquet"
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(UserError, match=r"shard of rank 2 .* has \d+ bytes, manifest says \d+"):
        verify_shard(shard_copy, 2, read_manifest(shard_copy), checksum=False)


def test_verify_shard_rejects_a_rank_outside_the_world_size(prepared):
    with pytest.raises(UserError, match=r"rank 3 has no shard: .* holds 3 shards"):
        verify_shard(prepared[1], 3, read_manifest(prepared[1]))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda m: m.update(format="shardfuse.shards/0"), "has format 'shardfuse.shards/0', expected"),
        (lambda m: m.pop("shards"), "lacks shards"),
        (lambda m: m["shards"][1].pop("sha256"), r"lacks shards\[1\]\.sha256"),
        (lambda m: m["shards"].reverse(), "does not list ranks 0..2 in order"),
    ],
)
def test_read_manifest_rejects_a_damaged_manifest(shard_copy, change, message):
    manifest = json.loads((shard_copy / "manifest.json").read_text())
    change(manifest)
    (shard_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=message):
        read_manifest(shard_copy)


def test_read_manifest_without_a_partition_run_says_so(tmp_path):
    with pytest.raises(UserError, match=r"shard manifest .* does not exist"):
        read_manifest(tmp_path)


def test_read_dataset_info_matches_the_prepared_files(prepared):
    dataset_dir = prepared[0]
    info = read_dataset_info(dataset_dir)
    assert (info["num_features"], info["num_classes"]) == (NUM_FEATURES, 3)
    assert num_features(dataset_dir / "train.parquet") == NUM_FEATURES
    assert info["rows"]["train"] == len(load_table(dataset_dir / "train.parquet")[1])


def test_read_dataset_info_rejects_an_incomplete_file(tmp_path):
    (tmp_path / "dataset.json").write_text(json.dumps({"name": "x", "num_features": 3}))
    with pytest.raises(UserError, match="lacks source, num_classes"):
        read_dataset_info(tmp_path)
