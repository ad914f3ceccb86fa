"""The same DAG on a real SLURM cluster (scripts/slurm-up.sh): jobs, failures, cancellation, geometry.

Required in CI (the `slurm_cluster` fixture fails there when no cluster answers); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from shardfuse.checkpoint import load_weights
from tests.conftest import (
    MEASUREMENTS,
    REPO,
    SLURM_FAST_STATUS,
    snakemake_command,
    snakemake_failure,
    subprocess_env,
)

pytestmark = [pytest.mark.integration, pytest.mark.slurm]

# The test cluster has 2 CPUs: world-size-4 trainings ask for 4 threads, which it could never grant.
FAST_STATUS = ["--set-threads", "train=2", *SLURM_FAST_STATUS]


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


def job_records(state_dir: Path) -> dict[str, str]:
    """JobId -> JobState from the cluster's job-completion log."""
    log = state_dir / "jobcomp.log"
    text = log.read_text() if log.exists() else ""
    return dict(re.findall(r"JobId=(\d+) .*?JobState=(\S+)", text))


def slurm_job_ids(workdir: Path, rule: str) -> list[str]:
    return sorted(p.stem for p in (workdir / ".snakemake" / "slurm_logs" / f"rule_{rule}").rglob("*.log"))


@pytest.fixture(scope="module")
def slurm_and_local_runs(slurm_cluster, tmp_path_factory):
    """The default experiment twice, in the same test run: with the SLURM profile and locally."""
    slurm_dir = default_experiment(tmp_path_factory.mktemp("slurm") / "work")
    proc, slurm_seconds = run_snakemake(slurm_dir)
    assert proc.returncode == 0, snakemake_failure(slurm_dir, proc)
    local_dir = default_experiment(tmp_path_factory.mktemp("local") / "work")
    local_proc, local_seconds = run_snakemake(local_dir, "--cores", "all", profile=False)
    assert local_proc.returncode == 0, snakemake_failure(local_dir, local_proc)
    timing = {
        "local_seconds": round(local_seconds, 1),
        "slurm_seconds": round(slurm_seconds, 1),
        "slurm_over_local": round(slurm_seconds / local_seconds, 2),
    }
    MEASUREMENTS.append(f"default experiment wall time: {json.dumps(timing)}")
    return {"slurm": slurm_dir, "local": local_dir, "slurm_log": proc.stderr}


def test_default_experiment_runs_partition_and_train_as_slurm_jobs(slurm_and_local_runs, slurm_cluster):
    workdir = slurm_and_local_runs["slurm"]
    records = job_records(slurm_cluster)
    num_runs = len((workdir / "results" / "summary.csv").read_text().splitlines()) - 1
    num_trainings = len(list((workdir / "results" / "trainings").glob("*/ranks")))
    for rule, expected in (
        ("partition", 2),
        ("train", num_trainings),
        ("gather", num_trainings),
        ("merge", num_runs),
        ("evaluate", num_runs),
    ):
        job_ids = slurm_job_ids(workdir, rule)
        assert len(job_ids) == expected, rule
        assert all(records.get(job_id) == "COMPLETED" for job_id in job_ids), (rule, job_ids)
    # track and summary are local rules: they never went to the cluster.
    assert slurm_job_ids(workdir, "track") == [] and slurm_job_ids(workdir, "summary") == []
    assert num_runs == 11 and num_trainings == 5

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == num_runs
    world_sizes = sum(int(r.data.params["world_size"]) for r in parents)
    assert len(runs) == num_runs + world_sizes


def test_ddp_merged_model_under_slurm_is_bitwise_identical_to_local(slurm_and_local_runs):
    slurm, _ = load_weights(slurm_and_local_runs["slurm"] / "results/runs/ddp/merged.safetensors")
    local, _ = load_weights(slurm_and_local_runs["local"] / "results/runs/ddp/merged.safetensors")
    assert slurm.keys() == local.keys()
    assert all(torch.equal(slurm[name], local[name]) for name in slurm)


def corrupt_keeping_mtime(path: Path) -> None:
    """Flip bytes in the middle of ``path`` without changing its size or times (Snakemake sees nothing)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_failed_train_job_reports_rule_job_id_and_log_paths(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work")
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    corrupt_keeping_mtime(workdir / "results/shards/digits/w2-seed0/shard-1.parquet")

    proc, _ = run_snakemake(workdir, "--until", "train")
    assert proc.returncode != 0
    (job_id,) = slurm_job_ids(workdir, "train")
    (training,) = [p.name for p in (workdir / ".snakemake" / "slurm_logs" / "rule_train").iterdir()]
    assert "Error in rule train" in proc.stderr
    assert f"SLURM-job '{job_id}' failed" in proc.stderr
    assert f"logs/train/{training}.log" in proc.stderr
    assert f".snakemake/slurm_logs/rule_train/{training}/{job_id}.log" in proc.stderr
    assert job_records(slurm_cluster)[job_id] == "FAILED"
    assert "shard of rank 1" in (workdir / f"logs/train/{training}.log").read_text()
    assert not (workdir / f"results/trainings/{training}/ranks").exists()


def test_cancelled_train_job_is_reported_as_cancelled_and_the_rerun_resumes(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work", epochs=80, checkpoint_every=40)
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    with subprocess.Popen(
        snakemake_cmd(workdir, "--until", "train"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    ) as snakemake:
        job_id = wait_for_running_job(workdir, "train", timeout=120)
        wait_for(
            lambda: list(workdir.glob("results/trainings/*/.ranks.partial/checkpoints/step-*/COMPLETE")),
            "a complete checkpoint",
            timeout=180,
        )
        subprocess.run(["scancel", job_id], check=True)
        output, _ = snakemake.communicate(timeout=180)
    assert snakemake.returncode != 0
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in output
    assert not list(workdir.glob("results/trainings/*/ranks"))

    rerun, _ = run_snakemake(workdir, "--until", "train")
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = (workdir / "logs" / "train").glob("*.log")
    assert "resuming from checkpoint step" in log.read_text()
    assert list(workdir.glob("results/trainings/*/ranks/train.json"))


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


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"nodes": 2, "nproc_per_node": 2},
            "nodes x nproc_per_node = 2 x 2 = 4 but world_size (the number of shards) is 2",
        ),
        ({"nodes": 2, "world_size": 3}, "world_size 3 (the number of shards) cannot be split evenly over 2"),
    ],
)
def test_geometry_errors_fail_before_any_sbatch(slurm_cluster, tmp_path, run, message):
    workdir = tiny_experiment(tmp_path / "work", **run)
    jobs_before = set(job_records(slurm_cluster))
    queued_before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    proc, _ = run_snakemake(workdir)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (workdir / ".snakemake" / "slurm_logs").exists()
    assert not (workdir / "results").exists()
    assert set(job_records(slurm_cluster)) == jobs_before
    assert (
        subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == queued_before
    )
