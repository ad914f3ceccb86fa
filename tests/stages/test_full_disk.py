"""A really full filesystem (a 256 KiB tmpfs, mounted for the test) under a checkpoint write and under a
stage's output: an OSError naming the file that was being written (never its temporary sibling), the
one-line message points at that file's own filesystem, and nothing is left behind. Needs root to mount;
CI runs as root (the test fails there rather than skip)."""

from __future__ import annotations

import errno
import os
import subprocess

import pytest
import torch

from shardfuse.checkpoints.weights import save_weights, write_safetensors
from shardfuse.console.errors import foreign_error
from shardfuse.io import atomic_path
from tests.support.helpers import missing_in_ci, run_stage, write_train_dir

SIZE = 256 * 1024


@pytest.fixture
def full_disk(tmp_path):
    """A tmpfs of SIZE bytes at tmp_path/disk (unmounted afterwards)."""
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        missing_in_ci("mounting a small tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={SIZE}", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode != 0:
        missing_in_ci(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", str(mount)], check=True)


def too_big() -> dict[str, torch.Tensor]:
    return {"model.w": torch.ones(SIZE // 2, dtype=torch.float32)}  # 4-byte floats: twice the disk


def test_a_checkpoint_write_on_a_full_disk_names_the_checkpoint_and_leaves_nothing(full_disk):
    step_dir = full_disk / "checkpoints" / "step-40"
    step_dir.mkdir(parents=True)
    target = step_dir / "rank-0.safetensors"
    # as rank/resume.save_rank_state writes it
    with pytest.raises(OSError) as raised, atomic_path(target) as tmp:
        write_safetensors(too_big(), tmp)
    assert raised.value.errno == errno.ENOSPC
    assert foreign_error(raised.value) == (
        f"cannot write {target} (No space left on device); free space on the filesystem of {step_dir} or "
        "point results at another filesystem"
    )
    assert list(step_dir.iterdir()) == []


def test_a_file_that_fits_only_partly_is_no_checkpoint(full_disk):
    """The write fails part way (the disk holds half of it): the same OSError, never a short file."""
    (full_disk / "filler").write_bytes(b"\0" * (SIZE - 64 * 1024))
    target = full_disk / "rank-1.safetensors"
    with pytest.raises(OSError) as raised:
        save_weights(target, {"w": torch.ones(32 * 1024)}, {"run": "r"})
    assert raised.value.errno in (errno.ENOSPC, errno.EIO), raised.value
    message = foreign_error(raised.value)
    assert message is not None and str(target) in message and ".tmp-" not in message, message
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]


def test_a_stage_writing_onto_a_full_disk_is_one_line_and_leaves_nothing(tmp_path, full_disk):
    """gather's output on a full disk, as a user's results directory would be: exit 2, one line naming
    the file and its filesystem, no gather.json and no temporary file."""
    ranks = write_train_dir(
        tmp_path / "ranks", {"net.0.weight": torch.zeros(3, 4), "net.0.bias": torch.zeros(3)}
    )
    (full_disk / "filler").write_bytes(b"\0" * SIZE)  # every block taken
    out = full_disk / "gather.json"
    proc = run_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", out)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"shardfuse.gather: error: cannot write {out} (No space left on device); free space on the "
        f"filesystem of {full_disk} or point results at another filesystem"
    )
    assert sorted(p.name for p in full_disk.iterdir()) == ["filler"]
