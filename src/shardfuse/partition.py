"""Partition a Parquet file into one balanced shard per rank, streamed in bounded memory.

Run by hand:

    python -m shardfuse.partition --input results/datasets/digits/train.parquet --world-size 4 --seed 0 \
        --out-dir results/shards/digits/w4

Writes OUT_DIR/shard-{rank}.parquet for rank 0..W-1 and OUT_DIR/manifest.json; the whole directory
appears at once or not at all. Which rank gets which row is a seeded random permutation (numpy
Generator(seed)); shard sizes differ by at most one row (the first N % W ranks get the extra row), or
are exactly N // W with --drop-remainder. Within a shard, rows keep their input order: training
reshuffles every epoch, and keeping order makes the output independent of the read batch size.

Memory: one byte (two for W > 255) of rank assignment per input row, one read batch, and per rank a
write buffer sized from the input's row width so all buffers together stay near WRITE_BUFFER_BYTES
(measured: ~350 MB peak RSS for 4.8M rows x 17 columns, W=8, flat in the number of rows).
Output bytes depend only on the input file, W, seed and --drop-remainder (and the numpy/pyarrow versions),
never on --batch-size.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfuse.io import StageParser, UserError, atomic_dir, run_cli, sha256_file, write_json

MANIFEST_FORMAT = "shardfuse.shards/1"
MANIFEST_NAME = "manifest.json"
LABEL_COLUMN = "label"
WRITE_BUFFER_BYTES = 128 << 20
MAX_ROW_GROUP_ROWS = 1 << 16
REMAKE_INPUT = "fix the path or (re-)run the prepare stage"


def shard_name(rank: int) -> str:
    return f"shard-{rank}.parquet"


def shard_sizes(num_rows: int, world_size: int, drop_remainder: bool) -> list[int]:
    """Rows per rank: N // W each, plus one for the first N % W ranks unless the remainder is dropped."""
    base, remainder = divmod(num_rows, world_size)
    if drop_remainder:
        return [base] * world_size
    return [base + 1 if rank < remainder else base for rank in range(world_size)]


def rank_assignment(num_rows: int, world_size: int, seed: int, drop_remainder: bool) -> np.ndarray:
    """The rank of every input row (value ``world_size`` marks a dropped row), in the smallest integer
    dtype that fits: shuffling these labels in place is a seeded random permutation without the
    8 bytes per row an index permutation would cost."""
    sizes = shard_sizes(num_rows, world_size, drop_remainder)
    counts = [*sizes, num_rows - sum(sizes)]
    dtype = np.min_scalar_type(world_size)
    assignment = np.repeat(np.arange(world_size + 1, dtype=dtype), counts)
    np.random.default_rng(seed).shuffle(assignment)
    return assignment


def error_reason(exc: BaseException) -> str:
    """First line of an exception's message (Arrow's can span many), for a one-line UserError."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


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


def _row_group_rows(parquet_file: pq.ParquetFile, world_size: int) -> int:
    """Rows per output row group, from the input's uncompressed row width: a function of the input
    file and W only, so the output layout does not depend on --batch-size."""
    metadata = parquet_file.metadata
    total_bytes = sum(metadata.row_group(i).total_byte_size for i in range(metadata.num_row_groups))
    row_bytes = max(1, total_bytes // max(1, metadata.num_rows))
    return int(np.clip(WRITE_BUFFER_BYTES // (world_size * row_bytes), 1, MAX_ROW_GROUP_ROWS))


class _ShardWriter:
    """Buffers one rank's rows and writes them in row groups of exactly ``row_group_rows`` rows
    (the last one shorter), each from one contiguous chunk, so the bytes do not depend on how the
    input was batched. Counts labels on the way."""

    def __init__(self, path: Path, schema: pa.Schema, row_group_rows: int) -> None:
        self.schema = schema
        self.row_group_rows = row_group_rows
        self.writer = pq.ParquetWriter(path, schema)
        self.pending: list[pa.RecordBatch] = []
        self.num_pending = 0
        self.num_rows = 0
        self.label_counts: dict = {}

    def add(self, batch: pa.RecordBatch) -> None:
        if batch.num_rows == 0:
            return
        if LABEL_COLUMN in self.schema.names:
            for item in pc.value_counts(batch.column(LABEL_COLUMN)).to_pylist():
                self.label_counts[item["values"]] = self.label_counts.get(item["values"], 0) + item["counts"]
        self.pending.append(batch)
        self.num_pending += batch.num_rows
        self.num_rows += batch.num_rows
        while self.num_pending >= self.row_group_rows:
            table = self._take_pending()
            self._write(table.slice(0, self.row_group_rows))
            rest = table.slice(self.row_group_rows)
            self.pending, self.num_pending = rest.to_batches(), rest.num_rows

    def _take_pending(self) -> pa.Table:
        return pa.Table.from_batches(self.pending, schema=self.schema).combine_chunks()

    def _write(self, table: pa.Table) -> None:
        self.writer.write_table(table, row_group_size=self.row_group_rows)

    def close(self, flush: bool = True) -> None:
        """Write what is buffered (unless the partition failed and the file is discarded anyway)."""
        if flush and self.num_pending:
            self._write(self._take_pending())
        self.pending, self.num_pending = [], 0
        self.writer.close()

    def sorted_label_counts(self) -> dict[str, int]:
        # Sorted by value (not by string), so label 10 follows 9; None (a null label) goes last.
        keys = sorted(self.label_counts, key=lambda v: (v is None, v))
        return {str(key): self.label_counts[key] for key in keys}


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
    assignment = rank_assignment(num_rows, world_size, seed, drop_remainder)
    row_group_rows = _row_group_rows(parquet_file, world_size)

    with atomic_dir(out_dir) as tmp_dir:
        writers = [
            _ShardWriter(tmp_dir / shard_name(rank), schema, row_group_rows) for rank in range(world_size)
        ]
        offset = 0
        try:
            for batch in read_batches(
                parquet_file, f"--input {input_path}", REMAKE_INPUT, batch_size=batch_size
            ):
                ranks = assignment[offset : offset + batch.num_rows]
                offset += batch.num_rows
                # One stable sort groups the batch by rank while keeping input order inside each rank.
                order = np.argsort(ranks, kind="stable")
                bounds = np.concatenate([[0], np.cumsum(np.bincount(ranks, minlength=world_size + 1))])
                grouped = batch.take(pa.array(order))
                for rank, writer in enumerate(writers):
                    writer.add(grouped.slice(int(bounds[rank]), int(bounds[rank + 1] - bounds[rank])))
        except BaseException:
            for writer in writers:
                writer.close(flush=False)
            raise
        finally:
            parquet_file.close()
        for writer in writers:
            writer.close()
        if offset != num_rows:
            raise UserError(
                f"--input {input_path} yielded {offset} rows but its footer says {num_rows}; {REMAKE_INPUT}"
            )

        shards = []
        for rank, writer in enumerate(writers):
            path = tmp_dir / shard_name(rank)
            shard = {
                "rank": rank,
                "path": shard_name(rank),
                "rows": writer.num_rows,
                "sha256": sha256_file(path),
                "bytes": path.stat().st_size,
            }
            if LABEL_COLUMN in schema.names:
                shard["label_counts"] = writer.sorted_label_counts()
            shards.append(shard)
        total_rows = sum(shard["rows"] for shard in shards)
        manifest = {
            "format": MANIFEST_FORMAT,
            "world_size": world_size,
            "seed": seed,
            "drop_remainder": drop_remainder,
            "source": {"path": given_path, "sha256": sha256_file(input_path), "rows": num_rows},
            "total_rows": total_rows,
            "dropped_rows": num_rows - total_rows,
            "schema": [{"name": field.name, "type": str(field.type)} for field in schema],
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
