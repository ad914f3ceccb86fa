"""Benchmark 1b (bench/partition.py --skew): the non-IID partitioners at scale, against a bare pyarrow
read -> write of the same file and against Flower Datasets' DirichletPartitioner.

For each scale, a synthetic dataset (10 classes) is prepared and a ``user`` column added (1,000 groups of
skewed sizes: the group column ``column`` partitions by); then, interleaved and repeated, each in its own
process: ``python -m shardfuse.partition`` with ``dirichlet`` (alpha 0.5), with ``column`` (by user) and,
for reference, with ``iid``, the two bare pyarrow copies of bench/partition.py, and (with --flwr-python)
bench/flwr_partition.py:
flwr-datasets' DirichletPartitioner on the same labels, loading the Parquet file with
``datasets.load_dataset`` (its Arrow cache emptied before every run), once with each partition only
loaded (as a simulation's clients use them) and once written with ``to_parquet`` (shards on disk, what
partition makes). Whole process: wall time and peak RSS. The shard sizes of both Dirichlet runs are
compared (the same seed draws the same proportions: equal sizes mean the same split).
"""

from __future__ import annotations

import json
from pathlib import Path

import common

WORLD_SIZE = 4
ALPHA = 0.5
NUM_GROUPS = 1000
TARGET_THROUGHPUT_RATIO = 0.7
TARGET_RSS_GROWTH = 1.2
# iid on the same file: the reference, measured alongside (the targets are dirichlet's and column's).
RULES = {"iid": {}, "dirichlet": {"alpha": ALPHA}, "column": {"column": "user"}}
CHECKED = ("dirichlet", "column")
FLWR = "flwr-datasets dirichlet + to_parquet"
FLWR_IN_MEMORY = "flwr-datasets dirichlet (in memory)"


def add_groups(source: Path, dest: Path) -> Path:
    """``source`` with a ``user`` column (int64; group sizes skewed: user = floor(G * u^2), u uniform),
    streamed a row group at a time."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(0)
    parquet_file = pq.ParquetFile(source, pre_buffer=False)
    schema = parquet_file.schema_arrow.append(pa.field("user", pa.int64()))
    with pq.ParquetWriter(dest, schema) as writer:
        for batch in parquet_file.iter_batches(batch_size=65536):
            users = np.floor(NUM_GROUPS * rng.random(batch.num_rows) ** 2).astype(np.int64)
            writer.write_batch(pa.RecordBatch.from_arrays([*batch.columns, pa.array(users)], schema=schema))
    return dest


def commands(train: Path, work_dir: Path, flwr_python: str | None) -> dict[str, list]:
    from shardfuse.data.shard_format import open_parquet
    from shardfuse.data.shard_writer import dictionary_columns

    with open_parquet(train, "bench input", "") as parquet_file:
        tuned_dictionary = dictionary_columns(parquet_file)
    partition_py = Path(__file__).with_name("partition.py")
    found = {
        name: common.python_cmd(
            "-m", "shardfuse.partition", "--input", train, "--world-size", WORLD_SIZE, "--seed", 0,
            "--partitioner", name, "--params-json", json.dumps(params), "--out-dir", work_dir / name,
        )
        for name, params in RULES.items()
    }  # fmt: skip
    found["pyarrow (same options)"] = common.python_cmd(
        partition_py, "--bare-copy", train, work_dir / "copy.parquet", json.dumps(tuned_dictionary)
    )
    found["pyarrow (defaults)"] = common.python_cmd(
        partition_py, "--bare-copy", train, work_dir / "copy.parquet", "true"
    )
    if flwr_python:
        peer = [
            flwr_python, Path(__file__).with_name("flwr_partition.py"), train, work_dir / "flwr",
            WORLD_SIZE, ALPHA, 0, work_dir / "hf-cache",
        ]  # fmt: skip
        found[FLWR_IN_MEMORY] = [*peer, "--no-write"]
        found[FLWR] = peer
    return found


def measure_scale(train: Path, reps: int, work_dir: Path, flwr_python: str | None) -> dict:
    cmds = commands(train, work_dir, flwr_python)
    samples: dict[str, list[common.Measured]] = {name: [] for name in cmds}
    same_split = None
    for _ in range(reps):
        for name, cmd in cmds.items():
            samples[name].append(common.measure(cmd))
            if name == FLWR:
                manifest = json.loads((work_dir / "dirichlet" / "manifest.json").read_text())
                flwr_sizes = json.loads(samples[name][-1].stdout.strip().splitlines()[-1])
                same_split = flwr_sizes == [shard["rows"] for shard in manifest["shards"]]
            for path in ("flwr", "hf-cache", "copy.parquet"):  # each run starts without the others' files
                common.remove(work_dir / path)
        for path in RULES:
            common.remove(work_dir / path)
    mb = train.stat().st_size / 1e6

    def ratio(name: str) -> float:
        bare = samples["pyarrow (same options)"]
        return common.median([b.seconds / p.seconds for p, b in zip(samples[name], bare, strict=True)])

    result = {"input_mb": mb, "same_split_as_flwr": same_split}
    for name, ms in samples.items():
        result[name] = {
            "seconds": common.median([m.seconds for m in ms]),
            "mb_per_s": common.median([mb / m.seconds for m in ms]),
            "rss_mb": common.median([m.peak_rss_mb for m in ms]),
            "ratio_vs_same_options": ratio(name),
        }
    return result


def run(
    base_rows: int, factors: list[int], num_features: int, reps: int, work_dir: Path, flwr_python: str | None
) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    results = []
    for factor in factors:
        data_dir = work_dir / f"data-{factor}x"
        common.make_dataset(data_dir, round(base_rows * factor / 0.99), num_features)
        train = add_groups(data_dir / "train.parquet", work_dir / "grouped.parquet")
        common.remove(data_dir)
        import pyarrow.parquet as pq

        rows = pq.read_metadata(train).num_rows
        results.append({"factor": factor, "rows": rows, **measure_scale(train, reps, work_dir, flwr_python)})
        common.remove(train)
    return summarise(results, reps, flwr_python is not None)


def summarise(results: list[dict], reps: int, with_flwr: bool) -> dict:
    first, last = results[0], results[-1]
    names = [*RULES, "pyarrow (same options)", "pyarrow (defaults)"] + (
        [FLWR_IN_MEMORY, FLWR] if with_flwr else []
    )
    checks = []
    for name in CHECKED:
        worst = min(r[name]["ratio_vs_same_options"] for r in results)
        growth = last[name]["rss_mb"] / first[name]["rss_mb"]
        checks += [
            (f"{name} partition throughput >= {TARGET_THROUGHPUT_RATIO}x a bare pyarrow read -> write "
             "(same writer options), every scale", f"min {worst:.2f}x", worst >= TARGET_THROUGHPUT_RATIO),
            (f"{name} partition peak RSS at {last['factor']}x <= {TARGET_RSS_GROWTH}x at {first['factor']}x",
             f"{growth:.2f}x", growth <= TARGET_RSS_GROWTH),
        ]  # fmt: skip
    if with_flwr:
        checks.append(
            ("dirichlet: the shard sizes of flwr-datasets' DirichletPartitioner (same seed), every scale",
             str([r["same_split_as_flwr"] for r in results]), all(r["same_split_as_flwr"] for r in results))
        )  # fmt: skip
    header = ["scale", "rows", "input MB"]
    for name in names:
        header += [f"{name} s", f"{name} peak RSS MB"]
    rows = []
    for r in results:
        row = [f"{r['factor']}x", f"{r['rows']:,}", f"{r['input_mb']:,.0f}"]
        for name in names:
            row += [f"{r[name]['seconds']:.2f}", f"{r[name]['rss_mb']:.0f}"]
        rows.append(row)
    markdown = common.table(header, rows)
    ratios = [
        [f"{r['factor']}x"]
        + [f"{r[name]['ratio_vs_same_options']:.2f}x" for name in names if name != "pyarrow (same options)"]
        for r in results
    ]
    markdown += (
        "\n\nThroughput against the bare copy with partition's writer options (paired per repetition):\n\n"
    )
    markdown += common.table(["scale", *[n for n in names if n != "pyarrow (same options)"]], ratios)
    markdown += (
        f"\n\nW={WORLD_SIZE}, dirichlet alpha {ALPHA} (seed 0), column by a `user` column of {NUM_GROUPS:,} "
        f"groups of skewed sizes; median of {reps} interleaved repetitions; whole processes (start-up "
        "included), peak RSS of the process. flwr-datasets: `load_dataset('parquet')` into an emptied "
        "cache, DirichletPartitioner, each partition loaded (in memory) or written with `to_parquet`."
    )
    return {
        "title": "1b. Non-IID partitioners at scale",
        "markdown": markdown,
        "checks": checks,
        "results": results,
    }
