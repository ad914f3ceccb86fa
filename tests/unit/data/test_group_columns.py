"""Group columns as data: a user file's keep_columns and digits' writers reach the train/val/test split
files unchanged and row-aligned, travel through a column partition into the shards, and never become a
model input; a spec that asks for nothing keeps today's files."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq
import pytest

from shardfuse import partition, prepare
from shardfuse.data import reader
from shardfuse.data.shard_format import recognise_layout
from shardfuse.io import UserError

SPLITS = ("train", "val", "test")


def splits(out_dir: Path) -> dict[str, pa.Table]:
    return {split: pq.read_table(out_dir / f"{split}.parquet") for split in SPLITS}


def user_table(num_rows: int = 240) -> pa.Table:
    """Rows whose feature ``a`` is the row id, so each split row can be traced to its user and site."""
    ids = np.arange(num_rows)
    return pa.table(
        {
            "a": ids.astype(np.float64),
            "b": (ids % 7).astype(np.float64),
            "user": (ids // 20).astype(np.int64),  # 12 users of 20 rows
            "site": [f"site-{i % 3}" for i in ids],
            "y": [f"c{i % 4}" for i in ids],
        }
    )


def user_spec(path: Path, **keys) -> dict:
    return {
        "source": path.suffix[1:],
        "path": str(path),
        "feature_columns": ["a", "b"],
        "label_column": "y",
    } | keys


@pytest.fixture(scope="module")
def digits(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("digits")
    prepare.prepare("plain", {"source": "digits"}, root / "plain")
    prepare.prepare("writers", {"source": "digits", "writers": 13}, root / "writers")
    return {"plain": root / "plain", "writers": root / "writers"}


def test_digits_writers_are_contiguous_blocks_of_the_file_order_and_change_no_other_column(digits):
    plain, grouped = splits(digits["plain"]), splits(digits["writers"])
    for split in SPLITS:
        assert grouped[split].schema.names == [*plain[split].schema.names, "writer"]
        assert grouped[split].schema.field("writer").type == pa.int64()
        assert grouped[split].drop_columns(["writer"]).equals(plain[split])
    writers = np.concatenate([grouped[split]["writer"].to_numpy() for split in SPLITS])
    # 1797 rows in 13 blocks: writer w holds rows [ceil(1797 w / 13), ceil(1797 (w + 1) / 13)).
    expected = np.bincount(np.arange(1797) * 13 // 1797)
    assert np.bincount(writers).tolist() == expected.tolist()
    assert set(expected.tolist()) == {138, 139}
    info = json.loads((digits["writers"] / "dataset.json").read_text())
    assert info["num_features"] == 64 and info["feature_names"][-1] == "pixel_7_7"  # not an input


def test_a_spec_without_group_keys_writes_no_extra_column(digits, tmp_path):
    assert splits(digits["plain"])["train"].schema.names[-1] == "label"
    info = json.loads((digits["plain"] / "dataset.json").read_text())
    assert "writers" not in json.dumps(info) and "keep_columns" not in json.dumps(info)


@pytest.mark.parametrize("suffix", ["csv", "parquet"])
def test_keep_columns_reach_every_split_unchanged_beside_their_rows(tmp_path, suffix):
    table = user_table()
    path = tmp_path / f"data.{suffix}"
    if suffix == "csv":
        pacsv.write_csv(table, path)
    else:
        pq.write_table(table, path)
    prepare.prepare("u", user_spec(path, keep_columns=["user", "site"]), tmp_path / "out")
    found = splits(tmp_path / "out")
    for split in SPLITS:
        rows = found[split]
        assert rows.schema.names == ["x0", "x1", "label", "user", "site"]
        assert rows.schema.field("user").type == pa.int64() and rows.schema.field("site").type == pa.string()
        ids = rows["x0"].to_numpy().astype(np.int64)
        assert rows["user"].to_pylist() == table["user"].take(ids).to_pylist()
        assert rows["site"].to_pylist() == table["site"].take(ids).to_pylist()
    assert sum(len(found[split]) for split in SPLITS) == len(table)


def test_keep_columns_follow_the_rows_a_classes_filter_keeps(tmp_path):
    table = user_table()
    path = tmp_path / "data.parquet"
    pq.write_table(table.replace_schema_metadata(None), path)
    spec = user_spec(path, keep_columns=["user"], classes=["c1", "c3"])
    prepare.prepare("u", spec, tmp_path / "out")
    rows = pa.concat_tables(splits(tmp_path / "out").values())
    ids = rows["x0"].to_numpy().astype(np.int64)
    assert sorted(ids.tolist()) == [i for i in range(len(table)) if i % 4 in (1, 3)]
    assert rows["user"].to_pylist() == table["user"].take(ids).to_pylist()


def test_a_categorical_keep_column_is_carried_as_its_values(tmp_path):
    table = user_table().append_column(
        "team", pc.dictionary_encode(pa.array([f"t{i % 5}" for i in range(240)]))
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    prepare.prepare("u", user_spec(path, keep_columns=["team"]), tmp_path / "out")
    train = splits(tmp_path / "out")["train"]
    assert train.schema.field("team").type == pa.string()
    assert train["team"].to_pylist() == [f"t{int(i) % 5}" for i in train["x0"].to_numpy()]


@pytest.mark.parametrize(
    ("keys", "columns", "message"),
    [
        ({"keep_columns": ["y"]}, {}, "spec key 'keep_columns' names 'y', a target column of this spec"),
        ({"keep_columns": ["x0"]}, {"x0": [1] * 40}, "names 'x0', a name the split files reserve"),
        ({"keep_columns": ["user", "user"]}, {}, "'keep_columns' must be a non-empty list of distinct"),
        ({"keep_columns": ["nosuch"]}, {}, "column(s) 'nosuch' not found in"),
        ({"keep_columns": ["gap"]}, {"gap": [1] * 39 + [None]}, "keep column 'gap' in"),
        ({"keep_columns": ["gap"]}, {"gap": [1] * 39 + [None]}, "has 1 missing value(s); fill or drop"),
        ({"keep_columns": ["when"]}, {"when": [[1]] * 40}, "has type list<element: int64>; keep columns of "),
        ({"writers": 3}, {}, "unknown key(s) 'writers' in the 'parquet' dataset spec"),
    ],
)  # fmt: skip
def test_bad_keep_columns_are_one_line_errors_before_a_split_is_written(tmp_path, keys, columns, message):
    ids = np.arange(40)
    table = pa.table(
        {"a": ids.astype(float), "b": ids.astype(float), "user": ids // 10, "y": ids % 2, **columns}
    )
    path = tmp_path / "data.parquet"
    pq.write_table(table, path)
    with pytest.raises(UserError, match=re.escape(message)):
        prepare.prepare("u", user_spec(path, **keys), tmp_path / "out")
    assert not (tmp_path / "out" / "dataset.json").exists()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": "digits", "writers": 1}, "spec key 'writers' must be an integer from 2 to 1797, got 1"),
        (
            {"source": "digits_images", "writers": 1800},
            "spec key 'writers' must be an integer from 2 to 1797",
        ),
        ({"source": "diabetes", "writers": 4}, "unknown key(s) 'writers' in the 'diabetes' dataset spec"),
    ],
)
def test_bad_writers_are_one_line_errors(tmp_path, spec, message):
    with pytest.raises(UserError, match=re.escape(message)):
        prepare.prepare("d", spec, tmp_path / "out")


def test_the_writer_column_travels_through_a_column_partition_and_never_into_a_batch(digits, tmp_path):
    """prepare -> partition --partitioner column: each writer's rows on one rank, the manifest's counts a
    recount of the shards, the reader's inputs the 64 pixels only."""
    shards = tmp_path / "shards"
    partition.main([
        "--input", str(digits["writers"] / "train.parquet"), "--world-size", "4", "--seed", "0",
        "--partitioner", "column", "--params-json", '{"column": "writer"}', "--out-dir", str(shards),
        "--batch-size", "100",
    ])  # fmt: skip
    manifest = json.loads((shards / "manifest.json").read_text())
    train = pq.read_table(digits["writers"] / "train.parquet")
    seen = []
    for rank in range(4):
        shard = pq.read_table(shards / f"shard-{rank}.parquet")
        assert shard.schema == train.schema  # the column travels as it is
        writers, counts = np.unique(shard["writer"].to_numpy(), return_counts=True)
        recount = {str(w): int(n) for w, n in zip(writers, counts, strict=True)}
        assert manifest["shards"][rank]["value_counts"] == {"writer": recount}
        seen += writers.tolist()
        assert recognise_layout(shard.schema, "shard").feature_names == [f"x{j}" for j in range(64)]
        features, _ = reader.load_shard(shards, rank)
        assert tuple(features.shape) == (len(shard), 64)
        pixels = np.stack([shard[f"x{j}"].to_numpy() for j in range(64)], axis=1)
        assert np.array_equal(features.numpy(), pixels)
    assert sorted(seen) == list(range(13))  # every writer on exactly one rank
    assert sum(shard["rows"] for shard in manifest["shards"]) == len(train)
    assert manifest["partition"] == {
        "name": "column",
        "params": {"column": "writer", "groups": None, "min_rows": 10},
    }
