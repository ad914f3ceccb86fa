"""Partition: balanced, seeded, deterministic, lossless, atomic shards with a truthful manifest."""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardfuse.data import shard_writer
from shardfuse.data.manifest import ColumnSpec, manifest_columns, read_manifest
from shardfuse.data.partitioners.iid import rank_assignment, shard_sizes
from shardfuse.data.shard_format import SHAPE_KEY, prefetched
from shardfuse.io import UserError, recorded_sha256, sha256_file, write_stamps
from shardfuse.partition import partition_parquet
from tests.support.data import write_rows, write_tensor_split, write_token_split

REPO = Path(__file__).resolve().parents[3]


def shard_ids(out_dir: Path, manifest: dict) -> list[np.ndarray]:
    return [
        pq.read_table(out_dir / shard["path"], columns=["id"])["id"].to_numpy()
        for shard in manifest["shards"]
    ]


@settings(max_examples=30, deadline=None)
@given(
    num_rows=st.integers(1, 60),
    data=st.data(),
    seed=st.integers(0, 2**32 - 1),
    drop_remainder=st.booleans(),
    batch_size=st.integers(1, 70),
)
def test_shards_are_balanced_and_hold_every_input_row_exactly_once(
    num_rows, data, seed, drop_remainder, batch_size
):
    world_size = data.draw(st.integers(1, min(num_rows, 9)), label="world_size")
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        write_rows(tmp / "in.parquet", num_rows, row_group_size=11)
        manifest = partition_parquet(
            tmp / "in.parquet", tmp / "out", world_size, seed, drop_remainder, batch_size=batch_size
        )
        ids = shard_ids(tmp / "out", manifest)

    sizes = [len(rank_ids) for rank_ids in ids]
    base, remainder = divmod(num_rows, world_size)
    if drop_remainder:
        assert sizes == [base] * world_size
    else:
        assert sizes == [base + 1] * remainder + [base] * (world_size - remainder)
    assert [shard["rows"] for shard in manifest["shards"]] == sizes

    all_ids = np.concatenate(ids)
    assert len(np.unique(all_ids)) == len(all_ids), "a row landed in two shards"
    assert set(all_ids) <= set(range(num_rows))
    assert num_rows - len(all_ids) == manifest["dropped_rows"] == (remainder if drop_remainder else 0)
    assert manifest["total_rows"] == len(all_ids)
    for rank_ids in ids:  # documented: rows keep their input order inside a shard
        assert np.all(np.diff(rank_ids) > 0)


@settings(max_examples=200, deadline=None)
@given(num_rows=st.integers(0, 10_000), world_size=st.integers(1, 300), drop_remainder=st.booleans())
def test_shard_sizes_differ_by_at_most_one_and_first_ranks_get_the_extra_rows(
    num_rows, world_size, drop_remainder
):
    sizes = shard_sizes(num_rows, world_size, drop_remainder)
    assert len(sizes) == world_size
    assert max(sizes) - min(sizes) <= (0 if drop_remainder else 1)
    assert sizes == sorted(sizes, reverse=True)
    assert sum(sizes) == (num_rows - num_rows % world_size if drop_remainder else num_rows)


def test_rank_assignment_uses_one_byte_per_row_for_small_world_sizes():
    assignment = rank_assignment(1000, 8, seed=0, drop_remainder=False)
    assert assignment.dtype == np.uint8
    assert np.bincount(assignment).tolist() == [125] * 8


def test_partition_is_byte_identical_across_runs_and_read_batch_sizes(tmp_path):
    write_rows(tmp_path / "in.parquet", 1000, row_group_size=97)
    runs = {
        "a": partition_parquet(tmp_path / "in.parquet", tmp_path / "a", 3, seed=5),
        "b": partition_parquet(tmp_path / "in.parquet", tmp_path / "b", 3, seed=5),
        "c": partition_parquet(tmp_path / "in.parquet", tmp_path / "c", 3, seed=5, batch_size=13),
    }
    names = sorted(os.listdir(tmp_path / "a"))
    assert names == ["manifest.json", "shard-0.parquet", "shard-1.parquet", "shard-2.parquet"]
    for run in ("b", "c"):
        assert sorted(os.listdir(tmp_path / run)) == names
        for name in names:
            assert (tmp_path / run / name).read_bytes() == (tmp_path / "a" / name).read_bytes(), (run, name)
        assert runs[run] == runs["a"]


def test_shard_bytes_do_not_depend_on_read_batch_size_when_row_groups_span_several_pages(tmp_path):
    # 40-byte strings make a row group larger than one 1 MiB data page; Parquet cuts pages at chunk
    # boundaries too, so this catches a writer fed with however the reads happened to be batched.
    num_rows = 100_000
    text = [f"{v:040d}" for v in np.random.default_rng(0).integers(0, 10**12, num_rows)]
    pq.write_table(pa.table({"id": np.arange(num_rows), "text": text}), tmp_path / "in.parquet")
    partition_parquet(tmp_path / "in.parquet", tmp_path / "big", 2, seed=0)
    partition_parquet(tmp_path / "in.parquet", tmp_path / "small", 2, seed=0, batch_size=1000)
    for name in ("shard-0.parquet", "shard-1.parquet", "manifest.json"):
        assert (tmp_path / "big" / name).read_bytes() == (tmp_path / "small" / name).read_bytes(), name


def test_different_seeds_assign_rows_to_ranks_differently(tmp_path):
    write_rows(tmp_path / "in.parquet", 200)
    first = partition_parquet(tmp_path / "in.parquet", tmp_path / "s0", 4, seed=0)
    second = partition_parquet(tmp_path / "in.parquet", tmp_path / "s1", 4, seed=1)
    ids_first, ids_second = shard_ids(tmp_path / "s0", first), shard_ids(tmp_path / "s1", second)
    assert [len(ids) for ids in ids_first] == [len(ids) for ids in ids_second]
    assert any(not np.array_equal(a, b) for a, b in zip(ids_first, ids_second, strict=True))


def test_assignment_is_a_shuffle_not_a_contiguous_split(tmp_path):
    write_rows(tmp_path / "in.parquet", 400)
    manifest = partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=3)
    rank0 = shard_ids(tmp_path / "out", manifest)[0]
    assert rank0.min() < 100 and rank0.max() >= 300  # a contiguous split would put 0..199 on rank 0


def test_manifest_records_checksums_sizes_schema_and_label_counts(tmp_path):
    source = write_rows(tmp_path / "in.parquet", 103, num_classes=12)
    manifest = partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 4, seed=1, drop_remainder=True)

    assert manifest["format"] == "shardfuse.shards/1"
    assert (manifest["world_size"], manifest["seed"], manifest["drop_remainder"]) == (4, 1, True)
    assert manifest["source"] == {
        "path": str(tmp_path / "in.parquet"),
        "sha256": sha256_file(tmp_path / "in.parquet"),
        "rows": 103,
    }
    assert (manifest["total_rows"], manifest["dropped_rows"]) == (100, 3)
    assert manifest["schema"] == [
        {"name": "id", "type": "int64"},
        {"name": "x0", "type": "float"},
        {"name": "note", "type": "string"},
        {"name": "label", "type": "int64"},
    ]
    for rank, shard in enumerate(manifest["shards"]):
        path = tmp_path / "out" / shard["path"]
        assert shard["path"] == f"shard-{rank}.parquet" and shard["rank"] == rank
        assert shard["sha256"] == sha256_file(path)
        assert shard["bytes"] == path.stat().st_size
        labels = pq.read_table(path)["label"].to_numpy()
        expected = {str(v): int(n) for v, n in zip(*np.unique(labels, return_counts=True), strict=True)}
        assert shard["label_counts"] == expected
        assert list(shard["label_counts"]) == sorted(expected, key=int)  # "10" after "9"
        assert pq.read_schema(path).equals(source.schema, check_metadata=True)
    assert (tmp_path / "out" / "manifest.json").read_text().count(str(tmp_path)) == 1  # only source.path


def test_manifest_omits_label_counts_without_a_label_column(tmp_path):
    pq.write_table(pa.table({"v": np.arange(10)}), tmp_path / "in.parquet")
    manifest = partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    assert all("label_counts" not in shard for shard in manifest["shards"])


def test_failed_write_leaves_no_output_directory_behind(tmp_path, monkeypatch):
    write_rows(tmp_path / "in.parquet", 50)

    def broken_write(self, *args, **kwargs):
        raise RuntimeError("disk full (simulated)")

    monkeypatch.setattr(pq.ParquetWriter, "write_table", broken_write)
    with pytest.raises(RuntimeError, match="simulated"):
        partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    assert sorted(os.listdir(tmp_path)) == ["in.parquet"]  # no out dir and no temporary sibling


def test_failed_rerun_keeps_the_previous_complete_output(tmp_path, monkeypatch):
    write_rows(tmp_path / "in.parquet", 50)
    partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    before = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}

    monkeypatch.setattr(
        pq.ParquetWriter, "write_table", lambda *a, **k: (_ for _ in ()).throw(OSError("boom"))
    )
    with pytest.raises(OSError, match="boom"):
        partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 5, seed=0)
    after = {name: (tmp_path / "out" / name).read_bytes() for name in os.listdir(tmp_path / "out")}
    assert after == before
    assert sorted(os.listdir(tmp_path)) == ["in.parquet", "out"]


@pytest.mark.parametrize(
    ("world_size", "message"),
    [(11, "--world-size 11 exceeds the 10 rows"), (0, "--world-size must be an integer >= 1")],
)
def test_unusable_world_size_is_a_user_error(tmp_path, world_size, message):
    write_rows(tmp_path / "in.parquet", 10)
    with pytest.raises(UserError, match=message):
        partition_parquet(tmp_path / "in.parquet", tmp_path / "out", world_size, seed=0)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- streaming internals and shard layout


@pytest.mark.parametrize("block_rows", [1, 7, 64, 1 << 20])
def test_rank_assignment_drawn_in_blocks_is_exactly_balanced_and_seeded(block_rows):
    assignment = rank_assignment(1003, 4, seed=9, drop_remainder=True, block_rows=block_rows)
    assert np.bincount(assignment, minlength=5).tolist() == [250, 250, 250, 250, 3]  # 4 = dropped
    again = rank_assignment(1003, 4, seed=9, drop_remainder=True, block_rows=block_rows)
    assert np.array_equal(assignment, again)
    assert not np.array_equal(assignment, rank_assignment(1003, 4, 10, True, block_rows=block_rows))


def test_rank_assignment_in_blocks_is_a_uniform_shuffle():
    # Small blocks must not bias where a rank's rows land: each position is equally likely per rank.
    num_rows, world_size, trials = 12, 3, 3000
    hits = np.zeros((num_rows, world_size))
    for seed in range(trials):
        assignment = rank_assignment(num_rows, world_size, seed, False, block_rows=5)
        hits[np.arange(num_rows), assignment] += 1
    assert np.abs(hits / trials - 1 / world_size).max() < 0.04


def test_manifest_records_the_moments_of_every_numeric_column_but_the_label(tmp_path):
    write_rows(tmp_path / "in.parquet", 500, row_group_size=37)
    manifest = partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 3, seed=1, batch_size=41)
    for shard in manifest["shards"]:
        table = pq.read_table(tmp_path / "out" / shard["path"])
        assert set(shard["column_moments"]) == {"id", "x0"}  # not the string column, not the label
        for name, moments in shard["column_moments"].items():
            values = table[name].to_numpy().astype(np.float64)
            assert moments["count"] == len(values)
            assert moments["sum"] == pytest.approx(values.sum(), rel=1e-12)
            assert moments["sum_squares"] == pytest.approx(np.square(values).sum(), rel=1e-12)


def test_float_columns_keep_dictionary_encoding_only_when_their_values_repeat(tmp_path):
    rng = np.random.default_rng(0)
    num_rows = 20_000
    pq.write_table(
        pa.table(
            {
                "noise": rng.standard_normal(num_rows).astype(np.float32),
                "pixel": rng.integers(0, 17, num_rows).astype(np.float32),
                "label": rng.integers(0, 3, num_rows),
            }
        ),
        tmp_path / "in.parquet",
    )
    partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    row_group = pq.ParquetFile(tmp_path / "out" / "shard-0.parquet").metadata.row_group(0)
    has_dictionary = {
        row_group.column(i).path_in_schema: row_group.column(i).has_dictionary_page for i in range(3)
    }
    assert has_dictionary == {"noise": False, "pixel": True, "label": True}


def test_shards_are_cut_into_row_groups_of_at_most_64ki_rows(tmp_path):
    pq.write_table(pa.table({"x0": np.arange(150_000, dtype=np.float32)}), tmp_path / "in.parquet")
    partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 1, seed=0)
    metadata = pq.read_metadata(tmp_path / "out" / "shard-0.parquet")
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [65536, 65536, 18928]


def test_prefetched_yields_in_order_reraises_where_the_source_failed_and_stops_early():
    def source():
        yield from range(5)
        raise ValueError("source broke")

    seen = []
    with pytest.raises(ValueError, match="source broke"):
        for item in prefetched(source()):
            seen.append(item)
    assert seen == [0, 1, 2, 3, 4]

    produced = []

    def endless():
        for i in range(10**9):
            produced.append(i)
            yield i

    for item in prefetched(endless(), depth=2):
        if item == 3:
            break
    time.sleep(0.2)
    assert len(produced) <= 8  # the producer thread stopped instead of running on


def test_input_checksum_comes_from_prepare_only_while_the_file_is_unchanged(digits_dataset, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    train = data / "train.parquet"
    train.write_bytes((digits_dataset / "train.parquet").read_bytes())
    actual = sha256_file(train)
    assert recorded_sha256(digits_dataset / "train.parquet") == actual  # prepare left its record
    # A record whose stamp matches is trusted (a stand-in digest shows it was used, not recomputed).
    stand_in = "ab" * 32
    write_stamps(data, {"train.parquet": stand_in})
    assert partition_parquet(train, tmp_path / "reused", 2, 0)["source"]["sha256"] == stand_in
    # Touched since (a new mtime, as any rewrite gives it): the record is stale and the file is hashed.
    stat = train.stat()
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    assert partition_parquet(train, tmp_path / "rehashed", 2, 0)["source"]["sha256"] == actual
    # A different size with the same mtime: stale too.
    write_stamps(data, {"train.parquet": stand_in})
    stat = train.stat()
    with open(train, "ab") as fh:
        fh.write(b"\0")
    os.utime(train, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert recorded_sha256(train) is None


# ---------------------------------------------------------------- tensor and token layouts


def test_manifest_records_each_columns_kind_dtype_and_shape(tmp_path):
    write_tensor_split(tmp_path / "images.parquet", 60, row_group_size=25)
    manifest = partition_parquet(tmp_path / "images.parquet", tmp_path / "images", 2, seed=0)
    assert manifest["columns"] == [
        {"name": "x", "kind": "tensor", "dtype": "float32", "shape": [1, 8, 8]},
        {"name": "label", "kind": "label", "dtype": "int64", "shape": []},
    ]
    assert manifest_columns(read_manifest(tmp_path / "images")) == (
        ColumnSpec("x", "tensor", "float32", (1, 8, 8)),
        ColumnSpec("label", "label", "int64"),
    )
    write_token_split(tmp_path / "corpus.parquet", 40, block_size=16, dtype=np.int32)
    manifest = partition_parquet(tmp_path / "corpus.parquet", tmp_path / "corpus", 2, seed=0)
    assert manifest["columns"] == [{"name": "tokens", "kind": "tokens", "dtype": "int32", "shape": [17]}]
    # Columns no layout uses are carried and described as "other".
    write_rows(tmp_path / "rows.parquet", 10)
    manifest = partition_parquet(tmp_path / "rows.parquet", tmp_path / "rows", 2, seed=0)
    assert [(c["name"], c["kind"], c["dtype"]) for c in manifest["columns"]] == [
        ("id", "other", "int64"),
        ("x0", "numeric", "float32"),
        ("note", "other", "string"),
        ("label", "label", "int64"),
    ]


@pytest.mark.parametrize("layout", ["tensor", "tokens"])
def test_partition_streams_list_columns_unchanged_with_their_shape_metadata(tmp_path, layout):
    if layout == "tensor":
        source = write_tensor_split(tmp_path / "in.parquet", 90, shape=(3, 2, 2), row_group_size=40)
    else:
        source = write_token_split(tmp_path / "in.parquet", 90, row_group_size=40)
    manifest = partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 3, seed=4, batch_size=7)
    name = source.schema.names[0]
    rows = []
    for shard in manifest["shards"]:
        path = tmp_path / "out" / shard["path"]
        assert pq.read_schema(path).equals(pq.read_schema(tmp_path / "in.parquet"), check_metadata=True)
        if layout == "tensor":
            assert pq.read_schema(path).field("x").metadata == {SHAPE_KEY: b"[3, 2, 2]"}
        assert name not in shard["column_moments"]  # not a numeric column: no moments
        rows += pq.read_table(path)[name].to_pylist()
    assert sorted(rows) == sorted(source[name].to_pylist())  # every row once, values unchanged
    # Seeded, and independent of the read batch size, as for numeric columns.
    assert partition_parquet(tmp_path / "in.parquet", tmp_path / "again", 3, seed=4) == manifest
    for shard in manifest["shards"]:
        written = (tmp_path / "out" / shard["path"]).read_bytes()
        assert (tmp_path / "again" / shard["path"]).read_bytes() == written


def test_partition_refuses_a_tensor_column_whose_shape_does_not_fit_its_rows(tmp_path):
    write_tensor_split(tmp_path / "in.parquet", 10, shape=(1, 8, 8), list_size=60)
    with pytest.raises(UserError) as error:
        partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    assert str(error.value) == (
        f"column 'x' of {tmp_path / 'in.parquet'} holds rows of 60 values but its shape [1, 8, 8] needs 64; "
        "re-create it with the prepare stage"
    )
    assert not (tmp_path / "out").exists()


def test_shards_of_wide_rows_get_row_groups_of_bounded_values_per_column(tmp_path, monkeypatch):
    # Parquet decodes a row group or batch of a list column with per-value work arrays: a token block
    # is 17 values here, so 170 values a column make row groups of 10 rows.
    monkeypatch.setattr(shard_writer, "MAX_COLUMN_VALUES", 170)
    write_token_split(tmp_path / "in.parquet", 95, block_size=16)
    partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, seed=0)
    metadata = pq.read_metadata(tmp_path / "out" / "shard-0.parquet")
    assert [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)] == [10] * 4 + [8]
