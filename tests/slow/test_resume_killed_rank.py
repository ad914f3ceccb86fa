"""A killed rank is restarted by torchrun and resumes from its newest checkpoint, ending bitwise identical
to the uninterrupted training (ddp on digits; every other model and strategy: test_resume_matrix.py), its
system metrics keeping the samples of both attempts."""

from __future__ import annotations

import numpy as np

from shardfuse.metrics.system import INTERVAL_ENV, read_rows, system_metrics_path
from tests.support.training import DDP_RESUME_CFG, assert_resumed_bitwise, kill_a_rank_and_resume


def test_killed_rank_is_restarted_by_torchrun_and_resumes_bitwise_identical(
    tmp_path, monkeypatch, ddp_resume_reference, digits_dataset, digits_shards
):
    # One kill point here (ddp on digits); every other model, task and strategy in tests/slow.
    # The same launch shows that each rank's system metrics keep the samples of both attempts.
    monkeypatch.setenv(INTERVAL_ENV, "0.05")
    killed = tmp_path / "killed"
    killed_ms = kill_a_rank_and_resume(killed, digits_dataset, digits_shards, DDP_RESUME_CFG)
    assert_resumed_bitwise(ddp_resume_reference, killed)
    for rank in (0, 1):
        stamps = read_rows(system_metrics_path(killed / "metrics", rank))[:, 0]
        assert np.sum(stamps < killed_ms) >= 1 and np.sum(stamps > killed_ms) >= 2, rank
