"""Helpers of the single-node SLURM cluster's tests (tests/services/test_slurm*.py): the profile's
snakemake command, small experiments, and what the cluster and the plugin's logs say of the jobs."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import yaml

from tests.support.helpers import (
    REPO,
    SLURM_FAST_STATUS,
    snakemake_command,
    snakemake_failure,
    subprocess_env,
)

FAST_STATUS = SLURM_FAST_STATUS


def snakemake_cmd(workdir: Path, *args: str, profile: bool = True) -> list[str]:
    if profile:
        return snakemake_command(workdir, "--profile", REPO / "profiles" / "slurm", *FAST_STATUS, *args)
    return snakemake_command(workdir, *args)


def run_snakemake(workdir: Path, *args: str, profile: bool = True, timeout: float = 600):
    started = time.perf_counter()
    proc = subprocess.run(
        snakemake_cmd(workdir, *args, profile=profile),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )
    return proc, time.perf_counter() - started


def default_experiment(path: Path) -> Path:
    """A working directory holding the repository's default experiment config."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "config", path / "config")
    return path


def tiny_experiment(path: Path, **run) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "runs": {"tiny": {"strategy": "ddp", "merge_method": "consolidate", **run}},
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "hidden_sizes": [16], "epochs": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db"},
    }
    (path / "config").mkdir()
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def partitioned_tiny_experiment(path: Path, **run) -> Path:
    """:func:`tiny_experiment`, prepared and partitioned locally (no SLURM job): its trainings are next."""
    workdir = tiny_experiment(path, **run)
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    return workdir


def job_records(state_dir: Path) -> dict[str, str]:
    """JobId -> JobState from the cluster's job-completion log."""
    log = state_dir / "jobcomp.log"
    text = log.read_text() if log.exists() else ""
    return dict(re.findall(r"JobId=(\d+) .*?JobState=(\S+)", text))


def slurm_job_dirs(workdir: Path, rule: str) -> list[Path]:
    """The plugin's log folders of the jobs that ran ``rule``: its own (rule_RULE) and the group jobs
    it was part of (group_GROUP_RULE1_RULE2..., the rules in lexical order)."""
    logs = workdir / ".snakemake" / "slurm_logs"
    groups = [path for path in logs.glob("group_*") if f"_{rule}_" in f"{path.name}_"]
    return [logs / f"rule_{rule}", *groups]


def slurm_job_ids(workdir: Path, rule: str) -> list[str]:
    return sorted(log.stem for folder in slurm_job_dirs(workdir, rule) for log in folder.rglob("*.log"))


def all_slurm_job_ids(workdir: Path) -> list[str]:
    return sorted(log.stem for log in (workdir / ".snakemake" / "slurm_logs").rglob("*.log"))


def cluster_profile(path: Path, **keys) -> Path:
    """profiles/slurm with some top-level keys replaced, as a user edits it."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({**profile, **keys}))
    return path


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


def corrupt_keeping_mtime(path: Path) -> None:
    """Flip bytes in the middle of ``path`` without changing its size or times (Snakemake sees nothing)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def wait_for(condition, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout} s")


def wait_for_running_job(workdir: Path, rule: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job_id in slurm_job_ids(workdir, rule):
            state = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
            ).stdout.strip()
            if state == "RUNNING":
                return job_id
        time.sleep(1)
    raise AssertionError(f"no {rule} job reached RUNNING within {timeout} s")


def jobs_of(workdir: Path, state_dir: Path) -> set[str]:
    """The ids of the jobs submitted from ``workdir``: queued, running or ended (the job-completion log)."""
    ended = re.findall(r"JobId=(\d+) .*?WorkDir=(\S*)", (state_dir / "jobcomp.log").read_text())
    listing = subprocess.run(
        ["squeue", "--states=all", "-h", "-o", "%i %Z"], capture_output=True, text=True, check=True
    ).stdout
    current = [tuple(line.split(maxsplit=1)) for line in listing.splitlines() if line.strip()]
    inside = str(workdir)
    return {job for job, cwd in [*ended, *current] if cwd.strip() == inside or cwd.startswith(inside + "/")}


def job_processes(job_id: str) -> list[int]:
    """The pids of a running SLURM job's own processes on this machine (its batch script and every
    process under it: they carry SLURM_JOB_ID in their environment), slurmstepd excepted."""
    marker = f"SLURM_JOB_ID={job_id}".encode()
    pids = []
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit() or int(proc.name) == os.getpid():
            continue
        try:
            if (proc / "comm").read_text().strip().startswith("slurmstepd"):
                continue
            if marker in (proc / "environ").read_bytes().split(b"\0"):
                pids.append(int(proc.name))
        except OSError:  # gone, or not ours to read
            continue
    return pids


def signal_job_processes(job_id: str, sig: int) -> list[int]:
    """Send ``sig`` to every process of the job (:func:`job_processes`); the pids signalled."""
    pids = job_processes(job_id)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)
    return pids
