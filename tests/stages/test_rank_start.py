"""The ranks forked from torchrun's agent (shardfuse/cluster/agent.py): a rank's failure is reported as
for fresh interpreters; a bad SHARDFUSE_RANK_START is one line. That forked and fresh ranks train the
same bytes: tests/slow/test_rank_start.py (a rank killed by a signal named in the log: the kill tests,
tests/support/training.py)."""

from __future__ import annotations

from tests.support.helpers import run_stage
from tests.support.training import DDP_RESUME_CFG, launch_args


def test_a_rank_that_fails_in_a_fork_fails_the_launch_with_its_one_line_error(
    tmp_path, digits_dataset, digits_shards
):
    """A rank's own check (warmup longer than the run) ends it with status 2 and its one line, and the
    launcher names the failed training, as with fresh interpreters; nothing is published."""
    out = tmp_path / "failed"
    cfg = {**DDP_RESUME_CFG, "warmup_steps": 10_000}
    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, cfg))
    assert proc.returncode != 0
    assert "shardfuse.train: error: warmup_steps 10000 is longer than the run's" in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("shardfuse.launch: error: ")
    assert not out.exists()


def test_an_unknown_rank_start_is_one_line_before_any_file(
    tmp_path, monkeypatch, digits_dataset, digits_shards
):
    monkeypatch.setenv("SHARDFUSE_RANK_START", "thread")
    out = tmp_path / "never"
    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, DDP_RESUME_CFG))
    assert proc.returncode == 2
    assert proc.stderr == (
        "shardfuse.launch: error: SHARDFUSE_RANK_START='thread' is not one of fork, spawn; unset it "
        "or pick one\n"
    )
    assert not out.exists() and not list(tmp_path.glob(".never*"))
