"""Benchmark 1: partition at scale against a bare pyarrow read -> write of the same file.

    python bench/partition.py                       # 1x, 4x, 16x of 1.4M rows (16x: 22.4M rows, ~2.2 GB)
    python bench/partition.py --base-rows 20000 --reps 1   # smoke size

For each scale, ``shardfuse.prepare`` makes a synthetic dataset (its peak RSS is recorded too: the same
memory rule applies to it), then, interleaved and repeated, each in its own process:

* ``python -m shardfuse.partition`` (W=4) of train.parquet;
* bare pyarrow: ``iter_batches`` -> ``ParquetWriter`` into one file with pyarrow's default writer options;
* bare pyarrow with the writer options partition uses (no dictionary for float columns that do not
  repeat): the practical limit. The 0.7x target is checked against both.

Throughput is input Parquet bytes per second of wall time (process start to exit). Ratios are paired
per repetition, then the median is taken.

Then a causal-LM token corpus (``tokens``: fixed_size_list<uint16>[257], random ids; ``--token-blocks``
blocks at full size, ~1 GB of Parquet by default, and 1/8 of that) is partitioned the same way, against
the same bare copy: the peak RSS at full size must stay within 1.2x of the one at 1/8.

``--skew`` runs benchmark 1b instead (bench/partition_skew.py): the ``dirichlet`` and ``column``
partitioners against the same bare copies, and flwr-datasets' DirichletPartitioner side by side
(``--flwr-python``: the interpreter of a venv with flwr-datasets, e.g. /tmp/shardfuse-flwr/bin/python)::

    python bench/partition.py --skew --base-rows 350000 --flwr-python /tmp/shardfuse-flwr/bin/python
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_THROUGHPUT_RATIO = 0.7
TARGET_RSS_GROWTH = 1.2
WORLD_SIZE = 4
READ_BATCH_ROWS = 65536
TOKEN_FRACTIONS = (8, 1)  # the token corpus at 1/8 and at full size
TOKEN_BLOCK_SIZE = 256


def bare_copy(source: str, dest: str, use_dictionary_json: str) -> None:
    """The baseline: stream every batch of ``source`` into ``dest`` with nothing else on the way."""
    import pyarrow.parquet as pq

    use_dictionary = json.loads(use_dictionary_json)
    parquet_file = pq.ParquetFile(source, pre_buffer=False)
    with pq.ParquetWriter(dest, parquet_file.schema_arrow, use_dictionary=use_dictionary) as writer:
        for batch in parquet_file.iter_batches(batch_size=READ_BATCH_ROWS):
            writer.write_batch(batch)


def run(
    base_rows: int,
    factors: list[int],
    num_features: int,
    reps: int,
    work_dir: Path,
    token_blocks: int | None = None,
) -> dict:
    """The numeric scales, then the token corpus (``token_blocks`` blocks at full size; by default
    base_rows * 1.4: ~1 GB of Parquet at the default 1.4M base rows)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for factor in factors:
        data_dir = work_dir / f"data-{factor}x"
        spec = common.synthetic_spec(round(base_rows * factor / 0.99), num_features)
        prep = common.measure(
            common.python_cmd(
                "-m",
                "shardfuse.prepare",
                "--name",
                "bench",
                "--spec-json",
                json.dumps(spec),
                "--out-dir",
                data_dir,
            )
        )
        train = data_dir / "train.parquet"
        (data_dir / "test.parquet").unlink(missing_ok=True)
        results.append(
            {
                "factor": factor,
                "prepare_seconds": prep.seconds,
                "prepare_rss_mb": prep.peak_rss_mb,
                **measure_partition(train, reps, work_dir),
            }
        )
        common.remove(data_dir)
    section = summarise(results, reps)
    tokens = run_tokens(token_blocks or round(base_rows * 1.4), reps, work_dir / "tokens")
    section["markdown"] += "\n\n" + tokens["markdown"]
    section["checks"] += tokens["checks"]
    section["token_results"] = tokens["results"]
    return section


def measure_partition(train: Path, reps: int, work_dir: Path) -> dict:
    """``reps`` interleaved runs of partition and both bare copies of ``train``: rows, MB, medians of
    MB/s and peak RSS, and the paired throughput ratios."""
    from shardfuse.data.shard_format import open_parquet
    from shardfuse.data.shard_writer import dictionary_columns

    with open_parquet(train, "bench input", "") as parquet_file:
        rows = parquet_file.metadata.num_rows
        tuned_dictionary = dictionary_columns(parquet_file)
    input_bytes = train.stat().st_size
    commands = {
        "partition": common.python_cmd(
            "-m",
            "shardfuse.partition",
            "--input",
            train,
            "--world-size",
            WORLD_SIZE,
            "--seed",
            0,
            "--out-dir",
            work_dir / "shards",
        ),
        "pyarrow (same options)": common.python_cmd(
            __file__, "--bare-copy", train, work_dir / "copy.parquet", json.dumps(tuned_dictionary)
        ),
        "pyarrow (defaults)": common.python_cmd(
            __file__, "--bare-copy", train, work_dir / "copy.parquet", "true"
        ),
    }
    samples: dict[str, list[common.Measured]] = {name: [] for name in commands}
    for _ in range(reps):
        for name, cmd in commands.items():
            samples[name].append(common.measure(cmd))
            common.remove(work_dir / "shards")
            common.remove(work_dir / "copy.parquet")
    mb = input_bytes / 1e6

    def ratios(baseline: str) -> float:
        return common.median(
            [b.seconds / p.seconds for p, b in zip(samples["partition"], samples[baseline], strict=True)]
        )

    return {
        "rows": rows,
        "input_mb": mb,
        **{f"{name}_mb_per_s": common.median([mb / m.seconds for m in ms]) for name, ms in samples.items()},
        "partition_rss_mb": common.median([m.peak_rss_mb for m in samples["partition"]]),
        "pyarrow_rss_mb": common.median([m.peak_rss_mb for m in samples["pyarrow (same options)"]]),
        "ratio_vs_same_options": ratios("pyarrow (same options)"),
        "ratio_vs_defaults": ratios("pyarrow (defaults)"),
    }


def run_tokens(num_blocks: int, reps: int, work_dir: Path) -> dict:
    """Partition of a token corpus at 1/8 and full size: Markdown, the RSS check and raw results."""
    work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for fraction in TOKEN_FRACTIONS:
        train = common.write_token_corpus(
            work_dir / "tokens.parquet", num_blocks // fraction, TOKEN_BLOCK_SIZE
        )
        results.append(
            {"scale": f"1/{fraction}" if fraction > 1 else "full", **measure_partition(train, reps, work_dir)}
        )
        common.remove(train)
    first, last = results[0], results[-1]
    rss_growth = last["partition_rss_mb"] / first["partition_rss_mb"]
    checks = [
        (
            f"partition peak RSS on a token corpus at full size ({last['input_mb']:,.0f} MB) <= "
            f"{TARGET_RSS_GROWTH}x at 1/{TOKEN_FRACTIONS[0]}",
            f"{rss_growth:.2f}x",
            rss_growth <= TARGET_RSS_GROWTH,
        ),
        (
            "partition throughput on a token corpus vs a bare pyarrow read -> write (same options), "
            "full size",
            f"{last['ratio_vs_same_options']:.2f}x",
            None,
        ),
    ]
    rows = [
        [
            r["scale"],
            f"{r['rows']:,}",
            f"{r['input_mb']:,.0f}",
            r["partition_mb_per_s"],
            r["pyarrow (same options)_mb_per_s"],
            f"{r['ratio_vs_same_options']:.2f}x",
            f"{r['partition_rss_mb']:.0f}",
            f"{r['pyarrow_rss_mb']:.0f}",
            f"{r['partition_rss_mb'] / first['partition_rss_mb']:.2f}x",
        ]
        for r in results
    ]
    markdown = "Token corpus (causal LM):\n\n" + common.table(
        [
            "scale",
            "blocks",
            "input MB",
            "partition MB/s",
            "pyarrow same-options MB/s",
            "ratio vs same-options",
            "partition peak RSS MB",
            "pyarrow peak RSS MB",
            f"RSS vs 1/{TOKEN_FRACTIONS[0]}",
        ],
        rows,
    )
    markdown += (
        f"\n\nBlocks of {TOKEN_BLOCK_SIZE} + 1 uint16 tokens (random ids, vocabulary "
        f"{common.TOKEN_VOCAB_SIZE:,}), W={WORLD_SIZE}; median of {reps} interleaved repetitions."
    )
    return {"markdown": markdown, "checks": checks, "results": results}


def summarise(results: list[dict], reps: int) -> dict:
    first, last = results[0], results[-1]
    rss_growth = last["partition_rss_mb"] / first["partition_rss_mb"]
    prepare_growth = last["prepare_rss_mb"] / first["prepare_rss_mb"]
    worst_ratio = min(r["ratio_vs_same_options"] for r in results)
    worst_default = min(r["ratio_vs_defaults"] for r in results)
    checks = [
        (
            f"partition throughput >= {TARGET_THROUGHPUT_RATIO}x a bare pyarrow read -> write "
            "(pyarrow's default writer options), every scale",
            f"min {worst_default:.2f}x",
            worst_default >= TARGET_THROUGHPUT_RATIO,
        ),
        (
            f"partition throughput >= {TARGET_THROUGHPUT_RATIO}x a bare pyarrow read -> write with "
            "partition's own writer options (stricter), every scale",
            f"min {worst_ratio:.2f}x",
            worst_ratio >= TARGET_THROUGHPUT_RATIO,
        ),
        (
            f"partition peak RSS at {last['factor']}x <= {TARGET_RSS_GROWTH}x at {first['factor']}x",
            f"{rss_growth:.2f}x",
            rss_growth <= TARGET_RSS_GROWTH,
        ),
        (
            f"prepare (synthetic) peak RSS at {last['factor']}x <= {TARGET_RSS_GROWTH}x at "
            f"{first['factor']}x",
            f"{prepare_growth:.2f}x",
            prepare_growth <= TARGET_RSS_GROWTH,
        ),
    ]
    rows = [
        [
            f"{r['factor']}x",
            f"{r['rows']:,}",
            f"{r['input_mb']:,.0f}",
            r["partition_mb_per_s"],
            r["pyarrow (same options)_mb_per_s"],
            r["pyarrow (defaults)_mb_per_s"],
            f"{r['ratio_vs_same_options']:.2f}x",
            f"{r['ratio_vs_defaults']:.2f}x",
            f"{r['partition_rss_mb']:.0f}",
            f"{r['pyarrow_rss_mb']:.0f}",
            f"{r['prepare_rss_mb']:.0f}",
        ]
        for r in results
    ]
    markdown = common.table(
        [
            "scale",
            "rows",
            "input MB",
            "partition MB/s",
            "pyarrow same-options MB/s",
            "pyarrow defaults MB/s",
            "ratio vs same-options",
            "ratio vs defaults",
            "partition peak RSS MB",
            "pyarrow peak RSS MB",
            "prepare peak RSS MB",
        ],
        rows,
    )
    markdown += (
        f"\n\nW={WORLD_SIZE}; median of {reps} interleaved repetitions (ratios paired per repetition); "
        "MB/s = input Parquet bytes / wall time of the whole process (start-up included)."
    )
    return {"title": "1. Partition at scale", "markdown": markdown, "checks": checks, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base-rows", type=int, default=1_400_000, help="train rows at 1x")
    parser.add_argument("--factors", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--features", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--token-blocks", type=int, help="token corpus blocks at full size (base rows x 1.4)")
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/partition"))
    parser.add_argument("--bare-copy", nargs=3, metavar=("IN", "OUT", "USE_DICTIONARY_JSON"), help="internal")
    parser.add_argument("--skew", action="store_true", help="benchmark 1b: dirichlet and column partitions")
    parser.add_argument(
        "--flwr-python", help="--skew: a Python with flwr-datasets, to run its partitioner too"
    )
    args = parser.parse_args()
    if args.bare_copy:
        bare_copy(*args.bare_copy)
        return
    try:
        if args.skew:
            import partition_skew

            print(f"load average at start: {common.load_average()}")
            section = partition_skew.run(
                args.base_rows, args.factors, args.features, args.reps, args.work_dir, args.flwr_python
            )
        else:
            section = run(
                args.base_rows, args.factors, args.features, args.reps, args.work_dir, args.token_blocks
            )
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])
    for name, value, ok in section["checks"]:
        print(f"{common.verdict(ok)}  {name}: {value}")
    sys.exit(0 if all(ok for _, _, ok in section["checks"]) else 1)


if __name__ == "__main__":
    main()
