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

from shardfuse.data import shard_writer
from shardfuse.data.dataset_info import read_dataset_info
from shardfuse.data.manifest import read_manifest
from shardfuse.data.moments import feature_stats
from shardfuse.data.reader import ShardReader, load_shard, load_table, num_features
from shardfuse.data.shard_format import SHAPE_KEY, ColumnSpec, list_values, recognise_layout
from shardfuse.data.verify import verify_shard
from shardfuse.io import UserError
from shardfuse.partition import partition_parquet
from shardfuse.prepare import prepare
from tests.support.data import write_tensor_split, write_token_split

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
        ({"x0": [1.0], "y0": ["high"]}, "column 'y0' .* has type string, expected a number"),
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


def test_load_table_reads_regression_targets_and_token_blocks(tmp_path):
    pq.write_table(pa.table({"x0": [1.0, 2.0], "y1": [3.0, 4.0], "y0": [5.0, 6.0]}), tmp_path / "r.parquet")
    features, targets = load_table(tmp_path / "r.parquet")
    assert (targets.dtype, targets.tolist()) == (torch.float32, [[5.0, 3.0], [6.0, 4.0]])
    pq.write_table(pa.table({"x0": [1.0, 2.0], "x1": [7.0, 8.0]}), tmp_path / "t.parquet")
    features, targets = load_table(tmp_path / "t.parquet")
    assert (features.tolist(), tuple(targets.shape)) == ([[1.0, 7.0], [2.0, 8.0]], (2, 0))


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


# ---------------------------------------------------------------- streaming reader and manifest stats

STREAM_ROWS = 2_000


@pytest.fixture(scope="module")
def streamed(tmp_path_factory) -> Path:
    """A 2-shard set whose shards have many small row groups (what large shards look like)."""
    root = tmp_path_factory.mktemp("stream")
    spec = {**SPEC, "num_rows": STREAM_ROWS, "num_features": 5}
    prepare("syn", spec, root / "dataset")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(shard_writer, "MAX_ROW_GROUP_ROWS", 64)
        partition_parquet(root / "dataset" / "train.parquet", root / "shards", world_size=2, seed=0)
    return root / "shards"


def epoch_batches(reader: ShardReader, epoch: int, num_batches: int, start_batch: int = 0) -> list:
    return [(f.clone(), y.clone()) for f, y in reader.epoch(epoch, num_batches, start_batch)]


def same_batches(left: list, right: list) -> bool:
    return len(left) == len(right) and all(
        torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(left, right, strict=True)
    )


@pytest.mark.parametrize("cache", [False, True])
def test_shard_reader_epochs_hold_every_row_once_in_tensor_split_batch_sizes(streamed, cache):
    features, labels = load_shard(streamed, 1)
    with ShardReader(streamed, 1, seed=4, cache=cache) as reader:
        assert pq.ParquetFile(reader.path).metadata.num_row_groups > 5
        for epoch in range(3):
            batches = epoch_batches(reader, epoch, 13)
            expected_sizes = [len(b) for b in torch.tensor_split(torch.arange(len(labels)), 13)]
            assert [len(y) for _, y in batches] == expected_sizes
            assert np.array_equal(
                rows_as_sorted_array(torch.cat([f for f, _ in batches]), torch.cat([y for _, y in batches])),
                rows_as_sorted_array(features, labels),
            )
            assert batches[0][0].dtype == torch.float32 and batches[0][1].dtype == torch.int64


def test_shard_reader_shuffles_across_row_groups_differently_every_epoch(streamed):
    with ShardReader(streamed, 0, seed=1) as reader:
        first, second = epoch_batches(reader, 0, 10), epoch_batches(reader, 1, 10)
        again = epoch_batches(reader, 0, 10)
    assert same_batches(first, again)  # seeded by (seed, epoch)
    assert not torch.equal(first[0][0], second[0][0])
    features, _ = load_shard(streamed, 0)
    file_position = {tuple(row.tolist()): i for i, row in enumerate(features)}
    positions = [file_position[tuple(row.tolist())] for row in first[3][0]]
    assert max(positions) - min(positions) > 64  # one batch mixes several row groups


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("epoch", [0, 2])
def test_resuming_mid_epoch_gives_the_remaining_batches_of_an_uninterrupted_run(streamed, cache, epoch):
    with ShardReader(streamed, 0, seed=2, cache=cache) as reader:
        for earlier in range(epoch):
            epoch_batches(reader, earlier, 9)
        uninterrupted = epoch_batches(reader, epoch, 9)
    for start_batch in (1, 5, 9):
        with ShardReader(streamed, 0, seed=2, cache=cache) as fresh:  # a restarted process
            assert same_batches(epoch_batches(fresh, epoch, 9, start_batch), uninterrupted[start_batch:])


def test_shard_reader_checks_the_sha256_by_the_end_of_the_first_epoch(streamed, tmp_path):
    shard_dir = Path(shutil.copytree(streamed, tmp_path / "shards"))
    manifest = json.loads((shard_dir / "manifest.json").read_text())
    manifest["shards"][1]["sha256"] = "0" * 64  # readable shard, wrong checksum: only sha256 can tell
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    with ShardReader(shard_dir, 1) as reader:
        batches = reader.epoch(0, 4)
        for _ in range(4):
            next(batches)
        with pytest.raises(UserError, match=r"shard of rank 1 .* does not match its sha256") as error:
            next(batches)
    assert str(error.value).endswith(
        "does not match its sha256 in the manifest; re-run the partition stage (snakemake -R partition)"
    )
    with ShardReader(shard_dir, 0) as reader:  # rank 0 is intact
        assert len(epoch_batches(reader, 0, 4)) == 4


def test_shard_reader_on_a_corrupt_row_group_is_a_user_error_naming_the_rank(streamed, tmp_path):
    shard_dir = Path(shutil.copytree(streamed, tmp_path / "shards"))
    path = shard_dir / "shard-1.parquet"
    data = bytearray(path.read_bytes())
    data[10] ^= 0xFF  # inside the first data page's header
    path.write_bytes(bytes(data))
    with (
        pytest.raises(UserError, match=r"shard of rank 1 .* could not be read .*snakemake -R partition"),
        ShardReader(shard_dir, 1, verify=False) as reader,
    ):
        epoch_batches(reader, 0, 4)


def test_shard_reader_rejects_batch_counts_that_do_not_fit_the_shard(streamed):
    with ShardReader(streamed, 0) as reader:
        with pytest.raises(UserError, match="batches per epoch do not fit"):
            next(reader.epoch(0, reader.num_rows + 1))
        with pytest.raises(UserError, match="start batch 5 is outside"):
            next(reader.epoch(0, 4, start_batch=5))


def test_feature_stats_from_the_manifest_match_the_whole_training_split(streamed):
    manifest = read_manifest(streamed)
    mean, std = feature_stats(manifest, 5)
    features = torch.cat([load_shard(streamed, rank)[0] for rank in range(2)]).double()
    assert torch.allclose(mean.double(), features.mean(0), atol=1e-6)
    assert torch.allclose(std.double(), features.std(0, unbiased=False), atol=1e-6)


def test_feature_stats_without_moments_in_the_manifest_is_none(streamed):
    manifest = read_manifest(streamed)
    for shard in manifest["shards"]:
        del shard["column_moments"]
    assert feature_stats(manifest, 5) is None


def test_read_manifest_accepts_a_manifest_without_columns_and_rejects_malformed_ones(shard_copy):
    manifest = json.loads((shard_copy / "manifest.json").read_text())
    assert manifest["columns"][0] == {"name": "x0", "kind": "numeric", "dtype": "float32", "shape": []}
    del manifest["columns"]  # as partition wrote it before it recorded columns
    (shard_copy / "manifest.json").write_text(json.dumps(manifest))
    assert "columns" not in read_manifest(shard_copy)
    manifest["columns"] = [{"name": "x", "kind": "picture", "dtype": "float32", "shape": [8]}]
    (shard_copy / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="has a malformed 'columns' list"):
        read_manifest(shard_copy)


# ---------------------------------------------------------------- tensor and token layouts

LAYOUT_ROWS = 301  # odd, so shards and batches differ in size
LAYOUTS = ("tensor", "tensor_regression", "tokens_uint16", "tokens_int32")


def write_layout(path: Path, layout: str) -> pa.Table:
    """A prepared split of ``layout`` in 3 row groups."""
    if layout.startswith("tensor"):
        targets = "label" if layout == "tensor" else "y"
        return write_tensor_split(path, LAYOUT_ROWS, shape=(1, 8, 8), row_group_size=120, targets=targets)
    dtype = np.uint16 if layout == "tokens_uint16" else np.int32
    return write_token_split(path, LAYOUT_ROWS, block_size=16, dtype=dtype, row_group_size=120)


@pytest.fixture(scope="module")
def layout_shards(tmp_path_factory) -> dict[str, tuple[Path, Path]]:
    """Per layout: (input split, 2-shard dir whose shards have row groups of 16 rows)."""
    root = tmp_path_factory.mktemp("layouts")
    made = {}
    for layout in LAYOUTS:
        write_layout(root / f"{layout}.parquet", layout)
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(shard_writer, "MAX_ROW_GROUP_ROWS", 16)
            partition_parquet(root / f"{layout}.parquet", root / layout, world_size=2, seed=3)
        made[layout] = (root / f"{layout}.parquet", root / layout)
    return made


def flat_rows(features: torch.Tensor, labels: torch.Tensor) -> np.ndarray:
    return rows_as_sorted_array(features.reshape(len(features), -1), labels.reshape(len(labels), -1))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_load_table_reads_tensor_and_token_columns_in_their_row_shape(layout_shards, layout):
    path = layout_shards[layout][0]
    table = pq.read_table(path)
    features, targets = load_table(path, batch_size=50)  # batches cut across row groups
    name = table.schema.names[0]
    values = table[name].combine_chunks().flatten().to_numpy()
    if layout.startswith("tensor"):
        assert (features.dtype, tuple(features.shape)) == (torch.float32, (LAYOUT_ROWS, 1, 8, 8))
        assert np.array_equal(features.numpy().ravel(), values)
    else:
        assert (features.dtype, tuple(features.shape)) == (torch.int64, (LAYOUT_ROWS, 17))
        assert np.array_equal(features.numpy().ravel(), values.astype(np.int64))
        assert (targets.dtype, tuple(targets.shape)) == (torch.float32, (LAYOUT_ROWS, 0))
    if layout == "tensor":
        assert targets.dtype == torch.int64 and np.array_equal(targets.numpy(), table["label"].to_numpy())
    if layout == "tensor_regression":
        assert targets.dtype == torch.float32 and tuple(targets.shape) == (LAYOUT_ROWS, 2)
        assert np.array_equal(targets[:, 1].numpy(), table["y1"].to_numpy())


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("layout", LAYOUTS)
def test_shard_reader_yields_every_row_of_tensor_and_token_shards_once_per_epoch(
    layout_shards, layout, cache
):
    source, shard_dir = layout_shards[layout]
    shard_rows = []
    for rank in range(2):
        features, labels = load_shard(shard_dir, rank)
        shard_rows.append((features, labels))
        with ShardReader(shard_dir, rank, seed=1, cache=cache) as reader:
            assert pq.ParquetFile(reader.path).metadata.num_row_groups >= 9
            for epoch in range(2):
                batches = epoch_batches(reader, epoch, 7)
                assert [len(y) for _, y in batches] == [len(b) for b in torch.tensor_split(labels, 7)]
                assert all(
                    f.dtype == features.dtype and f.shape[1:] == features.shape[1:] for f, _ in batches
                )
                assert np.array_equal(
                    flat_rows(torch.cat([f for f, _ in batches]), torch.cat([y for _, y in batches])),
                    flat_rows(features, labels),
                )
    # The shards together are the input split, row for row.
    assert np.array_equal(
        flat_rows(torch.cat([f for f, _ in shard_rows]), torch.cat([y for _, y in shard_rows])),
        flat_rows(*load_table(source)),
    )


@pytest.mark.parametrize("cache", [False, True])
@pytest.mark.parametrize("layout", ["tensor", "tokens_uint16"])
def test_resuming_mid_epoch_on_tensor_and_token_shards_gives_the_uninterrupted_batches(
    layout_shards, layout, cache
):
    shard_dir = layout_shards[layout][1]
    with ShardReader(shard_dir, 1, seed=5, cache=cache) as reader:
        uninterrupted = [epoch_batches(reader, epoch, 6) for epoch in range(2)]
    for epoch in range(2):
        for start_batch in (2, 5):
            with ShardReader(shard_dir, 1, seed=5, cache=cache) as fresh:  # a restarted process
                resumed = epoch_batches(fresh, epoch, 6, start_batch)
            assert same_batches(resumed, uninterrupted[epoch][start_batch:])


def test_list_values_is_a_zero_copy_view_that_respects_chunk_offsets():
    values = pa.array(np.arange(10 * 4, dtype=np.uint16))
    column = pa.FixedSizeListArray.from_arrays(values, 4)
    spec = ColumnSpec("tokens", "tokens", "uint16", (4,))
    view = list_values(column.slice(3, 5), spec, "mem")
    assert view.shape == (5, 4) and view[0].tolist() == [12, 13, 14, 15]
    assert np.shares_memory(view, np.frombuffer(values.buffers()[1], dtype=np.uint16))
    chunked = pa.chunked_array([column.slice(8), column.slice(1, 2)])
    assert list_values(chunked, spec, "mem")[:, 0].tolist() == [32, 36, 4, 8]
    image = ColumnSpec("x", "tensor", "uint16", (2, 2))
    assert list_values(column.slice(9), image, "mem").tolist() == [[[36, 37], [38, 39]]]


def test_recognise_layout_names_the_input_kind_and_row_shape(layout_shards):
    tensor = recognise_layout(pq.read_schema(layout_shards["tensor"][0]), "t")
    assert (tensor.kind, tensor.row_shape, tensor.feature_names, tensor.target_names) == (
        "tensor", (1, 8, 8), ["x"], ["label"],
    )  # fmt: skip
    tokens = recognise_layout(pq.read_schema(layout_shards["tokens_uint16"][0]), "t")
    assert (tokens.kind, tokens.row_shape, tokens.features[0].dtype, tokens.targets) == (
        "tokens", (17,), "uint16", (),
    )  # fmt: skip
    numeric = recognise_layout(
        pa.schema([("x1", pa.int32()), ("x0", pa.float64()), ("y0", pa.float32())]), "t"
    )
    assert (numeric.kind, numeric.row_shape, numeric.feature_names) == ("numeric", (2,), ["x0", "x1"])


def test_a_tensor_column_whose_shape_does_not_fit_its_rows_is_refused(tmp_path):
    path = tmp_path / "odd.parquet"
    write_tensor_split(path, 4, shape=(1, 8, 8), list_size=60)
    with pytest.raises(UserError) as error:
        load_table(path)
    assert str(error.value) == (
        f"column 'x' of {path} holds rows of 60 values but its shape [1, 8, 8] needs 64; "
        "re-create it with the prepare stage"
    )


def list_table(
    values: list, list_size: int, value_type: pa.DataType, name: str = "x", shape: bytes | None = None
) -> pa.Table:
    column = pa.array(values, pa.list_(value_type, list_size))
    field = pa.field(name, column.type, metadata={SHAPE_KEY: shape or f"[{list_size}]".encode()})
    return pa.Table.from_arrays([column], schema=pa.schema([field]))


@pytest.mark.parametrize(
    ("table", "message"),
    [
        (list_table([[1.0, 2.0], None], 2, pa.float32()), r"column 'x' of .* has 1 missing value\(s\)"),
        (
            list_table([[1.0, None], [3.0, 4.0]], 2, pa.float32()),
            r"column 'x' of .* has 1 missing value\(s\)",
        ),
        (list_table([[1, 2], None], 2, pa.uint16(), "tokens"), r"column 'tokens' of .* has 1 missing value"),
        (
            list_table([[1.0, 2.0]], 2, pa.float32(), "tokens"),
            "holds float values, expected integer token ids",
        ),
        (pa.table({"tokens": pa.array([[1, 2]], pa.list_(pa.int32()))}), "expected a fixed_size_list"),
        (
            list_table([[1.0, 2.0]], 2, pa.float32(), shape=b"[1, two]"),
            r"has shape '\[1, two\]' in its metadata, expected a list of positive integers",
        ),
    ],
)
def test_tensor_and_token_columns_with_missing_values_or_wrong_types_are_refused(tmp_path, table, message):
    pq.write_table(table, tmp_path / "odd.parquet")
    with pytest.raises(UserError, match=message):
        load_table(tmp_path / "odd.parquet")
