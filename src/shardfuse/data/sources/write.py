"""Writing a source's rows as the three split files: the input columns of its layout (numeric, tensor or
tokens: :mod:`shardfuse.data.shard_format`), then the target columns of the task's layout
(:mod:`shardfuse.data.labels`), then the columns the spec asked to carry as data (group ids:
:mod:`shardfuse.data.sources.carried`; none unless asked), each split in a seeded random order, one row
group at a time. A user table's categorical feature columns are one-hot encoded here, once the split is
drawn, with the train split's categories (:mod:`shardfuse.data.sources.categorical`).

A source held in memory (:class:`Loaded`) is split here (stratified by class, or at random, as its layout
says); a streamed source (synthetic) hands over chunks that carry their own split masks. The same rows
give byte-identical files; ``row_group_rows`` changes the Parquet layout, never the rows. A library
module, no command line.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.console.progress import StageProgress
from shardfuse.data.labels import Layout, find_layout
from shardfuse.data.shard_format import SHAPE_KEY, TENSOR_COLUMN, TOKENS_COLUMN, InputKind
from shardfuse.data.splits import split_masks
from shardfuse.io import atomic_path
from shardfuse.models.task import Task

if TYPE_CHECKING:
    from shardfuse.data.sources.categorical import Categorical

SPLITS = ("train", "val", "test")
# One streamed chunk: features, targets (class codes, or rows x K floats), the chunk's split masks.
Chunk = tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]


class Loaded(NamedTuple):
    """A dataset held in memory: features (rows x F numeric columns, or rows x *shape for a tensor or
    token blocks), and class codes (classes), float targets (values, rows x K) or None (tokens)."""

    features: np.ndarray
    targets: np.ndarray | None
    feature_names: list[str]  # [] for a tensor
    target_names: list[str]  # the class names (classes) or the target names (values); [] for tokens
    kind: InputKind = "numeric"
    dataset_keys: dict[str, Any] | None = None  # the source's own dataset.json keys (skipped_images, ...)
    carried: pa.Table | None = None  # columns carried as data, one row per row (None: none asked for)
    # Categorical feature columns, one-hot encoded once the split is drawn (their vocabularies are the
    # train split's): features and feature_names hold the numeric columns until then.
    categorical: Categorical | None = None


class Written(NamedTuple):
    """What a source wrote, for dataset.json."""

    rows: dict[str, int]  # per split
    feature_names: list[str]
    label_names: list[str]  # the class names (classes); [] for the other layouts
    task_keys: dict[str, Any]  # the layout's and source's own dataset.json keys (target_names, vocab_size...)
    input: dict[str, Any]  # dataset.json's "input": kind, shape (per row), dtype


def input_of(features: np.ndarray, kind: InputKind) -> dict[str, Any]:
    """dataset.json's ``input`` for rows like ``features`` (numeric columns are always float32)."""
    dtype = "float32" if kind != "tokens" else np.dtype(features.dtype).name
    return {"kind": kind, "shape": [int(size) for size in features.shape[1:]], "dtype": dtype}


def _feature_fields(features: np.ndarray, kind: InputKind) -> tuple[list[pa.Field], list[pa.Array]]:
    """The input columns: one float32 column per feature (numeric), or one fixed-size list column built
    from the rows' flat values (tensor ``x``, tokens ``tokens``)."""
    if kind == "numeric":
        columns = np.ascontiguousarray(features.T, dtype=np.float32)  # column-major, as Arrow stores it
        return [pa.field(f"x{j}", pa.float32()) for j in range(len(columns))], [pa.array(c) for c in columns]
    row_size = math.prod(features.shape[1:])
    dtype = np.float32 if kind == "tensor" else features.dtype
    flat = np.ascontiguousarray(features, dtype=dtype).reshape(-1)
    array = pa.FixedSizeListArray.from_arrays(pa.array(flat), row_size)
    if kind == "tokens":
        return [pa.field(TOKENS_COLUMN, array.type)], [array]
    metadata = {SHAPE_KEY: json.dumps([int(size) for size in features.shape[1:]]).encode()}
    return [pa.field(TENSOR_COLUMN, array.type, metadata=metadata)], [array]


def table(
    features: np.ndarray,
    targets: np.ndarray | None,
    layout: Layout,
    kind: InputKind,
    carried: pa.Table | None = None,
) -> pa.Table:
    """The rows as a table: the input columns, the layout's target columns, then the carried ones."""
    fields, arrays = _feature_fields(features, kind)
    target_fields, target_arrays = layout.fields(targets)
    fields, arrays = [*fields, *target_fields], [*arrays, *target_arrays]
    if carried is not None:
        fields += list(carried.schema)
        arrays += [column.combine_chunks() for column in carried.columns]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def write_split(
    out_dir: Path,
    loaded: Loaded,
    masks: dict[str, np.ndarray],
    layout: Layout,
    spec: dict,
    row_group_rows: int,
) -> dict[str, int]:
    """Each split's rows in a seeded random order: files are often sorted (by label, by time), and
    partition keeps the input's order within a shard, which the shard reader's first epoch follows
    row group by row group. Built and written one row group at a time (the same bytes as one
    write_table), so the float32 copy never exceeds a row group. Returns the rows per split."""
    features, targets, carried = loaded.features, loaded.targets, loaded.carried

    def table_of(rows: np.ndarray) -> pa.Table:
        return table(
            features[rows],
            None if targets is None else targets[rows],
            layout,
            loaded.kind,
            None if carried is None else carried.take(rows),
        )

    schema = table_of(np.zeros(0, dtype=np.int64)).schema
    for index, (split, mask) in enumerate(masks.items()):
        rows = np.random.default_rng([spec["seed"], 11, index]).permutation(np.flatnonzero(mask))
        pieces = [
            rows[start : start + row_group_rows] for start in range(0, max(len(rows), 1), row_group_rows)
        ]
        with atomic_path(out_dir / f"{split}.parquet") as tmp, pq.ParquetWriter(tmp, schema) as writer:
            for piece in pieces:
                writer.write_table(table_of(piece), row_group_size=row_group_rows)
    return {split: int(np.count_nonzero(mask)) for split, mask in masks.items()}


def write_loaded(loaded: Loaded, spec: dict, task: Task, out_dir: Path, row_group_rows: int) -> Written:
    """Split a source's in-memory rows as the task's layout says (its class filter, stratified or at
    random) and write them; the layout's and the source's dataset.json keys come back in ``task_keys``."""
    layout = find_layout(task.labels)
    keep = layout.select(loaded.targets, loaded.target_names, spec)
    if keep is not None:
        carried = None if loaded.carried is None else loaded.carried.filter(pa.array(keep))
        categorical = None if loaded.categorical is None else loaded.categorical.filter(keep)
        loaded = loaded._replace(
            features=loaded.features[keep],
            targets=loaded.targets[keep],
            carried=carried,
            categorical=categorical,
        )
    strata, num_strata = layout.strata(loaded.targets, len(loaded.features), loaded.target_names)
    masks = split_masks(strata, num_strata, spec)
    if loaded.categorical is not None:
        features, names, keys = loaded.categorical.encoded(loaded.features, loaded.feature_names, masks)
        dataset_keys = {**(loaded.dataset_keys or {}), **keys}
        loaded = loaded._replace(features=features, feature_names=names, dataset_keys=dataset_keys)
    rows = write_split(out_dir, loaded, masks, layout, spec, row_group_rows)
    label_names, keys = layout.names(loaded.target_names)
    keys = {**keys, **(loaded.dataset_keys or {})}
    return Written(rows, loaded.feature_names, label_names, keys, input_of(loaded.features, loaded.kind))


def write_chunks(
    out_dir: Path,
    chunks: Iterator[Chunk],
    num_features: int,
    num_targets: int,
    layout: Layout,
    row_group_rows: int,
    num_rows: int | None = None,
) -> dict[str, int]:
    """Stream numeric (features, targets, split masks) chunks into the three split files; returns rows
    per split (``num_rows``: how many the chunks hold, for the progress lines)."""
    no_rows = np.zeros((0, num_features), dtype=np.float32)
    schema = table(no_rows, layout.no_targets(num_targets), layout, "numeric").schema
    num_written = dict.fromkeys(SPLITS, 0)
    with contextlib.ExitStack() as stack:
        writers = {
            split: stack.enter_context(
                pq.ParquetWriter(stack.enter_context(atomic_path(out_dir / f"{split}.parquet")), schema)
            )
            for split in SPLITS
        }
        progress = stack.enter_context(StageProgress(f"prepare {out_dir.name}", num_rows, "rows"))
        for features, targets, masks in chunks:
            for split, mask in masks.items():
                rows = table(features[mask], targets[mask], layout, "numeric")
                writers[split].write_table(rows, row_group_size=row_group_rows)
                num_written[split] += int(np.count_nonzero(mask))
            progress.advance(len(features))
    return num_written
