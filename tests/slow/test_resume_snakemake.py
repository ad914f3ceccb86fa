"""Snakemake killed mid-training (kill -9 of its whole process group): the rerun resumes bitwise.

The workflow runs until gather (the training is what the kill interrupts); the uninterrupted reference
is the session's ddp training (tests/conftest.py), the same one the fast torchrun kill test reads.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time

from shardfuse.rank.checkpoint_steps import complete_steps
from tests.support.helpers import snakemake_command, snakemake_failure, subprocess_env
from tests.support.training import (
    assert_same_ranks,
    wait_for_checkpoint,
    wait_for_staging,
    write_resume_config,
)


def test_killed_snakemake_resumes_from_checkpoint_on_rerun(tmp_path, ddp_resume_reference):
    workdir = tmp_path / "work"
    write_resume_config(workdir)
    command = snakemake_command(workdir, "--cores", "2", "--until", "gather")
    # snakemake, the launcher, torchrun and the ranks
    signal_mid_training(workdir, command, signal.SIGKILL, timeout=60)
    time.sleep(1)
    assert not list((workdir / "results" / "trainings").glob("*/ranks"))
    subprocess.run([*command, "--unlock"], check=True, capture_output=True, env=subprocess_env())
    rerun = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = [log for log in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in log.name]
    assert "resuming from checkpoint step" in log.read_text()
    # The killed attempt's log is kept beside it (Snakemake deleted the declared log before the rerun).
    killed = log.with_suffix(".attempt-1.log").read_text()
    assert "launch: " in killed and "resuming from checkpoint step" not in killed
    (ranks,) = (workdir / "results" / "trainings").glob("*/ranks")
    assert_same_ranks(ddp_resume_reference, ranks)
    assert not (ranks / "checkpoints").exists()
    assert (workdir / "results" / "trainings" / ranks.parent.name / "gather.json").is_file()


def test_ctrl_c_to_snakemake_checkpoints_the_step_it_stops_at_and_the_rerun_loses_none(
    tmp_path, ddp_resume_reference
):
    """Ctrl-C is SIGINT to the terminal's foreground process group (snakemake, its job's shell and the
    launcher, which passes it to the ranks' group): the ranks stop at a step with its checkpoint."""
    workdir = tmp_path / "work"
    write_resume_config(workdir)
    command = snakemake_command(workdir, "--cores", "2", "--until", "gather")
    snakemake, staging, console = signal_mid_training(workdir, command, signal.SIGINT, timeout=180)
    assert snakemake.returncode != 0
    stopped = json.loads((staging / "STOPPED.json").read_text())
    assert complete_steps(staging / "checkpoints")[-1] == stopped["step"]
    assert f"training stopped after step {stopped['step']} (SIGINT) with a complete checkpoint" in console
    assert not list((workdir / "results" / "trainings").glob("*/ranks"))

    rerun = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = [log for log in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in log.name]
    assert f"resuming from checkpoint step {stopped['step']} " in log.read_text()
    (ranks,) = (workdir / "results" / "trainings").glob("*/ranks")
    assert_same_ranks(ddp_resume_reference, ranks)


def signal_mid_training(workdir, command: list, sig: int, timeout: float):
    """Start ``command`` (snakemake) in a session of its own, send ``sig`` to its whole process group
    once the training has a complete checkpoint; (the finished process, the staging dir, its console)."""
    with subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
        start_new_session=True,
    ) as snakemake:
        staging = next(iter(wait_for_staging(workdir)))
        wait_for_checkpoint(staging)
        os.killpg(snakemake.pid, sig)
        console, _ = snakemake.communicate(timeout=timeout)
    return snakemake, staging, console
