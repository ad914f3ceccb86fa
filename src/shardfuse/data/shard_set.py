"""A shard set written: a training split dealt into one Parquet shard per rank by a partitioner
(:mod:`shardfuse.data.partitioners`), plus the manifest that describes it. The partition stage's library;
its docstring says what the files hold and how memory stays flat.
"""

from __future__ import annotations

import functools
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardfuse.console.progress import StageProgress
from shardfuse.data.heterogeneity import heterogeneity
from shardfuse.data.manifest import MANIFEST_FORMAT, MANIFEST_NAME
from shardfuse.data.partitioners import registry
from shardfuse.data.partitioners.assignment import Deal, Layout
from shardfuse.data.partitioners.passes import (
    RankValueTally,
    check_columns,
    check_counted,
    count_values,
    dealt_ranks,
    scanner,
)
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
    BackgroundWrites,
    ShardWriter,
    dictionary_columns,
    grouped_batches,
    max_rows_per_group,
    rows_per_group,
)
from shardfuse.io import OutputFolder, UserError, atomic_dir, recorded_sha256, sha256_file, write_json

# A shard set's folder: its manifest says it is one (partition --out-dir).
OUTPUT = OutputFolder("partition", "--out-dir", MANIFEST_NAME, "format", MANIFEST_FORMAT)


def _check_numbers(world_size: int, seed: int, batch_size: int) -> None:
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"--world-size must be an integer >= 1, got {world_size!r}")
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise UserError(f"--seed must be an integer >= 0, got {seed!r}")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise UserError(f"--batch-size must be an integer >= 1, got {batch_size!r}")


def partition_parquet(
    input_path: str | Path,
    out_dir: str | Path,
    world_size: int,
    seed: int,
    drop_remainder: bool = False,
    batch_size: int = 65536,
    partitioner: str = registry.DEFAULT,
    params: dict[str, Any] | None = None,
) -> dict:
    """Write OUT_DIR/shard-{rank}.parquet for every rank plus manifest.json; return the manifest."""
    given_path = str(input_path)  # recorded as given: an absolute path would make the manifest host-specific
    input_path, out_dir = Path(input_path), Path(out_dir)
    _check_numbers(world_size, seed, batch_size)
    record = registry.find(partitioner)
    params = registry.resolve_params(partitioner, params, world_size)
    if drop_remainder and not record.drops_remainder:
        raise UserError(
            f"--drop-remainder makes iid's shards equal; partitioner {record.name} decides its own shard "
            "sizes, so remove it (drop_remainder: false in the config)"
        )
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
    what = f"--input {input_path}"
    read_rows = min(batch_size, max_rows_per_group(schema))  # does not change the output, only memory
    dealt_columns, counted_columns = record.columns(params), record.counted_columns(params)
    check_columns(record.name, (*dealt_columns, *counted_columns), schema, what, REMAKE_INPUT)
    check_counted(record.name, counted_columns, schema)
    counts = count_values(parquet_file, counted_columns, what, REMAKE_INPUT, read_rows)
    scan = scanner(parquet_file, dealt_columns, what, REMAKE_INPUT, read_rows)
    deal = record.assign(Layout(num_rows, world_size, seed, drop_remainder, scan), counts, params)
    # Group values per rank for the manifest: a named partitioner's counted columns but the label.
    tally = RankValueTally(counts if record.identity(params) else {}, world_size)
    ranks_of = functools.partial(_tallied_ranks, tally, record.name, deal, dealt_columns, world_size)
    row_group_rows = rows_per_group(parquet_file, world_size)
    use_dictionary = dictionary_columns(parquet_file)

    # Four threads, so a 2-core machine stays busy: reading and grouping by rank (prefetched), this
    # one (buffering row groups), writing, and checksums (the input's, and each shard's as it grows).
    with atomic_dir(out_dir, OUTPUT) as tmp_dir, ThreadPoolExecutor(max_workers=2) as hashers:
        # The input's checksum: prepare's record when the file is unchanged since (one pass less).
        recorded = recorded_sha256(input_path)
        source_sha256: Future[str] = hashers.submit(lambda: recorded or sha256_file(input_path))
        writes = BackgroundWrites()
        writers = [
            ShardWriter(
                tmp_dir / shard_name(rank),
                schema,
                row_group_rows,
                writes,
                hashers,
                use_dictionary,
                world_size,
            )
            for rank in range(world_size)
        ]
        offset = 0
        try:
            batches = read_batches(parquet_file, what, REMAKE_INPUT, batch_size=read_rows)
            dealt = prefetched(grouped_batches(batches, ranks_of, world_size, num_rows, what))
            shown = f"partition {out_dir.parent.name}/{out_dir.name}"
            with StageProgress(shown, num_rows, "rows") as progress:
                for grouped, bounds in dealt:
                    offset += grouped.num_rows
                    for rank, writer in enumerate(writers):
                        writer.add(grouped.slice(int(bounds[rank]), int(bounds[rank + 1] - bounds[rank])))
                    progress.advance(grouped.num_rows)
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
        _refuse_empty_shards(record.name, [writer.num_rows for writer in writers])

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
            if tally.columns:
                shard["value_counts"] = tally.of_rank(rank)
            shard["column_moments"] = writer.column_moments()
            shards.append(shard)
        total_rows = sum(shard["rows"] for shard in shards)
        manifest = {"format": MANIFEST_FORMAT, "world_size": world_size, "seed": seed}
        manifest["drop_remainder"] = drop_remainder
        if record.identity(params):  # iid's manifests keep the bytes they had before partitioners
            manifest["partition"] = {"name": record.name, "params": params}
            manifest["heterogeneity"] = heterogeneity(shards)
        manifest.update(
            source={"path": given_path, "sha256": source_sha256.result(), "rows": num_rows},
            total_rows=total_rows,
            dropped_rows=num_rows - total_rows,
            schema=[{"name": field.name, "type": str(field.type)} for field in schema],
            columns=[column.to_json() for column in columns],
            shards=shards,
        )
        write_json(tmp_dir / MANIFEST_NAME, manifest)
    return manifest


def _tallied_ranks(
    tally: RankValueTally,
    name: str,
    deal: Deal,
    columns: tuple[str, ...],
    world_size: int,
    batch: pa.RecordBatch,
) -> np.ndarray:
    """The batch's ranks from the deal (checked), its group values tallied per rank on the way."""
    ranks = dealt_ranks(name, deal, columns, world_size, batch)
    tally.add(batch, ranks)
    return ranks


def _refuse_empty_shards(name: str, rows: list[int]) -> None:
    """A rank without rows cannot train; iid never deals one (W <= N), another rule's params might."""
    empty = [rank for rank, count in enumerate(rows) if count == 0]
    if empty:
        raise UserError(
            f"partitioner {name} left rank(s) {', '.join(map(str, empty))} without rows (shards of "
            f"{'/'.join(map(str, rows))} rows); use fewer ranks or other partition parameters"
        )
