"""Resume passes over an unreadable newest checkpoint (a full disk's truncated file) to the previous complete
one, says so in one line, and ends bitwise identical to the uninterrupted training. (The fast tier keeps the
checkpoint choice in-process: tests/unit/rank/test_resume_choice.py.)"""

from __future__ import annotations

import signal
import subprocess
import sys

from shardfuse.launch import staging_dir
from shardfuse.rank.checkpoint_steps import complete_steps
from tests.support.helpers import run_stage, subprocess_env
from tests.support.training import (
    DDP_RESUME_CFG,
    assert_resumed_bitwise,
    launch_args,
    wait_for_checkpoint,
)


def test_resume_passes_over_a_truncated_newest_checkpoint_and_ends_bitwise_identical(
    tmp_path, ddp_resume_reference, digits_dataset, digits_shards
):
    # Two complete checkpoints (keep_checkpoints 2), the launch stopped, the newest one's rank-1 file
    # truncated as a full disk leaves it: the re-run resumes from the older one, says so in one line, and
    # ends as the uninterrupted training does.
    out = tmp_path / "out"
    checkpoints = staging_dir(out) / "checkpoints"
    args = [
        sys.executable,
        "-m",
        "shardfuse.launch",
        *map(str, launch_args(out, digits_dataset, digits_shards, DDP_RESUME_CFG)),
    ]
    with subprocess.Popen(args, stderr=subprocess.PIPE, text=True, env=subprocess_env()) as launcher:
        wait_for_checkpoint(staging_dir(out), count=2)
        launcher.send_signal(signal.SIGTERM)  # the launcher stops its ranks' whole group
        launcher.communicate(timeout=120)
    *_, older, newest = complete_steps(checkpoints)
    broken = checkpoints / f"step-{newest}" / "rank-1.safetensors"
    broken.write_bytes(broken.read_bytes()[:1000])
    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, DDP_RESUME_CFG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    (warning,) = [line for line in proc.stderr.splitlines() if "warning: checkpoint step" in line]
    assert warning.startswith(
        f"shardfuse.train: warning: checkpoint step {newest} cannot be read: {broken} ("
    )
    assert warning.endswith(f"; resuming from step {older} instead")
    assert f"resuming from checkpoint step {older} " in proc.stderr
    assert_resumed_bitwise(ddp_resume_reference, out)
