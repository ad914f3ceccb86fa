"""Ranks started as fresh interpreters, as ``torchrun`` starts them (SHARDFUSE_RANK_START=spawn), against
the ranks forked from torchrun's agent (the default, shardfuse/cluster/agent.py): the same training
publishes the same bytes, step metrics and train.json rank records."""

from __future__ import annotations

import json
import os

from tests.support.helpers import run_stage
from tests.support.training import DDP_RESUME_CFG, assert_resumed_bitwise, launch_args


def test_ranks_started_as_fresh_interpreters_train_bitwise_as_the_forked_ones(
    tmp_path, monkeypatch, ddp_resume_reference, digits_dataset, digits_shards
):
    """ddp_resume_reference is trained by forked ranks (the default); the same training with every rank
    a fresh interpreter ends with the same rank files, step metrics and train.json rank records."""
    monkeypatch.setenv("SHARDFUSE_RANK_START", "spawn")
    out = tmp_path / "spawned"
    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, DDP_RESUME_CFG))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "-m shardfuse.agent" in proc.stderr  # the same command line; only the start differs
    assert_resumed_bitwise(ddp_resume_reference, out)
    ranks = json.loads((out / "train.json").read_text())["ranks"]
    assert len(ranks) == 2


# A rank that hangs while starting, from outside the training: each fresh rank interpreter runs this
# sitecustomize first; rank 1 of the first attempt waits forever before it could join the others.
HANG_ONCE = """
import os, pathlib, time
marker = pathlib.Path(os.environ["HANG_MARKER"])
if os.environ.get("RANK") == "1" and not marker.exists():
    marker.write_text("hung")
    while True:
        time.sleep(1)
"""


def test_a_rank_that_hangs_while_starting_is_started_again_once_and_the_training_ends_bitwise(
    tmp_path, monkeypatch, ddp_resume_reference, digits_dataset, digits_shards
):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(HANG_ONCE)
    monkeypatch.setenv("SHARDFUSE_RANK_START", "spawn")
    monkeypatch.setenv("SHARDFUSE_RANK_JOIN_TIMEOUT", "20")
    monkeypatch.setenv("HANG_MARKER", str(tmp_path / "hung"))
    monkeypatch.setenv("PYTHONPATH", f"{site}{os.pathsep}{os.environ.get('PYTHONPATH', '')}")
    out = tmp_path / "rejoined"
    proc = run_stage("launch", *launch_args(out, digits_dataset, digits_shards, DDP_RESUME_CFG), timeout=240)
    assert (tmp_path / "hung").read_text() == "hung"  # the fault happened
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "not every rank of 2 joined the process group within 20 s (SHARDFUSE_RANK_JOIN_TIMEOUT)" in (
        proc.stderr
    )
    assert "launch: a rank never joined the others (it hung while starting); starting the ranks again" in (
        proc.stderr
    )
    assert_resumed_bitwise(ddp_resume_reference, out)
