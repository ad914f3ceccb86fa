"""Partition a Parquet file into one shard per rank with a partitioner, streamed in bounded memory.

Run by hand:

    python -m shardfuse.partition --input results/datasets/digits/train.parquet --world-size 4 --seed 0 \
        --out-dir results/shards/digits/w4-seed0

Writes OUT_DIR/shard-{rank}.parquet for rank 0..W-1 and OUT_DIR/manifest.json; the whole directory
appears at once or not at all. Which rank gets which row is the partitioner's rule (--partitioner, its
parameters in --params-json; the records are in ``shardfuse.data.partitioners.registry``). The default,
iid, is a seeded random permutation (numpy Generator(seed)); shard sizes differ by at most one row (the
first N % W ranks get the extra row), or are exactly N // W with --drop-remainder. A partitioner that
reads columns (the label, a group column) sees them in a counting pass before the rows are dealt in a
second pass (``shardfuse.data.partitioners.assignment``). Within a shard, rows keep their input order:
training reshuffles every epoch, and keeping order makes the output independent of the read batch size.
The manifest names the partitioner and its parameters, each rank's group values and rows (a counted
column other than the label: ``value_counts``) and the shard set's ``heterogeneity`` (label
Jensen-Shannon divergence to the pooled labels, spread of shard rows: ``shardfuse.data.heterogeneity``),
except for iid (its manifests are byte for byte those written before partitioners existed; a reader
computes its heterogeneity from its label counts). For example, label skew::

    python -m shardfuse.partition --input results/datasets/digits/train.parquet --world-size 4 --seed 0 \
        --partitioner dirichlet --params-json '{"alpha": 0.1}' --out-dir /tmp/shards

Memory is flat in the number of rows (:mod:`shardfuse.data.shard_writer`): iid's assignment is drawn
block by block (ASSIGNMENT_BLOCK_ROWS rows at a time), plus one read batch and per rank a write buffer sized
from the input's row width so all buffers together stay near WRITE_BUFFER_BYTES (peak RSS at three scales:
bench/partition.py, figures in bench/RESULTS.md). Output bytes depend only on the input file, W, seed,
--drop-remainder and the partitioner and its parameters (and the numpy/pyarrow versions), never on
--batch-size.

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

from shardfuse.console.errors import run_cli
from shardfuse.data.partitioners import registry
from shardfuse.data.shard_set import OUTPUT, partition_parquet
from shardfuse.io import StageParser, parse_json_arg, seed_arg

__all__ = ["main", "partition_parquet"]


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.partition", description=__doc__.splitlines()[0])
    parser.add_argument("--input", required=True, help="Parquet file to partition (e.g. a train.parquet)")
    parser.add_argument("--world-size", type=int, required=True, help="number of ranks = number of shards")
    parser.add_argument("--seed", type=seed_arg, required=True, help="seed of the row-to-rank assignment")
    parser.add_argument(
        "--partitioner",
        default=registry.DEFAULT,
        help=f"the rule that deals rows to ranks (shardfuse.data.partitioners; default {registry.DEFAULT})",
    )
    parser.add_argument("--params-json", default="{}", help="the partitioner's parameters as a JSON object")
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
    OUTPUT.check(args.out_dir)  # before any row is read
    manifest = partition_parquet(
        args.input,
        args.out_dir,
        args.world_size,
        args.seed,
        drop_remainder=args.drop_remainder,
        batch_size=args.batch_size,
        partitioner=args.partitioner,
        params=parse_json_arg(args.params_json, "--params-json"),
    )
    sizes = sorted({shard["rows"] for shard in manifest["shards"]})
    print(
        f"{manifest['total_rows']} rows -> {args.world_size} shards of {'/'.join(map(str, sizes))} rows "
        f"({manifest['dropped_rows']} dropped) in {args.out_dir}"
    )


if __name__ == "__main__":
    run_cli(main)
