"""Ranks started as fresh interpreters, as ``torchrun`` starts them (SHARDFUSE_RANK_START=spawn), against
the ranks forked from torchrun's agent (the default, shardfuse/cluster/agent.py): the same training
publishes the same bytes, step metrics and train.json rank records."""

from __future__ import annotations

import json

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
