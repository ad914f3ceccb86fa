"""Helpers and constants shared by the tests (import them from here; conftest.py holds only the
fixtures and hooks)."""

from __future__ import annotations

import contextlib
import csv
import hashlib
import importlib
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

import yaml
from filelock import FileLock

REPO = Path(__file__).resolve().parents[2]
# Figures measured by tests, printed at the end of the run (CI log).
MEASUREMENTS: list[str] = []
# Fast status polling for a SLURM cluster on this machine; the profile's own values suit real clusters.
SLURM_FAST_STATUS = [
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--seconds-between-status-checks",
    "2",
    "--latency-wait",
    "5",
]


def missing_in_ci(message: str) -> None:
    """Something a test needs is missing: CI must have it (the test fails there); elsewhere the test
    is skipped, with ``message`` as the reason."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(message)
    pytest.skip(message)


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: this checkout's src first, venv binaries on PATH."""
    env = dict(os.environ)
    # Hermetic: a workflow run in a test tracks where its config says, never where an earlier test
    # (mlflow.set_tracking_uri exports this variable) or the developer's shell points.
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def snakemake_command(workdir: Path, *args: object) -> list[str]:
    """``snakemake`` on this repository's workflow, run in ``workdir`` (its config/config.yaml)."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        *map(str, args),
    ]


def run_in(cwd: Path, command: list, timeout: float = 900) -> subprocess.CompletedProcess:
    """``command`` (``python -m`` it when it starts with a module name such as snakemake) as a user
    runs it in ``cwd``: this checkout's environment, output captured."""
    return subprocess.run(
        [sys.executable, "-m", *map(str, command)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )


def snakemake_failure(workdir: Path, proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """Assertion message for a failed snakemake run: its stderr tail, then the end of the log of
    every job it reports as failed (the job's own error is there, not in snakemake's output)."""
    parts = [f"snakemake exited {proc.returncode}:", (proc.stderr or "")[-tail:]]
    logs = re.findall(r"^\s*log: (.+?) \(check log file", proc.stderr or "", flags=re.MULTILINE)
    for name in dict.fromkeys(path for entry in logs for path in entry.split(", ")):
        path = Path(workdir) / name
        text = path.read_text(errors="replace") if path.is_file() else "(no such file)"
        parts.append(f"--- {name} (last {tail} chars) ---\n{text[-tail:]}")
    return "\n".join(parts)


def write_train_dir(
    out: Path,
    base: dict,
    ranks: int = 2,
    rank_tensors: Callable[[int], dict] | None = None,
    run: str = "t",
) -> Path:
    """A train directory as training writes it (base and rank checkpoints, train.json) from hand-made
    tensors: ``base`` for the base model, ``rank_tensors(rank)`` (default: ``base``) for each rank."""
    from shardfuse.checkpoints.weights import save_weights

    spec = {
        "type": "mlp",
        "num_features": 4,
        "num_classes": 3,
        "hidden_sizes": [],
        "activation": "relu",
        "dropout": 0.0,
    }
    meta = {"run": run, "world_size": ranks, "strategy": "localsgd", "model": spec}
    save_weights(out / "base.safetensors", base, {**meta, "rank": None})
    for rank in range(ranks):
        tensors = rank_tensors(rank) if rank_tensors else base
        save_weights(
            out / f"rank-{rank}.safetensors", tensors, {**meta, "rank": rank, "rows": 5, "num_steps": 1}
        )
    (out / "train.json").write_text(json.dumps({**meta, "num_steps": 1}))
    return out


def run_stage(
    stage: str, *args: object, timeout: float = 300, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    """Run ``python -m shardfuse.<stage> ARGS`` as a user would (in ``cwd``), capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", f"shardfuse.{stage}", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )


def slurm_state_dir() -> Path:
    return Path(os.environ.get("SHARDFUSE_SLURM_DIR", "/tmp/shardfuse-slurm"))


def tiny_config(tmp_path: Path, independent_merge: str = "uniform") -> Path:
    config = {
        "runs": {
            "ddp": {"strategy": "ddp", "merge_method": "consolidate"},
            "independent": {"strategy": "localsgd", "sync_every": 0, "merge_method": independent_merge},
            # Same training as "independent": a merge sweep must not train twice.
            "independent_ties": {"strategy": "localsgd", "sync_every": 0, "merge_method": "ties"},
        },
        "datasets": {"digits": {"source": "digits", "test_fraction": 0.2, "seed": 0}},
        "run_defaults": {
            "dataset": "digits",
            "world_size": 2,
            "hidden_sizes": [16],
            "epochs": 2,
            "batch_size": 64,
        },
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tiny"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "--configfile",
            str(workdir / "config.yaml"),
            "--cores",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, snakemake_failure(workdir, proc)
    return proc


def tiny_experiment_run(path: Path) -> Path:
    """``path`` holding the tiny experiment (tiny_config), run to the end by Snakemake; what Snakemake
    printed is kept beside it (:func:`console_of`)."""
    tiny_config(path)
    proc = snakemake(path)
    console_of(path).write_text(proc.stdout + proc.stderr)
    return path


def console_of(workdir: Path) -> Path:
    """The console output of :func:`tiny_experiment_run` (beside its folder, not in it)."""
    return workdir.with_name(f"{workdir.name}.console.txt")


def file_state(directory: Path) -> dict[str, tuple[int, str]]:
    """mtime_ns and sha256 of every file below ``directory``."""
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def mlflow_state(workdir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    histories = {
        (r.info.run_name, "loss"): [
            (m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss")
        ]
        for r in children
    }
    return {"parents": parents, "children": children, "histories": histories}


def ranks_dir(workdir: Path, run: str) -> Path:
    """The trained ranks a run was fused from (runs that differ only in merge keys share them)."""
    training = json.loads((workdir / "results" / "runs" / run / "eval.json").read_text())["training"]
    return workdir / "results" / "trainings" / training / "ranks"


def planned_jobs(dry_run_stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run: rule -> number of jobs."""
    table = dry_run_stdout.split("Job stats:")[1].split("\n\n")[0]
    rows = (re.fullmatch(r"(\w+)\s+(\d+)", line.strip()) for line in table.splitlines())
    return {m.group(1): int(m.group(2)) for m in rows if m and m.group(1) != "total"}


def checkout_copy(dest: Path) -> Path:
    """A copy of this checkout's files (what `git clone` would give, plus uncommitted work)."""
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for name in filter(None, listed.split("\0")):
        source = REPO / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)
    return dest


def readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```", text, flags=re.DOTALL)
    assert match, f"README.md has no block after <!-- {marker} -->"
    return match.group(1)


def results_dir(checkout: Path, configfile: str | Path | None = None) -> Path:
    """Where the experiment of ``configfile`` (a path in ``checkout``; None: the default experiment)
    writes its summary and comparison plots: results/, or results/experiments/<experiment>/."""
    from shardfuse.experiment.load import DEFAULT_EXPERIMENT, results_dir_of

    if configfile is None:
        return checkout / "results"
    config = yaml.safe_load((checkout / configfile).read_text()) or {}
    return checkout / results_dir_of((config.get("mlflow") or {}).get("experiment", DEFAULT_EXPERIMENT))


def summary(checkout: Path, configfile: str | Path | None = None) -> dict[str, dict[str, str]]:
    """summary.csv's rows by run, of the experiment of ``configfile`` (:func:`results_dir`)."""
    with open(results_dir(checkout, configfile) / "summary.csv", newline="") as fh:
        return {row["run"]: row for row in csv.DictReader(fh)}


def run_readme_examples(checkout: Path, marker: str) -> dict[str, dict[str, dict[str, str]]]:
    """Each example command of the README block after ``<!-- marker -->``, one after the other in
    ``checkout`` (as a user runs them): each snakemake command's summary rows by its config's name.
    A ``python script ...`` line (making a local "pretrained" folder or data) runs with this
    checkout's interpreter."""
    found = {}
    for line in readme_block(marker).splitlines():
        command = shlex.split(line.split("#")[0])
        if not command:
            continue
        if command[0] == "python":
            proc = subprocess.run(
                [sys.executable, *command[1:]], cwd=checkout, capture_output=True, text=True,
                env=subprocess_env(), timeout=600,
            )  # fmt: skip
            assert proc.returncode == 0, proc.stderr[-3000:]
            continue
        assert command[0] == "snakemake"
        proc = run_in(checkout, command)
        assert proc.returncode == 0, snakemake_failure(checkout, proc)
        configfile = command[command.index("--configfile") + 1] if "--configfile" in command else None
        found[Path(command[-1]).stem] = summary(checkout, configfile)
    return found


def built_once(tmp_path_factory, name: str, build: Callable[[Path], object]) -> Path:
    """The directory ``name``, made by ``build(directory)`` once per test run and shared by every
    pytest-xdist worker (the first to ask builds it under a file lock; the others wait, then read it).
    A failed build leaves nothing behind, so the next worker that asks tries again and fails the same."""
    root = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        root = root.parent  # the run's directory, above every worker's own
    path = root / "built-once" / name
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if not (path / ".complete").is_file():
            shutil.rmtree(path, ignore_errors=True)
            path.mkdir()
            try:
                build(path)
            except BaseException:
                shutil.rmtree(path, ignore_errors=True)
                raise
            (path / ".complete").touch()
    return path


def base_config(runs) -> dict:
    return {
        "runs": runs,
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2},
    }


def call_stage(stage: str, *args: object, cwd: Path | None = None) -> subprocess.CompletedProcess:
    """``python -m shardfuse.<stage> ARGS`` (in ``cwd``) called in this process: the stage's own ``main``
    through the same ``run_cli`` wrapper, its stdout and stderr captured, its exit status returned (an
    exception that is not a UserError is printed as a traceback, status 1). For tests about what a stage
    decides, not about the process boundary: each subprocess costs a second or more of imports."""
    from shardfuse.console.errors import run_cli

    module = importlib.import_module(f"shardfuse.{stage}")
    out, err, status = io.StringIO(), io.StringIO(), 0
    previous = Path.cwd()
    try:
        os.chdir(cwd or previous)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            try:
                run_cli(module.main, [str(arg) for arg in args])
            except SystemExit as exc:
                status = exc.code if isinstance(exc.code, int) else 1
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(previous)
    return subprocess.CompletedProcess(
        [f"shardfuse.{stage}", *map(str, args)], status, out.getvalue(), err.getvalue()
    )


class ManualClock:
    """A clock a test moves by hand (``clock.now += 10``), for code that takes a ``clock`` callable."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now
