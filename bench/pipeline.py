"""Benchmark 4: wall time of the whole DAG against the sum of its stages' own compute times.

    python bench/pipeline.py                  # digits, 3 runs (ddp, localsgd, independent), 4 epochs
    python bench/pipeline.py --epochs 1       # smoke size

Runs ``snakemake --cores 2`` on a copy of config/config.yaml with an inline ``runs:`` mapping, in a
fresh directory, and compares its wall time with the sum of the ``s`` column of every
``benchmarks/**/*.tsv`` the rules wrote. Rules without a ``benchmark:`` (gather, track, summary) are
timed from Snakemake's log (1 s resolution). The fixed start-up costs are measured on their own,
each a median of repetitions: Snakemake building the DAG (``--dry-run``), a bare Python start,
imports of the stage modules, and a torchrun start with two no-op ranks.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_RATIO = 1.15
RUNS = {
    "ddp": {"strategy": "ddp", "sync_every": 0, "merge_method": "consolidate"},
    "localsgd": {"strategy": "localsgd", "sync_every": 8, "merge_method": "uniform"},
    "independent": {"strategy": "localsgd", "sync_every": 0, "merge_method": "weighted"},
}
IMPORTS = {
    "python start (no imports)": "pass",
    "import torch": "import torch",
    "import shardfuse.partition (pyarrow, numpy)": "import shardfuse.partition",
    "import shardfuse.train (torch, pyarrow)": "import shardfuse.train",
    "import shardfuse.tracking (mlflow)": "import shardfuse.tracking",
}
JOB_START = re.compile(r"^(?:local)?rule (\w+):$")
FINISHED = re.compile(r"^Finished jobid: (\d+) \(Rule: (\w+)\)$")


def write_config(work_dir: Path, epochs: int, runs: list[str]) -> Path:
    import yaml

    config = yaml.safe_load((common.REPO / "config" / "config.yaml").read_text())
    config["runs"] = {name: RUNS[name] for name in runs}
    config["run_defaults"]["epochs"] = epochs
    config["mlflow"] = {"tracking_uri": f"sqlite:///{work_dir}/mlflow.db", "experiment": "bench"}
    work_dir.mkdir(parents=True, exist_ok=True)
    path = work_dir / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake_cmd(work_dir: Path, *extra: str) -> list[object]:
    return [
        Path(common.PYTHON).parent / "snakemake",
        "--snakefile", common.REPO / "Snakefile",
        "--directory", work_dir,
        "--configfile", work_dir / "config.yaml",
        "--cores", "2",
        *extra,
    ]  # fmt: skip


def unbenchmarked_jobs(log: str) -> dict[str, float]:
    """Seconds per rule of the jobs that have no benchmark file, from the timestamps in the log."""
    jobs: dict[str, list] = {}  # jobid -> [rule, start, has a benchmark]
    seconds: dict[str, float] = {}
    stamp = rule = jobid = None
    for line in log.splitlines():
        line = line.strip()
        if line.startswith("[") and line.endswith("]"):
            with contextlib.suppress(ValueError):
                stamp = datetime.datetime.strptime(line[1:-1], "%a %b %d %H:%M:%S %Y")
        elif match := JOB_START.match(line):
            rule, jobid = match.group(1), None
        elif rule and line.startswith("jobid:"):
            jobid = line.split()[1]
            jobs[jobid] = [rule, stamp, False]
        elif jobid and line.startswith("benchmark:"):
            jobs[jobid][2] = True
        elif (match := FINISHED.match(line)) and match.group(1) in jobs:
            name, started, benchmarked = jobs[match.group(1)]
            if not benchmarked and name != "all" and started and stamp:
                seconds[name] = seconds.get(name, 0.0) + (stamp - started).total_seconds()
    return seconds


def run(epochs: int, reps: int, work_dir: Path, runs: list[str] | None = None) -> dict:
    runs = runs or list(RUNS)
    startup: dict[str, float] = {}
    dry_dir = work_dir / "dry"
    write_config(dry_dir, epochs, runs)
    startup["snakemake start + DAG (--dry-run)"] = common.median(
        [common.measure(snakemake_cmd(dry_dir, "--dry-run")).seconds for _ in range(reps)]
    )
    for label, code in IMPORTS.items():
        startup[label] = common.median(
            [common.measure(common.python_cmd("-c", code)).seconds for _ in range(reps)]
        )
    torchrun = common.python_cmd(
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "--no-python",
        "true",
    )
    startup["torchrun start, 2 no-op ranks"] = common.median(
        [common.measure(torchrun).seconds for _ in range(reps)]
    )

    dag_dir = work_dir / "dag"
    write_config(dag_dir, epochs, runs)
    dag = common.measure(snakemake_cmd(dag_dir, "--keep-going"), check=False)
    dag_seconds, log, failure = dag.seconds, dag.stdout, None
    if dag.returncode != 0:  # report what ran: another stage may be mid-change
        failed = sorted(set(re.findall(r"Error in rule (\w+):", log)))
        failure = f"the DAG failed (exit {dag.returncode}) in rule(s) {', '.join(failed) or '?'}"
    per_rule: dict[str, float] = {}
    for tsv in sorted((dag_dir / "benchmarks").rglob("*.tsv")):
        lines = tsv.read_text().splitlines()
        header, values = lines[0].split("\t"), lines[-1].split("\t")
        rule = tsv.relative_to(dag_dir / "benchmarks").parts[0]
        per_rule[rule] = per_rule.get(rule, 0.0) + float(values[header.index("s")])
    stage_sum = sum(per_rule.values())
    untimed = unbenchmarked_jobs(log)
    fixed = startup["snakemake start + DAG (--dry-run)"]
    ratio = dag_seconds / stage_sum if stage_sum else float("nan")
    ok = dag_seconds <= TARGET_RATIO * stage_sum + fixed
    checks = [
        (
            f"DAG wall <= {TARGET_RATIO}x sum of stage benchmarks + Snakemake start ({fixed:.1f} s)",
            f"{dag_seconds:.1f} s vs {TARGET_RATIO * stage_sum + fixed:.1f} s (ratio {ratio:.2f}x)"
            + (f"; {failure}" if failure else ""),
            ok and failure is None,
        )
    ]
    rule_rows = [[rule, seconds, "benchmark: tsv"] for rule, seconds in per_rule.items()]
    rule_rows += [[rule, seconds, "log timestamps (no benchmark:)"] for rule, seconds in untimed.items()]
    markdown = common.table(
        ["measure", "seconds"],
        [
            ["whole DAG, wall (snakemake --cores 2)", dag_seconds],
            ["sum of the stages' benchmark s", stage_sum],
            ["ratio wall / sum", f"{ratio:.2f}x"],
            ["overhead (wall - sum)", dag_seconds - stage_sum],
        ],
    )
    markdown += "\n\n" + common.table(["rule (all its jobs)", "seconds", "timed from"], rule_rows)
    markdown += f"\n\nFixed start-up costs (median of {reps} runs each):\n\n" + common.table(
        ["start-up", "seconds"], [[label, value] for label, value in startup.items()]
    )
    markdown += (
        f"\n\nConfig: config/config.yaml with runs {', '.join(runs)} (digits, world size 2, "
        f"{epochs} epochs), MLflow in a local SQLite file, 2 cores." + (f" **{failure}**." if failure else "")
    )
    return {
        "title": "4. Pipeline overhead",
        "markdown": markdown,
        "checks": checks,
        "results": {"wall": dag_seconds, "sum": stage_sum, "per_rule": per_rule, "startup": startup},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--runs", nargs="+", choices=list(RUNS), default=list(RUNS))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/pipeline"))
    args = parser.parse_args()
    try:
        section = run(args.epochs, args.reps, args.work_dir, args.runs)
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])
    failed = False
    for name, value, ok in section["checks"]:
        print(f"{common.verdict(ok)}  {name}: {value}")
        failed |= ok is False
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
