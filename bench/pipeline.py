"""Benchmark 4: wall time of the whole DAG against the sum of its stages' own compute times.

    python bench/pipeline.py                  # digits, 3 runs (ddp, localsgd, independent), 4 epochs
    python bench/pipeline.py --epochs 1       # smoke size

Runs ``snakemake --cores 2`` on a copy of config/config.yaml with an inline ``runs:`` mapping, in a
fresh directory, and compares its wall time with the sum of the ``s`` column of every
``benchmarks/**/*.tsv`` the rules wrote. Rules without a ``benchmark:`` (gather, track, summary) are
timed from Snakemake's log (1 s resolution). The fixed start-up costs are measured on their own,
each a median of repetitions: Snakemake building the DAG (``--dry-run``), a bare Python start,
imports of the stage modules, and a torchrun start with two no-op ranks.

Then the default experiment as `make run` runs it (the repository's config, `--cores all`): seconds by
rule, its wall time against its floor (the sum of its jobs' own seconds over the 2 cores, plus Snakemake's
start), and each train job's fixed cost (its wall time minus the training loop) against its floor
measured in the same run: a bare torchrun job of two ranks that import torch, join gloo and take one
DDP optimiser step (bench/one_step.py). ``--no-default`` skips it (the smoke run does).
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


# Targets as ratios against floors measured in the same run (an absolute number of seconds is a
# property of the machine): the default experiment's wall against its jobs' own seconds spread over
# the cores, and a train job's fixed cost against a bare torchrun job's whole wall.
DEFAULT_TARGET_RATIO = 1.15
TRAIN_FIXED_TARGET_RATIO = 1.3
CORES = 2


def rule_totals(dag_dir: Path) -> dict[str, list[float]]:
    """Seconds of every benchmarked job, by rule."""
    totals: dict[str, list[float]] = {}
    for tsv in sorted((dag_dir / "benchmarks").rglob("*.tsv")):
        lines = tsv.read_text().splitlines()
        header, values = lines[0].split("\t"), lines[-1].split("\t")
        rule = tsv.relative_to(dag_dir / "benchmarks").parts[0]
        totals.setdefault(rule, []).append(float(values[header.index("s")]))
    return totals


def train_fixed_costs(dag_dir: Path) -> dict[str, float]:
    """Per training: the train job's wall time (its benchmark) minus its training loop (train.json's
    train_seconds, the slowest rank): process starts, imports, rendezvous, data and publishing."""
    import json

    costs = {}
    for tsv in sorted((dag_dir / "benchmarks" / "train").glob("*.tsv")):
        lines = tsv.read_text().splitlines()
        wall = float(lines[-1].split("\t")[lines[0].split("\t").index("s")])
        info = json.loads((dag_dir / "results" / "trainings" / tsv.stem / "ranks" / "train.json").read_text())
        costs[f"{tsv.stem} (W={info['world_size']})"] = wall - info["train_seconds"]
    return costs


def core_seconds(dag_dir: Path, totals: dict[str, list[float]], untimed: dict[str, float]) -> float:
    """The jobs' own seconds, each times the cores it keeps busy: a train job's wall x its ranks (one
    core each), any other job's wall (one process)."""
    import json

    total = sum(sum(times) for rule, times in totals.items() if rule != "train") + sum(untimed.values())
    for tsv in sorted((dag_dir / "benchmarks" / "train").glob("*.tsv")):
        lines = tsv.read_text().splitlines()
        wall = float(lines[-1].split("\t")[lines[0].split("\t").index("s")])
        info = json.loads((dag_dir / "results" / "trainings" / tsv.stem / "ranks" / "train.json").read_text())
        total += wall * min(info["world_size"], CORES)
    return total


def one_step_floor(reps: int) -> float:
    """Median wall of a bare two-rank torchrun job that imports torch and takes one optimiser step."""
    cmd = common.python_cmd(
        "-m", "torch.distributed.run", "--standalone", "--nnodes=1", "--nproc-per-node=2",
        Path(__file__).with_name("one_step.py"),
    )  # fmt: skip
    return common.median([common.measure(cmd).seconds for _ in range(reps)])


def default_experiment(work_dir: Path, snakemake_start: float, reps: int = 3) -> dict:
    """The README's `make run`: the repository's config/config.yaml and runs.tsv, `snakemake --cores
    all` in a fresh directory (MLflow store included), timed whole and by rule."""
    import shutil

    dag_dir = work_dir / "default"
    dag_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(common.REPO / "config", dag_dir / "config")
    cmd = [
        Path(common.PYTHON).parent / "snakemake",
        "--snakefile", common.REPO / "Snakefile",
        "--directory", dag_dir,
        "--cores", "all",
    ]  # fmt: skip
    dag = common.measure(cmd, check=False)
    totals = rule_totals(dag_dir)
    untimed = unbenchmarked_jobs(dag.stdout)
    fixed = train_fixed_costs(dag_dir) if dag.returncode == 0 else {}
    w2 = [cost for name, cost in fixed.items() if name.endswith("(W=2)")]
    floor_step = one_step_floor(reps)
    job_seconds = core_seconds(dag_dir, totals, untimed)
    floor_wall = job_seconds / CORES + snakemake_start
    rows = [[rule, len(times), sum(times), common.median(times)] for rule, times in totals.items()]
    rows += [[rule, "-", seconds, "-"] for rule, seconds in untimed.items()]
    markdown = common.table(["rule", "jobs", "seconds, all jobs", "median per job"], rows)
    markdown += "\n\n" + common.table(
        ["train job", "fixed cost s (job wall - training loop)"], [[k, v] for k, v in fixed.items()]
    )
    markdown += (
        f"\n\n`make run` equivalent (`snakemake --cores all`, the repository's default experiment, "
        f"fresh directory): **{dag.seconds:.1f} s** wall, exit {dag.returncode}. Rules without a "
        "benchmark are timed from Snakemake's log (1 s resolution); jobs run two at a time on 2 cores."
    )
    if dag.returncode != 0:  # say why in the results, not only that it failed
        markdown += "\n\nThe run failed; the end of its output:\n\n```\n" + dag.stdout[-3000:] + "\n```"
    markdown += (
        f"\n\nFloors measured in this run: the jobs' own core-seconds {job_seconds:.1f} s (a train job's "
        f"wall x its ranks, any other job's wall) over {CORES} cores + "
        f"Snakemake's start {snakemake_start:.1f} s = **{floor_wall:.1f} s**; a bare torchrun job (2 ranks: "
        f"import torch, join gloo, one DDP AdamW step; bench/one_step.py) **{floor_step:.2f} s** wall."
    )
    fixed_median = common.median(w2) if w2 else float("nan")
    checks = [
        (
            f"default experiment (make run) wall <= {DEFAULT_TARGET_RATIO}x its floor (its jobs' seconds / "
            f"{CORES} cores + Snakemake start)",
            f"{dag.seconds:.1f} s vs floor {floor_wall:.1f} s ({dag.seconds / floor_wall:.2f}x)",
            dag.returncode == 0 and dag.seconds <= DEFAULT_TARGET_RATIO * floor_wall,
        ),
        (
            f"train job fixed cost at W=2 <= {TRAIN_FIXED_TARGET_RATIO}x a bare torchrun job taking one "
            "optimiser step (median of the W=2 trainings)",
            f"{fixed_median:.2f} s vs {floor_step:.2f} s ({fixed_median / floor_step:.2f}x)"
            if w2
            else "not measured",
            bool(w2) and fixed_median <= TRAIN_FIXED_TARGET_RATIO * floor_step,
        ),
    ]
    return {"markdown": markdown, "checks": checks, "wall": dag.seconds, "fixed": fixed}


def run(epochs: int, reps: int, work_dir: Path, runs: list[str] | None = None, default: bool = True) -> dict:
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
    per_rule = {rule: sum(times) for rule, times in rule_totals(dag_dir).items()}
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
    if default:
        section = default_experiment(work_dir, startup["snakemake start + DAG (--dry-run)"], reps)
        markdown += "\n\n### The default experiment\n\n" + section["markdown"]
        checks += section["checks"]
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
    parser.add_argument(
        "--no-default", action="store_true", help="skip the default experiment (make run) measurement"
    )
    args = parser.parse_args()
    try:
        section = run(args.epochs, args.reps, args.work_dir, args.runs, default=not args.no_default)
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
