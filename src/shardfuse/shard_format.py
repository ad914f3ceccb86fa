"""The shard format and the Parquet helpers shared by its writer (the partition stage) and its reader
(``shardfuse.data``): names of the files and columns, and streaming, error-checked Parquet reads (the
manifest is ``shardfuse.manifest``).

No command line; a library module, so the training-time reader does not import the partition stage.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.io import UserError, error_reason

LABEL_COLUMN = "label"


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
