"""Partition a Parquet file into one balanced shard per rank, streamed in bounded memory.

Run by hand:

    python -m shardfuse.partition --input results/datasets/digits/train.parquet --world-size 4 --seed 0 \
        --out-dir results/shards/digits/w4-seed0

Writes OUT_DIR/shard-{rank}.parquet for rank 0..W-1 and OUT_DIR/manifest.json; the whole directory
appears at once or not at all. Which rank gets which row is a seeded random permutation (numpy
Generator(seed)); shard sizes differ by at most one row (the first N % W ranks get the extra row), or
are exactly N // W with --drop-remainder. Within a shard, rows keep their input order: training
reshuffles every epoch, and keeping order makes the output independent of the read batch size.

Memory is flat in the number of rows (:mod:`shardfuse.data.shard_writer`): the rank assignment is drawn
block by block (ASSIGNMENT_BLOCK_ROWS rows at a time), plus one read batch and per rank a write buffer sized
from the input's row width so all buffers together stay near WRITE_BUFFER_BYTES (peak RSS at three scales:
bench/partition.py, figures in bench/RESULTS.md). Output bytes depend only on the input file, W, seed and
--drop-remainder (and the numpy/pyarrow versions), never on --batch-size.

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

from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

from shardfuse.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from shardfuse.data.shard_format import (
    LABEL_COLUMN,
    describe_columns,
    open_parquet,
    prefetched,
    read_batches,
    shard_name,
)
from shardfuse.data.shard_writer import (
    REMAKE_INPUT,
    AssignmentReader,
    BackgroundWrites,
    ShardWriter,
    dictionary_columns,
    grouped_batches,
    iter_rank_assignment,
    max_rows_per_group,
    rows_per_group,
)
from shardfuse.io import (
    StageParser,
    UserError,
    atomic_dir,
    recorded_sha256,
    run_cli,
    seed_arg,
    sha256_file,
    write_json,
)


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
    assignment = AssignmentReader(iter_rank_assignment(num_rows, world_size, seed, drop_remainder))
    row_group_rows = rows_per_group(parquet_file, world_size)
    use_dictionary = dictionary_columns(parquet_file)
    what = f"--input {input_path}"

    # Four threads, so a 2-core machine stays busy: reading and grouping by rank (prefetched), this
    # one (buffering row groups), writing, and checksums (the input's, and each shard's as it grows).
    with atomic_dir(out_dir) as tmp_dir, ThreadPoolExecutor(max_workers=2) as hashers:
        # The input's checksum: prepare's record when the file is unchanged since (one pass less).
        recorded = recorded_sha256(input_path)
        source_sha256: Future[str] = hashers.submit(lambda: recorded or sha256_file(input_path))
        writes = BackgroundWrites()
        writers = [
            ShardWriter(tmp_dir / shard_name(rank), schema, row_group_rows, writes, hashers, use_dictionary)
            for rank in range(world_size)
        ]
        offset = 0
        try:
            read_rows = min(batch_size, max_rows_per_group(schema))  # does not change the output, only memory
            batches = read_batches(parquet_file, what, REMAKE_INPUT, batch_size=read_rows)
            for grouped, bounds in prefetched(
                grouped_batches(batches, assignment, world_size, num_rows, what)
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
    parser.add_argument("--seed", type=seed_arg, required=True, help="seed of the row-to-rank permutation")
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
