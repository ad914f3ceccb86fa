"""The shard writer behind the partition stage: each read batch's rows grouped by the ranks a partitioner
dealt them (shardfuse.data.partitioners) and written through bounded background buffers into one Parquet
file per rank, each file's sha256 and each numeric column's moments computed as the bytes go by. Memory
is flat in the number of rows (the partition stage's docstring says how; peak RSS: bench/partition.py).
"""

from __future__ import annotations

import collections
import functools
import hashlib
import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfuse.data.shard_format import (
    LABEL_COLUMN,
    column_values,
)
from shardfuse.io import (
    UserError,
)

WRITE_BUFFER_BYTES = 128 << 20
MAX_ROW_GROUP_ROWS = 1 << 16
# A row group and a read batch hold at most this many values of one column: Parquet's reader and writer
# keep per-value work arrays (repetition and definition levels, decoded values) for a whole batch or
# row group, and a token block or an image is hundreds of values a row. One value a row (numeric
# columns): the row limits decide, as before. Peak RSS on a token corpus: bench/partition.py.
MAX_COLUMN_VALUES = 1 << 21
# A float column keeps dictionary encoding only if the input stores it in under this fraction of its
# plain size (its values repeat, e.g. pixel intensities); continuous values never do.
DICTIONARY_MAX_STORED_FRACTION = 0.5
REMAKE_INPUT = "fix the path or (re-)run the prepare stage"
# Slices of read batches a rank's buffer holds at least before they are copied out; the partition stage
# allows W of them: iid's ranks, dealt a 1/W share of each batch, fill a row group in at most about W
# pieces (never copied), a rank dealt a smaller share would take many more.
MIN_BORROWED_PIECES = 4


def max_rows_per_group(schema: pa.Schema) -> int:
    """Rows that hold :data:`MAX_COLUMN_VALUES` values of the widest column (a fixed_size_list holds
    list_size values a row, any other column one)."""
    values_per_row = max(
        (field.type.list_size for field in schema if pa.types.is_fixed_size_list(field.type)), default=1
    )
    return max(1, MAX_COLUMN_VALUES // values_per_row)


def rows_per_group(parquet_file: pq.ParquetFile, world_size: int) -> int:
    """Rows per output row group, from the input's uncompressed row width: a function of the input
    file and W only, so the output layout does not depend on --batch-size."""
    metadata = parquet_file.metadata
    total_bytes = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    row_bytes = max(1, total_bytes // max(1, metadata.num_rows))
    max_rows = min(MAX_ROW_GROUP_ROWS, max_rows_per_group(parquet_file.schema_arrow))
    return int(np.clip(WRITE_BUFFER_BYTES // (world_size * row_bytes), 1, max_rows))


def dictionary_columns(parquet_file: pq.ParquetFile) -> list[str]:
    """Leaf columns worth dictionary-encoding in the shards: every non-float column (pyarrow's default),
    and a float column only when the input's first row group shows its values repeat."""
    metadata = parquet_file.metadata
    columns = []
    for i in range(metadata.num_columns):
        column = metadata.schema.column(i)
        width = {"FLOAT": 4, "DOUBLE": 8}.get(column.physical_type)
        if width is not None and metadata.num_row_groups:
            chunk = metadata.row_group(0).column(i)
            plain_bytes = max(1, chunk.num_values * width)
            if chunk.total_compressed_size >= DICTIONARY_MAX_STORED_FRACTION * plain_bytes:
                continue
        columns.append(column.path)
    return columns


def numeric_moments(table: pa.Table) -> dict[str, list[float]]:
    """[count, sum, sum of squares] of every integer or floating-point column but the label, in float64
    (NumPy loops, no BLAS: the same bits on every CPU)."""
    moments = {}
    for field, column in zip(table.schema, table.columns, strict=True):
        if field.name == LABEL_COLUMN or not (
            pa.types.is_integer(field.type) or pa.types.is_floating(field.type)
        ):
            continue
        values = column_values(column.drop_null() if column.null_count else column)
        # Accumulating in float64 straight from the column's own type: no float64 copy of the column.
        moments[field.name] = [
            float(len(values)),
            float(np.add.reduce(values, dtype=np.float64)),
            float(np.einsum("i,i->", values, values, dtype=np.float64)),
        ]
    return moments


class BackgroundWrites:
    """Runs write jobs one at a time and in order in one thread: writing (encoding, compressing)
    overlaps with reading and grouping the next batches. At most ``depth`` jobs and ``max_bytes`` of
    row groups wait (a shallower queue left the writer idle on 2 cores, a deeper one gained nothing)."""

    def __init__(self, depth: int = 4, max_bytes: int = WRITE_BUFFER_BYTES) -> None:
        self.depth = depth
        self.max_bytes = max_bytes
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfuse-write")
        self.queued: collections.deque[tuple[Future, int]] = collections.deque()
        self.queued_bytes = 0

    def submit(self, job: Callable[[], None], nbytes: int) -> None:
        while self.queued and (len(self.queued) >= self.depth or self.queued_bytes + nbytes > self.max_bytes):
            self._wait_oldest()
        self.queued.append((self.executor.submit(job), nbytes))
        self.queued_bytes += nbytes

    def _wait_oldest(self) -> None:
        future, nbytes = self.queued.popleft()
        self.queued_bytes -= nbytes
        future.result()  # re-raises a failed write here

    def finish(self) -> None:
        """Wait for every queued write; raise the first failure."""
        while self.queued:
            self._wait_oldest()
        self.executor.shutdown()

    def abandon(self) -> None:
        """Drop queued writes and wait for the running one (the output is discarded anyway)."""
        self.executor.shutdown(wait=True, cancel_futures=True)
        self.queued.clear()
        self.queued_bytes = 0


def _group_by_rank(ranks: np.ndarray, world_size: int) -> tuple[np.ndarray, np.ndarray]:
    """Row order that groups a batch by rank, keeping input order inside each rank, and the bounds of
    each rank's run. One pass per rank beats a stable sort for the usual handful of ranks."""
    counts = np.bincount(ranks, minlength=world_size + 1)
    bounds = np.concatenate([[0], np.cumsum(counts)])
    if world_size > 16:
        return np.argsort(ranks, kind="stable"), bounds
    return np.concatenate([np.flatnonzero(ranks == rank) for rank in range(world_size + 1)]), bounds


class _FileDigest:
    """sha256 of a file that is still being appended to, caught up in a hashing thread after each row
    group (Parquet writers never rewrite earlier bytes), so the checksum is ready moments after the file
    is closed instead of costing one more pass at the end."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.digest = hashlib.sha256()
        self.offset = 0
        self.lock = threading.Lock()

    def catch_up(self, size: int) -> None:
        """Hash the bytes up to ``size`` (a size the file had already reached)."""
        with self.lock, open(self.path, "rb") as fh:
            fh.seek(self.offset)
            while self.offset < size:
                block = fh.read(min(size - self.offset, 1 << 20))
                if not block:
                    break
                self.digest.update(block)
                self.offset += len(block)

    def hexdigest(self) -> str:
        self.catch_up(self.path.stat().st_size)
        return self.digest.hexdigest()


def grouped_batches(
    batches: Iterator[pa.RecordBatch],
    ranks_of: Callable[[pa.RecordBatch], np.ndarray],
    world_size: int,
    num_rows: int,
    what: str,
) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
    """Each read batch reordered by rank (``ranks_of(batch)``: each row's, ``world_size`` = dropped),
    with the bounds of each rank's rows."""
    offset = 0
    for batch in batches:
        offset += batch.num_rows
        if offset > num_rows:
            raise UserError(f"{what} yielded more rows than its footer says ({num_rows}); {REMAKE_INPUT}")
        order, bounds = _group_by_rank(ranks_of(batch), world_size)
        # From the buffer, not pa.array(order): that one imports pandas, slow to load, to rule out a Series.
        indices = pa.Array.from_buffers(
            pa.int64(), len(order), [None, pa.py_buffer(order.astype(np.int64, copy=False))]
        )
        yield batch.take(indices), bounds


class ShardWriter:
    """Buffers one rank's rows and writes them in row groups of exactly ``row_group_rows`` rows
    (the last one shorter), each from one contiguous chunk, so the bytes do not depend on how the
    input was batched. Counts labels and sums numeric columns per written row group, for the same
    reason."""

    def __init__(
        self,
        path: Path,
        schema: pa.Schema,
        row_group_rows: int,
        writes: BackgroundWrites,
        hashers: ThreadPoolExecutor,
        use_dictionary: list[str] | bool = True,
        max_borrowed: int = MIN_BORROWED_PIECES,
    ) -> None:
        self.path = path
        self.digest = _FileDigest(path)
        self.hashers = hashers
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.writes = writes
        self.writer = pq.ParquetWriter(path, schema, use_dictionary=use_dictionary)
        self.pending: list[pa.RecordBatch] = []
        self.num_pending = 0
        self.borrowed = 0  # pending pieces at the end that are slices of a read batch
        self.max_borrowed = max(MIN_BORROWED_PIECES, max_borrowed)
        self.num_rows = 0
        self.label_counts: dict = {}
        self.moments: dict[str, list[float]] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.pending.append(batch)
        self.num_pending += batch.num_rows
        self.num_rows += batch.num_rows
        self.borrowed += 1
        while self.num_pending >= self.row_group_rows:
            table = self._take_pending()
            self._submit(table.slice(0, self.row_group_rows))
            rest = table.slice(self.row_group_rows)
            self.pending, self.num_pending, self.borrowed = rest.to_batches(), rest.num_rows, 0
        if self.borrowed > self.max_borrowed:
            # A slice keeps its whole read batch alive: a rank dealt a few rows of every batch (a skewed
            # partition) would hold many batches until its row group fills. Copy those pieces into one
            # (each row at most once more; the rows, hence the bytes written, are the same).
            owned = pa.Table.from_batches(self.pending[-self.borrowed :], schema=self.schema).combine_chunks()
            self.pending[-self.borrowed :] = owned.to_batches()
            self.borrowed = 0

    def flush(self) -> None:
        """Queue the last, shorter row group."""
        if self.num_pending:
            self._submit(self._take_pending())
        self.pending, self.num_pending = [], 0

    def _take_pending(self) -> pa.Table:
        return pa.Table.from_batches(self.pending, schema=self.schema).combine_chunks()

    def _submit(self, row_group: pa.Table) -> None:
        # Statistics here, writing in the write thread: encoding is the slowest step, keep it alone there.
        if LABEL_COLUMN in self.schema.names:
            for item in pc.value_counts(row_group.column(LABEL_COLUMN)).to_pylist():
                self.label_counts[item["values"]] = self.label_counts.get(item["values"], 0) + item["counts"]
        for name, (count, total, squares) in numeric_moments(row_group).items():
            previous = self.moments.setdefault(name, [0.0, 0.0, 0.0])
            previous[0] += count
            previous[1] += total
            previous[2] += squares
        self.writes.submit(functools.partial(self._write, row_group), row_group.nbytes)

    def _write(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=self.row_group_rows)
        self.hashers.submit(self.digest.catch_up, self.path.stat().st_size)

    def close(self) -> None:
        self.pending, self.num_pending = [], 0
        self.writer.close()

    def sorted_label_counts(self) -> dict[str, int]:
        # Sorted by value (not by string), so label 10 follows 9; None (a null label) goes last.
        keys = sorted(self.label_counts, key=lambda v: (v is None, v))
        return {str(key): self.label_counts[key] for key in keys}

    def column_moments(self) -> dict[str, dict[str, float | None]]:
        # JSON has no NaN or infinity: a column holding one gets null sums (and no normalisation).
        return {
            name: {
                "count": int(count),
                "sum": total if math.isfinite(total) else None,
                "sum_squares": squares if math.isfinite(squares) else None,
            }
            for name, (count, total, squares) in self.moments.items()
        }
