"""The shard format and the Parquet helpers shared by its writer (the partition stage) and its reader
(``shardfuse.data.reader``): names of the files and columns, the input layouts and what each column holds,
zero-copy NumPy views of columns, and streaming, error-checked Parquet reads (the manifest is
``shardfuse.data.manifest``).

A prepared split (and so a shard) comes in one of three input layouts, told apart by its schema:

* numeric: columns ``x0..x{F-1}`` (floats or ints), one input value each;
* tensor: one column ``x`` of ``fixed_size_list<float32>[prod(shape)]``, the row's shape (e.g. an image
  C x H x W) as JSON in the field metadata ``shardfuse.shape``;
* tokens: one column ``tokens`` of ``fixed_size_list<uint16 | int32>[block_size + 1]`` (causal LM).

then the targets: ``label`` (int), ``y0..y{K-1}`` (numbers), ``loss_mask`` (token blocks of supervised
fine-tuning: ``fixed_size_list<uint8>[block_size]``, 1 where the next token counts in the loss and the
metrics, 0 where it is context only, such as a prompt) or none. Other columns are carried along
and ignored. No command line; a library module, so the training-time reader does not import the
partition stage, e.g.

    python -c "import pyarrow.parquet as pq, shardfuse.data.shard_format as f
    print(f.recognise_layout(pq.read_schema('results/datasets/digits/train.parquet'), 'train.parquet'))"
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import re
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.data.manifest import ColumnSpec
from shardfuse.io import UserError, error_reason

LABEL_COLUMN = "label"
TENSOR_COLUMN = "x"
TOKENS_COLUMN = "tokens"
LOSS_MASK_COLUMN = "loss_mask"  # of token blocks: which next tokens count (supervised fine-tuning)
SHAPE_KEY = b"shardfuse.shape"  # field metadata of a tensor column: its row shape as a JSON list
FEATURE_COLUMN = re.compile(r"x(0|[1-9][0-9]*)")  # no leading zeros: x01 is not feature 1
TARGET_COLUMN = re.compile(r"y(0|[1-9][0-9]*)")
REMAKE = "re-create it with the prepare (or partition) stage"
REMAKE_SHAPE = "re-create it with the prepare stage"  # partition copies list columns as they are
InputKind = Literal["numeric", "tensor", "tokens"]


def target_columns(count: int) -> list[str]:
    """The float target columns of a prepared dataset with ``count`` targets (regression): y0..y{K-1}."""
    return [f"y{k}" for k in range(count)]


def shard_name(rank: int) -> str:
    return f"shard-{rank}.parquet"


def open_parquet(path: Path, what: str, fix: str) -> pq.ParquetFile:
    """Open a Parquet file; a missing or corrupt one becomes a UserError ``{what} {path} ...; {fix}``."""
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; {fix}")
    try:
        # pre_buffer (pyarrow's default) prefetches every row group iter_batches will visit, i.e. the
        # whole file: memory O(data), which streaming is meant to avoid.
        return pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(
            f"{what} {path} is not a readable Parquet file ({error_reason(exc)}); {fix}"
        ) from None


def read_batches(
    parquet_file: pq.ParquetFile, what: str, fix: str, **iter_batches_kwargs: Any
) -> Iterator[pa.RecordBatch]:
    """``parquet_file.iter_batches`` with read errors (a truncated or corrupt body) turned into a UserError.

    Errors raised in the caller's loop body do not pass through here: a failing write stays a real error."""
    try:
        yield from parquet_file.iter_batches(**iter_batches_kwargs)
    except (pa.ArrowException, OSError) as exc:
        raise UserError(f"{what} could not be read to the end ({error_reason(exc)}); {fix}") from None


_DONE = object()


def prefetched(items: Iterator[Any], depth: int = 2) -> Iterator[Any]:
    """Iterate ``items`` in a background thread, up to ``depth`` items ahead of the consumer.

    Worth it when producing an item releases the GIL (Parquet reads, decoding, large NumPy copies):
    reading then overlaps with the consumer's work. An exception in ``items`` is re-raised here, at the
    position it happened; leaving the loop early stops and joins the thread before returning."""
    slots: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def offer(entry: tuple[Any, BaseException | None]) -> bool:
        while not stop.is_set():
            with contextlib.suppress(queue.Full):
                slots.put(entry, timeout=0.05)
                return True
        return False

    def produce() -> None:
        try:
            for item in items:
                if not offer((item, None)):
                    return
            offer((_DONE, None))
        except BaseException as exc:  # handed to the consumer, which raises it where it happened
            offer((_DONE, exc))

    thread = threading.Thread(target=produce, name="shardfuse-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            item, exc = slots.get()
            if exc is not None:
                raise exc
            if item is _DONE:
                return
            yield item
    finally:
        stop.set()
        thread.join()


# Arrow's own to_numpy() imports pandas on first use: a start-up cost per process, before the first batch.
_NUMPY_DTYPES = {
    arrow_type: np.dtype(name)
    for arrow_type, name in [
        (pa.int8(), "int8"), (pa.int16(), "int16"), (pa.int32(), "int32"), (pa.int64(), "int64"),
        (pa.uint8(), "uint8"), (pa.uint16(), "uint16"), (pa.uint32(), "uint32"), (pa.uint64(), "uint64"),
        (pa.float16(), "float16"), (pa.float32(), "float32"), (pa.float64(), "float64"),
    ]
}  # fmt: skip


def column_values(column: pa.ChunkedArray | pa.Array) -> np.ndarray:
    """A numeric column without nulls as NumPy: zero-copy views of Arrow's buffers (one concatenation
    for several chunks)."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    dtype = _NUMPY_DTYPES.get(column.type)
    if dtype is None:
        return column.to_numpy()
    views = [
        np.frombuffer(chunk.buffers()[1], dtype=dtype, count=len(chunk), offset=chunk.offset * dtype.itemsize)
        for chunk in chunks
    ]
    if len(views) == 1:
        return views[0]
    return np.concatenate(views) if views else np.empty(0, dtype=dtype)


def _dtype_name(arrow_type: pa.DataType) -> str:
    dtype = _NUMPY_DTYPES.get(arrow_type)
    return dtype.name if dtype is not None else str(arrow_type)


def _is_number(arrow_type: pa.DataType) -> bool:
    return pa.types.is_integer(arrow_type) or pa.types.is_floating(arrow_type)


def _shape_mismatch(name: str, path: str | Path, list_size: int, shape: list[int]) -> UserError:
    return UserError(
        f"column {name!r} of {path} holds rows of {list_size} values but its shape {shape} needs "
        f"{math.prod(shape)}; {REMAKE_SHAPE}"
    )


def _list_spec(field: pa.Field, path: str | Path) -> ColumnSpec:
    """A fixed_size_list column: a token block (``tokens``) or a tensor of the shape its metadata names
    (a 1-D vector of the list size without that metadata), checked against the list size."""
    list_size, element = field.type.list_size, field.type.value_type
    kind = {TOKENS_COLUMN: "tokens", LOSS_MASK_COLUMN: "mask"}.get(field.name, "tensor")
    if not (pa.types.is_integer(element) if kind in ("tokens", "mask") else _is_number(element)):
        expected = {"tokens": "integer token ids", "mask": "0/1 integers"}.get(kind, "numbers")
        raise UserError(
            f"column {field.name!r} of {path} holds {element} values, expected {expected}; {REMAKE}"
        )
    raw = (field.metadata or {}).get(SHAPE_KEY)
    shape: object = [list_size]
    if raw is not None:
        try:
            shape = json.loads(raw)
        except ValueError:
            shape = raw.decode(errors="replace")
    if not (isinstance(shape, list) and shape and all(type(n) is int and n >= 1 for n in shape)):
        raise UserError(
            f"column {field.name!r} of {path} has shape {shape!r} in its metadata, expected a list of "
            f"positive integers such as [1, 8, 8]; {REMAKE_SHAPE}"
        )
    if math.prod(shape) != list_size:
        raise _shape_mismatch(field.name, path, list_size, shape)
    return ColumnSpec(field.name, kind, _dtype_name(element), tuple(shape))


def describe_column(field: pa.Field, path: str | Path) -> ColumnSpec:
    """What one column holds, from its name and type (see the module docstring); "other" when no
    layout uses it. A fixed_size_list whose shape does not fit its size is a UserError."""
    name, arrow_type = field.name, field.type
    if pa.types.is_fixed_size_list(arrow_type):
        return _list_spec(field, path)
    if name == LABEL_COLUMN and pa.types.is_integer(arrow_type):
        kind = "label"
    elif FEATURE_COLUMN.fullmatch(name) and _is_number(arrow_type):
        kind = "numeric"
    elif TARGET_COLUMN.fullmatch(name) and _is_number(arrow_type):
        kind = "target"
    else:
        kind = "other"
    return ColumnSpec(name, kind, _dtype_name(arrow_type))


def describe_columns(schema: pa.Schema, path: str | Path) -> tuple[ColumnSpec, ...]:
    """Every column of ``schema`` described (the manifest's ``columns``); lenient about columns no
    layout uses, strict about the shape of list columns."""
    return tuple(describe_column(field, path) for field in schema)


@dataclass(frozen=True)
class ShardLayout:
    """Which columns a reader turns into a row's input and target, in order. ``features``: the numeric
    columns x0..x{F-1}, or the one tensor or tokens column; ``targets``: ``label``, y0..y{K-1},
    ``loss_mask`` or none (causal LM: the targets are the next tokens, the mask says which count)."""

    kind: InputKind
    features: tuple[ColumnSpec, ...]
    targets: tuple[ColumnSpec, ...]

    @property
    def feature_names(self) -> list[str]:
        return [spec.name for spec in self.features]

    @property
    def target_names(self) -> list[str]:
        return [spec.name for spec in self.targets]

    @property
    def row_shape(self) -> tuple[int, ...]:
        """One row's input: (F,) numeric, the tensor's shape, (block_size + 1,) tokens."""
        return (len(self.features),) if self.kind == "numeric" else self.features[0].shape

    @property
    def is_label(self) -> bool:
        return [spec.kind for spec in self.targets] == ["label"]

    @property
    def is_mask(self) -> bool:
        return [spec.kind for spec in self.targets] == ["mask"]


def _numeric_features(schema: pa.Schema, path: str | Path) -> tuple[ColumnSpec, ...]:
    """x0..x{F-1} in numeric order (x10 after x9); UserError if none or one is missing."""
    indices = sorted(
        int(match.group(1)) for name in schema.names if (match := FEATURE_COLUMN.fullmatch(name))
    )
    if not indices:
        raise UserError(
            f"{path} has no feature columns x0, x1, ... (columns found: {', '.join(schema.names)}); {REMAKE}"
        )
    missing = sorted(set(range(indices[-1] + 1)) - set(indices))
    if missing:
        raise UserError(
            f"{path} lacks feature column(s) {', '.join(f'x{i}' for i in missing[:10])}; {REMAKE}"
        )
    return tuple(_scalar_spec(schema.field(f"x{i}"), "numeric", path) for i in indices)


def _scalar_spec(field: pa.Field, kind: str, path: str | Path) -> ColumnSpec:
    if not (pa.types.is_integer(field.type) or (kind != "label" and pa.types.is_floating(field.type))):
        expected = "an integer" if kind == "label" else "a number"
        raise UserError(
            f"column {field.name!r} of {path} has type {field.type}, expected {expected}; {REMAKE}"
        )
    return ColumnSpec(field.name, kind, _dtype_name(field.type))


def _mask_spec(field: pa.Field, tokens: ColumnSpec, path: str | Path) -> ColumnSpec:
    """The ``loss_mask`` column of token blocks: one 0/1 per target, block_size = the block's length - 1."""
    if not pa.types.is_fixed_size_list(field.type):
        raise UserError(
            f"column {field.name!r} of {path} has type {field.type}, expected a fixed_size_list (one "
            f"mask per token block); {REMAKE}"
        )
    spec = _list_spec(field, path)
    if spec.shape != (tokens.shape[0] - 1,):
        raise UserError(
            f"column {field.name!r} of {path} has {spec.shape[0]} values per row, expected "
            f"{tokens.shape[0] - 1} (one per next token of a block of {tokens.shape[0]}); {REMAKE}"
        )
    return spec


def recognise_layout(schema: pa.Schema, path: str | Path) -> ShardLayout:
    """The input layout of a prepared split or shard: a ``tokens`` column, else an ``x`` column, else
    x0..x{F-1}; then the targets. A schema that fits none, or a column of the wrong type, is a
    UserError naming the column and the fix."""
    for name, kind in ((TOKENS_COLUMN, "tokens"), (TENSOR_COLUMN, "tensor")):
        if name in schema.names:
            field = schema.field(name)
            if not pa.types.is_fixed_size_list(field.type):
                raise UserError(
                    f"column {name!r} of {path} has type {field.type}, expected a fixed_size_list (one "
                    f"{'token block' if kind == 'tokens' else 'tensor'} per row); {REMAKE}"
                )
            features: tuple[ColumnSpec, ...] = (_list_spec(field, path),)
            break
    else:
        kind, features = "numeric", _numeric_features(schema, path)
    if LABEL_COLUMN in schema.names:
        targets: tuple[ColumnSpec, ...] = (_scalar_spec(schema.field(LABEL_COLUMN), "label", path),)
    elif kind == "tokens" and LOSS_MASK_COLUMN in schema.names:
        targets = (_mask_spec(schema.field(LOSS_MASK_COLUMN), features[0], path),)
    else:
        indices = sorted(int(m.group(1)) for name in schema.names if (m := TARGET_COLUMN.fullmatch(name)))
        targets = tuple(_scalar_spec(schema.field(f"y{i}"), "target", path) for i in indices)
    return ShardLayout(kind, features, targets)


def read_layout(parquet_file: pq.ParquetFile, path: str | Path) -> ShardLayout:
    """:func:`recognise_layout` of an open Parquet file, plus a footer check that its tensor or token
    column has no missing values: pyarrow cannot even decode a missing row of a fixed_size_list (it
    fails with "Expected all lists to be of size=..."), so the footer's null counts are the one place
    to tell the user what is wrong."""
    layout = recognise_layout(parquet_file.schema_arrow, path)
    if layout.kind != "numeric":
        name = layout.features[0].name
        metadata = parquet_file.metadata
        leaves = [
            i for i in range(metadata.num_columns) if metadata.schema.column(i).path.split(".")[0] == name
        ]
        num_nulls = 0
        for group in range(metadata.num_row_groups):
            for leaf in leaves:
                statistics = metadata.row_group(group).column(leaf).statistics
                if statistics is not None and statistics.has_null_count:
                    num_nulls += statistics.null_count
        _refuse_nulls(name, num_nulls, path)
    return layout


def _refuse_nulls(name: str, num_nulls: int, path: str | Path) -> None:
    if num_nulls:
        raise UserError(f"column {name!r} of {path} has {num_nulls} missing value(s); {REMAKE}")


def checked_values(column: pa.ChunkedArray | pa.Array, name: str, path: str | Path) -> np.ndarray:
    """:func:`column_values` of a scalar column, missing values refused."""
    _refuse_nulls(name, column.null_count, path)
    return column_values(column)


def list_values(column: pa.ChunkedArray | pa.Array, spec: ColumnSpec, path: str | Path) -> np.ndarray:
    """A fixed_size_list column as NumPy [N, *spec.shape] in its stored element type: a zero-copy view
    of Arrow's values buffer for one chunk (its offset respected), one concatenation for several.
    Missing rows or values are a UserError; no Python loop over rows."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    size = math.prod(spec.shape)
    views = []
    for chunk in chunks:
        _refuse_nulls(spec.name, chunk.null_count, path)
        # flatten(), unlike .values, slices the child to this chunk's rows (zero-copy without nulls).
        flat = chunk.flatten()
        _refuse_nulls(spec.name, flat.null_count, path)
        if chunk.type.list_size != size:  # a spec made from another file's schema
            raise _shape_mismatch(spec.name, path, chunk.type.list_size, list(spec.shape))
        views.append(column_values(flat).reshape(len(chunk), *spec.shape))
    if len(views) == 1:
        return views[0]
    if views:
        return np.concatenate(views)
    return np.empty((0, *spec.shape), dtype=_NUMPY_DTYPES.get(column.type.value_type, np.float32))
