"""One SLURM job at a time on the single-node cluster (scripts/slurm-up.sh): the README's fuse job and
its sbatch line, a failed job, a cancelled one, a snakemake killed while its job runs, and a training
longer than its time limit. Required in CI, skipped elsewhere (the `slurm_cluster` fixture).

A module apart from tests/services/test_slurm.py so that two test workers share the cluster's
waiting time; every check here reads its own jobs (by id or working directory), never the whole queue.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time

import pytest
import torch
import yaml

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import MEASUREMENTS, REPO, snakemake_command, snakemake_failure, subprocess_env
from tests.support.slurm import (
    FAST_STATUS,
    cluster_profile,
    corrupt_keeping_mtime,
    job_records,
    partitioned_tiny_experiment,
    run_snakemake,
    signal_job_processes,
    slurm_job_ids,
    snakemake_cmd,
    tiny_experiment,
    wait_for,
    wait_for_running_job,
)

pytestmark = pytest.mark.slurm

# How long a train job may wait to start: the cluster's 4 CPUs are shared with the other service tests
# (the default experiment's jobs fill them for minutes; 120 s was once too short in CI).
QUEUED = 600


def test_failed_train_job_reports_rule_job_id_and_log_paths(slurm_cluster, tmp_path):
    workdir = partitioned_tiny_experiment(tmp_path / "work")
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
    workdir = partitioned_tiny_experiment(tmp_path / "work", epochs=80, checkpoint_every=40)
    with subprocess.Popen(
        snakemake_cmd(workdir, "--until", "train"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    ) as snakemake:
        job_id = wait_for_running_job(workdir, "train", timeout=QUEUED)
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

    (cancelled,) = (workdir / "logs" / "train").glob("*.attempt-1.log")
    cancelled_text = cancelled.read_text()
    assert "launch: " in cancelled_text  # the command it ran, and the ranks' output up to the kill

    rerun, _ = run_snakemake(workdir, "--until", "train")
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    # Snakemake deleted the declared log before the re-run; the cancelled attempt's log is kept.
    assert cancelled.read_text() == cancelled_text
    log = cancelled.with_name(cancelled.name.replace(".attempt-1.log", ".log"))
    log_text = log.read_text()
    assert "resuming from checkpoint step" in log_text
    assert f"attempt 2; earlier attempts' logs: {cancelled.name}" in log_text
    assert list(workdir.glob("results/trainings/*/ranks/train.json"))


def test_kill_9_of_snakemake_with_the_job_running_then_an_immediate_rerun_takes_over_its_result(
    slurm_cluster, tmp_path
):
    # The race of issue 18 on SLURM: the train job outlives the killed snakemake by design; the rerun's
    # job must neither train beside it on the same checkpoints nor throw its result away.
    workdir = partitioned_tiny_experiment(tmp_path / "work", epochs=500, checkpoint_every=40)
    with subprocess.Popen(
        snakemake_cmd(workdir, "--until", "train"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    ) as snakemake:
        first_job = wait_for_running_job(workdir, "train", timeout=QUEUED)
        wait_for(
            lambda: list(workdir.glob("results/trainings/*/.ranks.partial/checkpoints/step-*/COMPLETE")),
            "a complete checkpoint",
            timeout=180,
        )
        os.kill(snakemake.pid, signal.SIGKILL)  # snakemake only: the job runs on
        snakemake.wait(timeout=60)
    # Frozen (SIGSTOP: its lock and CPUs kept) until the rerun's job is seen waiting for it: on a cluster
    # shared with other tests the rerun's job may queue for longer than the rest of this training takes,
    # and the rerun would then find the result published instead of racing its owner.
    assert signal_job_processes(first_job, signal.SIGSTOP), f"no process of SLURM job {first_job} found"
    waiting = "waiting up to 600 s for the current owner of"
    try:
        still_running = subprocess.run(
            ["squeue", "-h", "-j", first_job, "-o", "%T"], capture_output=True, text=True
        )
        assert still_running.stdout.strip() == "RUNNING"
        subprocess.run(
            snakemake_cmd(workdir, "--unlock"), check=True, capture_output=True, env=subprocess_env()
        )
        with (
            (tmp_path / "rerun.stderr").open("w") as stderr,
            # A time limit inside the frozen job's: the test workers share this 4-CPU cluster, and a
            # job of another test that needs all 4 CPUs waits for the frozen job first; SLURM's backfill
            # starts the rerun's job beside the frozen one only if it ends before the frozen job's limit
            # (with the rule's own 120 min it would wait behind that job, and the rerun never start).
            subprocess.Popen(
                snakemake_cmd(workdir, "--until", "train", "--set-resources", "train:runtime=30"),
                stdout=subprocess.DEVNULL,
                stderr=stderr,
                env={**subprocess_env(), "SHARDFUSE_OWNER_WAIT": "600"},
            ) as process,
        ):
            wait_for(
                lambda: (
                    process.poll() is not None
                    or any(
                        waiting in log.read_text(errors="replace")
                        for log in (workdir / "logs" / "train").glob("*.log")
                        if ".attempt-" not in log.name
                    )
                ),
                "the rerun's job waiting for the first one",
                timeout=600,
            )
            signal_job_processes(first_job, signal.SIGCONT)
            process.wait(timeout=900)
    finally:
        signal_job_processes(first_job, signal.SIGCONT)  # never leave the cluster a frozen job
    stderr = (tmp_path / "rerun.stderr").read_text(errors="replace")
    rerun = subprocess.CompletedProcess(process.args, process.returncode, "", stderr)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = [p for p in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in p.name]
    text = log.read_text()
    assert waiting in text and f"SLURM job {first_job}" in text
    assert "was published by its previous owner; nothing to train" in text
    assert job_records(slurm_cluster).get(first_job) == "COMPLETED"
    (ranks,) = workdir.glob("results/trainings/*/ranks")
    info = json.loads((ranks / "train.json").read_text())
    assert info["slurm_job_id"] == first_job and info["num_steps"] == 500 * info["steps_per_epoch"]


def readme_group_example() -> tuple[str, str]:
    """(runs table, sbatch line) of the README's `<!-- sbatch group example: fuse -->` section."""
    text = (REPO / "README.md").read_text()
    body = text.split("<!-- sbatch group example: fuse -->", 1)[1]
    blocks = [code.strip() for code in re.findall(r"```\n(.*?)```", body, flags=re.DOTALL)[:2]]
    table, line = blocks
    assert table.startswith("run\t") and line.startswith("sbatch "), blocks
    return table, line


def test_readme_group_sbatch_line_is_what_the_plugin_submits(slurm_cluster, tmp_path):
    """The README's fuse job: a training fused two ways, trained locally, then gathered, merged and
    evaluated on the cluster in one SLURM job whose sbatch call (the plugin's --verbose log) is the
    README's line."""
    table, expected = readme_group_example()
    workdir = tmp_path / "work"
    (workdir / "config").mkdir(parents=True)
    (workdir / "config" / "runs.tsv").write_text(table + "\n")
    config = {
        "runs": "config/runs.tsv",
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "hidden_sizes": [16], "epochs": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"},
    }
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "train", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    proc, _ = run_snakemake(workdir, "--verbose", "--until", "evaluate")
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    calls = re.findall(r"^sbatch call: (sbatch .*)$", proc.stderr + proc.stdout, flags=re.MULTILINE)
    assert len(calls) == 1, calls  # gather, both merges and both evaluations: one job
    call = calls[0].split(" --wrap=")[0]
    call = re.sub(r"shardfuse_[0-9a-f-]{36}", "shardfuse_<uuid>", call).replace(str(workdir), "<workdir>")
    partition = subprocess.run(
        ["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=True
    ).stdout.split()
    default = next(name.rstrip("*") for name in partition if name.endswith("*"))
    assert " ".join(call.split()) == expected.replace("<partition>", default)
    assert sorted(p.parent.name for p in workdir.glob("results/runs/*/eval.json")) == ["ties", "uniform"]


# About 2,400 steps: 2-5 attempts of ~10 s (the more, the slower the machine); 400 epochs took 13 attempts
# and 400 s on a loaded CI machine without proving more than the second attempt does.
LONG_TRAINING = {"strategy": "ddp", "merge_method": "consolidate", "hidden_sizes": [512, 512], "epochs": 120}
STOP_BEFORE_LIMIT = 46  # of a 60 s limit: each attempt trains for about 10 s after its start-up


def release_requeued_jobs(pending_since: dict[str, float], settle: float = 5.0) -> None:
    """A requeued job waits about two minutes before it may start again (SLURM's BeginTime); on the test
    cluster let it start after ``settle`` seconds instead. Not at once: slurmd is still cleaning up the
    job's last attempt, and an attempt started then fails with "Job credential revoked"."""
    listing = subprocess.run(
        ["squeue", "-h", "-t", "PD", "-o", "%i %r"], capture_output=True, text=True, check=False
    ).stdout
    for job_id, reason in (line.split(maxsplit=1) for line in listing.splitlines() if line.strip()):
        if reason.strip() != "BeginTime":
            pending_since.pop(job_id, None)
            continue
        since = pending_since.setdefault(job_id, time.monotonic())
        if time.monotonic() - since >= settle:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
            pending_since.pop(job_id, None)


def test_a_training_longer_than_its_time_limit_is_requeued_and_loses_no_step(slurm_cluster, tmp_path):
    """runtime: 1 (minute) for a training of 10-25 s, the ranks stopping 46 s before the limit: each
    attempt trains about 10 s, stops at a step with its checkpoint and requeues its job (at least once);
    the next attempt resumes from that very step; the result equals an uninterrupted local run bitwise."""
    reference = tiny_experiment(tmp_path / "local", **LONG_TRAINING, checkpoint_every=0)
    proc, _ = run_snakemake(reference, "--cores", "2", "--until", "train", profile=False)
    assert proc.returncode == 0, snakemake_failure(reference, proc)

    workdir = tiny_experiment(tmp_path / "work", **LONG_TRAINING, checkpoint_every=0)
    profile = cluster_profile(tmp_path / "profile", **{"set-resources": {"train": {"runtime": 1}}})
    command = snakemake_command(workdir, "--profile", profile, *FAST_STATUS, "--until", "train")
    env = {**subprocess_env(), "SHARDFUSE_STOP_BEFORE_LIMIT": str(STOP_BEFORE_LIMIT)}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as run:
        deadline, pending_since = time.monotonic() + 900, {}
        while run.poll() is None and time.monotonic() < deadline:
            release_requeued_jobs(pending_since)
            time.sleep(1)
        run.kill()
        console, _ = run.communicate()
    assert run.returncode == 0, console[-4000:]
    (job_id,) = slurm_job_ids(workdir, "train")  # one job, requeued: Snakemake saw no failure
    (training,) = [p.name for p in (workdir / "results" / "trainings").iterdir()]
    attempts = sorted(  # by number: attempt-10 comes after attempt-9
        (workdir / "logs" / "train").glob(f"{training}.attempt-*.log"),
        key=lambda path: int(path.name.rsplit("-", 1)[1].split(".")[0]),
    )
    assert len(attempts) >= 2, [a.name for a in attempts]
    stops = []
    for attempt in attempts[:-1]:
        text = attempt.read_text()
        (step,) = re.findall(r"\] stopped after step (\d+) \(the SLURM job.s time limit is \d+ s away", text)
        assert f"launch: requeueing SLURM job {job_id}: it resumes from step {step}" in text
        stops.append(step)
    for attempt, step in zip(attempts[1:], stops, strict=True):
        assert f"resuming from checkpoint step {step} " in attempt.read_text(), attempt.name
    MEASUREMENTS.append(
        f"time-limit requeue: {len(attempts)} attempts of one SLURM job, stopped at steps {stops}"
    )
    ours = workdir / "results" / "trainings" / training / "ranks"
    theirs = reference / "results" / "trainings" / training / "ranks"
    for rank in (0, 1):
        mine, _ = load_weights(ours / f"rank-{rank}.safetensors")
        local, _ = load_weights(theirs / f"rank-{rank}.safetensors")
        assert mine.keys() == local.keys() and all(torch.equal(mine[k], local[k]) for k in mine), rank
