"""Partition a Parquet file into one balanced shard per rank, streamed in bounded memory.

Run by hand:

    python -m shardfuse.partition --input results/datasets/digits/train.parquet --world-size 4 --seed 0 \
        --out-dir results/shards/digits/w4-seed0

Writes OUT_DIR/shard-{rank}.parquet for rank 0..W-1 and OUT_DIR/manifest.json; the whole directory
appears at once or not at all. Which rank gets which row is a seeded random permutation (numpy
Generator(seed)); shard sizes differ by at most one row (the first N % W ranks get the extra row), or
are exactly N // W with --drop-remainder. Within a shard, rows keep their input order: training
reshuffles every epoch, and keeping order makes the output independent of the read batch size.

Memory is flat in the number of rows: the rank assignment is drawn block by block (ASSIGNMENT_BLOCK_ROWS
rows at a time), plus one read batch and per rank a write buffer sized from the input's row width so all
buffers together stay near WRITE_BUFFER_BYTES (peak RSS at three scales: bench/partition.py, figures in
bench/RESULTS.md). Output bytes depend only on the input file, W, seed and --drop-remainder (and the
numpy/pyarrow versions), never on --batch-size.

Shards are written with row groups of at most 64Ki rows (the unit a streaming reader fetches; fewer for
tensor or token rows, at most 2Mi values a column), without
dictionary encoding for floating-point columns whose values do not repeat (hashing every float into a
dictionary that is never useful only made writing slower and the files larger), and with the
count, sum and sum of squares of every numeric column in the manifest, so training can normalise
features without a pass over the data. Tensor and token columns (fixed_size_list, see
``shardfuse.data.shard_format``) are streamed as they are, field metadata (their shape) included; the
manifest's ``columns`` records every column's kind, dtype and row shape.
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

from shardfuse.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from shardfuse.data.shard_format import (
    LABEL_COLUMN,
    column_values,
    describe_columns,
    open_parquet,
    prefetched,
    read_batches,
    shard_name,
)
from shardfuse.io import (
    StageParser,
    UserError,
    atomic_dir,
    recorded_sha256,
    run_cli,
    sha256_file,
    write_json,
)

WRITE_BUFFER_BYTES = 128 << 20
MAX_ROW_GROUP_ROWS = 1 << 16
# A row group and a read batch hold at most this many values of one column: Parquet's reader and writer
# keep per-value work arrays (repetition and definition levels, decoded values) for a whole batch or
# row group, and a token block or an image is hundreds of values a row. One value a row (numeric
# columns): the row limits decide, as before. Peak RSS on a token corpus: bench/partition.py.
MAX_COLUMN_VALUES = 1 << 21
# The assignment is drawn in blocks of this many rows. A constant, not a knob: it decides the random
# stream, so changing it changes which rank gets which row.
ASSIGNMENT_BLOCK_ROWS = 1 << 20
# A float column keeps dictionary encoding only if the input stores it in under this fraction of its
# plain size (its values repeat, e.g. pixel intensities); continuous values never do.
DICTIONARY_MAX_STORED_FRACTION = 0.5
REMAKE_INPUT = "fix the path or (re-)run the prepare stage"


def shard_sizes(num_rows: int, world_size: int, drop_remainder: bool) -> list[int]:
    """Rows per rank: N // W each, plus one for the first N % W ranks unless the remainder is dropped."""
    base, remainder = divmod(num_rows, world_size)
    if drop_remainder:
        return [base] * world_size
    return [base + 1 if rank < remainder else base for rank in range(world_size)]


def iter_rank_assignment(
    num_rows: int, world_size: int, seed: int, drop_remainder: bool, block_rows: int = ASSIGNMENT_BLOCK_ROWS
) -> Iterator[np.ndarray]:
    """The rank of every input row (value ``world_size`` marks a dropped row), block by block, in the
    smallest integer dtype that fits: a seeded uniformly random arrangement of the shard sizes in
    O(block) memory. Each block's rank counts are a multivariate hypergeometric draw from the rows still
    unassigned, then the block is shuffled: together exactly a shuffle of the whole assignment."""
    sizes = shard_sizes(num_rows, world_size, drop_remainder)
    remaining = np.array([*sizes, num_rows - sum(sizes)], dtype=np.int64)
    dtype = np.min_scalar_type(world_size)
    ranks = np.arange(world_size + 1, dtype=dtype)
    rng = np.random.default_rng(seed)
    for start in range(0, num_rows, block_rows):
        take = min(block_rows, num_rows - start)
        counts = (
            remaining
            if take == remaining.sum()
            else rng.multivariate_hypergeometric(remaining, take, method="marginals")
        )
        remaining = remaining - counts
        block = np.repeat(ranks, counts)
        rng.shuffle(block)
        yield block


def rank_assignment(
    num_rows: int, world_size: int, seed: int, drop_remainder: bool, block_rows: int = ASSIGNMENT_BLOCK_ROWS
) -> np.ndarray:
    """The whole assignment of :func:`iter_rank_assignment` as one array (for tests and small inputs)."""
    blocks = list(iter_rank_assignment(num_rows, world_size, seed, drop_remainder, block_rows))
    return np.concatenate(blocks) if blocks else np.empty(0, dtype=np.min_scalar_type(world_size))


class _AssignmentReader:
    """Hands out the next ``n`` assignments, whatever the read batches and assignment blocks are."""

    def __init__(self, blocks: Iterator[np.ndarray]) -> None:
        self.blocks = blocks
        self.current = np.empty(0, dtype=np.uint8)
        self.position = 0

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n:
            if self.position == len(self.current):
                self.current, self.position = next(self.blocks), 0
            part = self.current[self.position : self.position + n]
            self.position += len(part)
            n -= len(part)
            parts.append(part)
        return parts[0] if len(parts) == 1 else np.concatenate(parts)


def _max_rows(schema: pa.Schema) -> int:
    """Rows that hold :data:`MAX_COLUMN_VALUES` values of the widest column (a fixed_size_list holds
    list_size values a row, any other column one)."""
    values_per_row = max(
        (field.type.list_size for field in schema if pa.types.is_fixed_size_list(field.type)), default=1
    )
    return max(1, MAX_COLUMN_VALUES // values_per_row)


def _row_group_rows(parquet_file: pq.ParquetFile, world_size: int) -> int:
    """Rows per output row group, from the input's uncompressed row width: a function of the input
    file and W only, so the output layout does not depend on --batch-size."""
    metadata = parquet_file.metadata
    total_bytes = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    row_bytes = max(1, total_bytes // max(1, metadata.num_rows))
    max_rows = min(MAX_ROW_GROUP_ROWS, _max_rows(parquet_file.schema_arrow))
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


class _BackgroundWrites:
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


def _grouped_batches(
    batches: Iterator[pa.RecordBatch],
    assignment: _AssignmentReader,
    world_size: int,
    num_rows: int,
    what: str,
) -> Iterator[tuple[pa.RecordBatch, np.ndarray]]:
    """Each read batch reordered by rank, with the bounds of each rank's rows."""
    offset = 0
    for batch in batches:
        offset += batch.num_rows
        if offset > num_rows:
            raise UserError(f"{what} yielded more rows than its footer says ({num_rows}); {REMAKE_INPUT}")
        order, bounds = _group_by_rank(assignment.take(batch.num_rows), world_size)
        # From the buffer, not pa.array(order): that one imports pandas, slow to load, to rule out a Series.
        indices = pa.Array.from_buffers(
            pa.int64(), len(order), [None, pa.py_buffer(order.astype(np.int64, copy=False))]
        )
        yield batch.take(indices), bounds


class _ShardWriter:
    """Buffers one rank's rows and writes them in row groups of exactly ``row_group_rows`` rows
    (the last one shorter), each from one contiguous chunk, so the bytes do not depend on how the
    input was batched. Counts labels and sums numeric columns per written row group, for the same
    reason."""

    def __init__(
        self,
        path: Path,
        schema: pa.Schema,
        row_group_rows: int,
        writes: _BackgroundWrites,
        hashers: ThreadPoolExecutor,
        use_dictionary: list[str] | bool = True,
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
        self.num_rows = 0
        self.label_counts: dict = {}
        self.moments: dict[str, list[float]] = {}

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        self.pending.append(batch)
        self.num_pending += batch.num_rows
        self.num_rows += batch.num_rows
        while self.num_pending >= self.row_group_rows:
            table = self._take_pending()
            self._submit(table.slice(0, self.row_group_rows))
            rest = table.slice(self.row_group_rows)
            self.pending, self.num_pending = rest.to_batches(), rest.num_rows

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


def partition_parquet(
    input_path: str | Path,
    out_dir: str | Path,
    world_size: int,
    seed: int,
    drop_remainder: bool = False,
    batch_size: int = 65536,
) -> dict:
    """Write OUT_DIR/shard-{rank}.parquet for every rank plus manifest.json; return the manifest."""
    given_path = str(input_path)  # recorded as given: an absolute path would make the manifest host-specific
    input_path, out_dir = Path(input_path), Path(out_dir)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"--world-size must be an integer >= 1, got {world_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"--seed must be an integer >= 0, got {seed!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size must be an integer >= 1, got {batch_size!r}")
    parquet_file = open_parquet(input_path, "--input", REMAKE_INPUT)
    num_rows = parquet_file.metadata.num_rows
    if world_size > num_rows:
        raise UserError(
            f"--world-size {world_size} exceeds the {num_rows} rows of {input_path}, which would "
            f"leave a rank without data; use --world-size <= {num_rows} or a larger dataset"
        )
    schema = parquet_file.schema_arrow
    # Before any work: a tensor column whose shape does not fit its size is refused here, not in training.
    columns = describe_columns(schema, input_path)
    assignment = _AssignmentReader(iter_rank_assignment(num_rows, world_size, seed, drop_remainder))
    row_group_rows = _row_group_rows(parquet_file, world_size)
    use_dictionary = dictionary_columns(parquet_file)
    what = f"--input {input_path}"

    # Four threads, so a 2-core machine stays busy: reading and grouping by rank (prefetched), this
    # one (buffering row groups), writing, and checksums (the input's, and each shard's as it grows).
    with atomic_dir(out_dir) as tmp_dir, ThreadPoolExecutor(max_workers=2) as hashers:
        # The input's checksum: prepare's record when the file is unchanged since (one pass less).
        recorded = recorded_sha256(input_path)
        source_sha256: Future[str] = hashers.submit(lambda: recorded or sha256_file(input_path))
        writes = _BackgroundWrites()
        writers = [
            _ShardWriter(tmp_dir / shard_name(rank), schema, row_group_rows, writes, hashers, use_dictionary)
            for rank in range(world_size)
        ]
        offset = 0
        try:
            read_rows = min(batch_size, _max_rows(schema))  # does not change the output, only memory
            batches = read_batches(parquet_file, what, REMAKE_INPUT, batch_size=read_rows)
            for grouped, bounds in prefetched(
                _grouped_batches(batches, assignment, world_size, num_rows, what)
            ):
                offset += grouped.num_rows
                for rank, writer in enumerate(writers):
                    writer.add(grouped.slice(int(bounds[rank]), int(bounds[rank + 1] - bounds[rank])))
            for writer in writers:
                writer.flush()
            writes.finish()
        except BaseException:
            writes.abandon()
            raise
        finally:
            parquet_file.close()
            for writer in writers:
                writer.close()
        if offset != num_rows:
            raise UserError(f"{what} yielded {offset} rows but its footer says {num_rows}; {REMAKE_INPUT}")

        shards = []
        for rank, writer in enumerate(writers):
            shard = {
                "rank": rank,
                "path": shard_name(rank),
                "rows": writer.num_rows,
                "sha256": writer.digest.hexdigest(),
                "bytes": writer.path.stat().st_size,
            }
            if LABEL_COLUMN in schema.names:
                shard["label_counts"] = writer.sorted_label_counts()
            shard["column_moments"] = writer.column_moments()
            shards.append(shard)
        total_rows = sum(shard["rows"] for shard in shards)
        manifest = {
            "format": MANIFEST_FORMAT,
            "world_size": world_size,
            "seed": seed,
            "drop_remainder": drop_remainder,
            "source": {"path": given_path, "sha256": source_sha256.result(), "rows": num_rows},
            "total_rows": total_rows,
            "dropped_rows": num_rows - total_rows,
            "schema": [{"name": field.name, "type": str(field.type)} for field in schema],
            "columns": [column.to_json() for column in columns],
            "shards": shards,
        }
        write_json(tmp_dir / MANIFEST_NAME, manifest)
    return manifest


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.partition", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="Parquet file to partition (e.g. a train.parquet)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks = number of shards")
    parser.add_argument("--seed", type=int, required=True, help="seed of the row-to-rank permutation")
    parser.add_argument(
        "--drop-remainder",
        action="store_true",
        help="give every rank exactly N // W rows, dropping N %% W seeded-random rows",
    )
    parser.add_argument(
        "--batch-size",
        type=int,
        default=65536,
        help="rows read per batch; bounds memory, does not change the output",
    )
    parser.add_argument(
        "--out-dir", required=True, help="directory for shard-{rank}.parquet and manifest.json"
    )
    args = parser.parse_args(argv)
    manifest = partition_parquet(
        args.input,
        args.out_dir,
        args.world_size,
        args.seed,
        drop_remainder=args.drop_remainder,
        batch_size=args.batch_size,
    )
    sizes = sorted({shard["rows"] for shard in manifest["shards"]})
    print(
        f"{manifest['total_rows']} rows -> {args.world_size} shards of {'/'.join(map(str, sizes))} rows "
        f"({manifest['dropped_rows']} dropped) in {args.out_dir}"
    )


if __name__ == "__main__":
    run_cli(main)
