"""Ownership under the kill cases that take a whole workflow each: kill -9 of snakemake alone (the
orphaned training stops, an immediate rerun resumes bitwise) and a published training that Snakemake
deleted before a rerun (restored, not retrained). The fast tier keeps the lock, the failed job's one-line
error and the kill of snakemake's whole process group (tests/workflow/)."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.support.helpers import snakemake_command, snakemake_failure, subprocess_env
from tests.support.training import (
    assert_same_ranks,
    training_processes,
    wait_for_checkpoint,
    wait_for_staging,
    write_resume_config,
)


def test_kill_9_of_snakemake_alone_leaves_no_orphan_and_an_immediate_rerun_resumes_bitwise(
    tmp_path, ddp_resume_reference
):
    # The race of issue 18: only snakemake is killed (not its process group), so the training would
    # run on as an orphan beside the rerun's training on the same checkpoints.
    workdir = tmp_path / "work"
    write_resume_config(workdir)
    command = snakemake_command(workdir, "--cores", "2", "--until", "gather")
    with subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env()
    ) as sm:
        (staging,) = wait_for_staging(workdir)
        wait_for_checkpoint(staging)
        os.kill(sm.pid, signal.SIGKILL)  # snakemake only: launcher, torchrun and ranks see it go
        sm.wait(timeout=60)
    # The rerun starts at once, while the old training may still be shutting down.
    subprocess.run([*command, "--unlock"], check=True, capture_output=True, env=subprocess_env())
    rerun = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    attempts = sorted((workdir / "logs" / "train").glob("*.attempt-*.log"))
    assert "snakemake (pid" in attempts[0].read_text()  # the orphan noticed and stopped
    assert "resuming from checkpoint step" in attempts[-1].read_text()
    (ranks,) = (workdir / "results" / "trainings").glob("*/ranks")
    assert_same_ranks(ddp_resume_reference, ranks)
    assert training_processes(str(staging)) == []  # nothing of either training runs on


def test_a_published_training_deleted_by_snakemake_is_restored_not_retrained(tmp_path):
    write_resume_config(tmp_path, epochs=2)
    command = snakemake_command(tmp_path, "--cores", "2", "--until", "gather")
    first = subprocess.run(command, capture_output=True, text=True, env=subprocess_env())
    assert first.returncode == 0, snakemake_failure(tmp_path, first)
    (ranks,) = (tmp_path / "results" / "trainings").glob("*/ranks")
    before = {p.name: p.read_bytes() for p in ranks.iterdir() if p.is_file()}
    # What --rerun-incomplete does to a training that finished after its workflow was killed.
    rerun = subprocess.run(
        [*command, "--forcerun", "train"], capture_output=True, text=True, env=subprocess_env()
    )
    assert rerun.returncode == 0, snakemake_failure(tmp_path, rerun)
    log = next(p for p in (tmp_path / "logs" / "train").glob("*.log") if ".attempt-" not in p.name)
    assert "restored from its published copy" in log.read_text()
    assert "torch.distributed.run" not in log.read_text()  # no rank started
    assert {p.name: p.read_bytes() for p in ranks.iterdir() if p.is_file()} == before
