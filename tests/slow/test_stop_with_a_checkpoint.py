"""Ctrl-C or SIGTERM stops a training at a step boundary with a checkpoint of that step, losing no step
(shardfuse.rank.stop): the launcher says so in one line and exits 75, and the re-run resumes from that
step and ends bitwise identical to the uninterrupted training. (The SLURM time limit takes the same path:
tests/services/test_slurm_jobs.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys

import pytest

from shardfuse.launch import staging_dir
from shardfuse.rank.checkpoint_steps import complete_steps
from tests.support.helpers import run_stage, subprocess_env
from tests.support.training import (
    DDP_RESUME_CFG,
    assert_resumed_bitwise,
    launch_args,
)

CFG = DDP_RESUME_CFG  # the uninterrupted reference's (tests/conftest.py ddp_resume_reference)


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["ctrl-c", "sigterm"])
def test_a_signal_stops_at_a_step_with_its_checkpoint_and_the_rerun_ends_bitwise_identical(
    tmp_path, ddp_resume_reference, digits_dataset, digits_shards, sig
):
    out = tmp_path / "out"
    staging = staging_dir(out)
    args = [
        sys.executable,
        "-m",
        "shardfuse.launch",
        *map(str, launch_args(out, digits_dataset, digits_shards, CFG)),
    ]
    # Ctrl-C reaches the terminal's whole foreground process group: the launcher in its own group here.
    with subprocess.Popen(
        args, stderr=subprocess.PIPE, text=True, env=subprocess_env(), start_new_session=True
    ) as launcher:
        metrics = staging / "metrics"
        wait_for_rows(metrics, launcher)
        os.killpg(launcher.pid, sig)
        _, stderr = launcher.communicate(timeout=120)
    assert launcher.returncode == 75, stderr[-3000:]
    stopped = json.loads((staging / "STOPPED.json").read_text())
    (line,) = [line for line in stderr.splitlines() if line.startswith("shardfuse.launch: error:")]
    assert line == (
        f"shardfuse.launch: error: training stopped after step {stopped['step']} ({sig.name}) with a "
        f"complete checkpoint of that step; a re-run resumes from step {stopped['step']}, losing no step"
    )
    assert complete_steps(staging / "checkpoints")[-1] == stopped["step"]
    assert not out.exists()

    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, CFG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"resuming from checkpoint step {stopped['step']} " in proc.stderr
    assert_resumed_bitwise(ddp_resume_reference, out)


def wait_for_rows(metrics, launcher, timeout: float = 120) -> None:
    """Until the ranks are in their training loop (a step's metrics record is on disk)."""
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert launcher.poll() is None, "the training ended before it was stopped"
        if any(p.stat().st_size > 0 for p in metrics.glob("rank-*.f64")) if metrics.exists() else False:
            return
        time.sleep(0.05)
    raise AssertionError("no step recorded")
