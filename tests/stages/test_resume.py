"""Kills and restarts: a killed rank resumes from its newest checkpoint and ends bitwise identical (ddp on
digits; every other model and strategy in tests/slow/test_resume_matrix.py); an interrupted partition
leaves nothing that looks complete. (A non-finite loss stopping training: tests/slow/
test_training_edges.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pyarrow.parquet as pq

from shardfuse.metrics.system import INTERVAL_ENV, read_rows, system_metrics_path
from tests.support.helpers import run_stage, subprocess_env
from tests.support.training import (
    DDP_RESUME_CFG,
    assert_resumed_bitwise,
    kill_a_rank_and_resume,
    kill_when,
)


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


def test_interrupted_partition_leaves_nothing_that_looks_complete(tmp_path):
    import numpy as np
    import pyarrow as pa

    rows = 3_000_000
    source = tmp_path / "train.parquet"
    rng = np.random.default_rng(0)
    columns = {f"x{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(8)}
    pq.write_table(
        pa.table({**columns, "label": (np.arange(rows) % 10).astype(np.int64)}),
        source,
        row_group_size=100_000,
    )
    out = tmp_path / "shards"
    args = ["--input", source, "--world-size", 4, "--seed", 0, "--out-dir", out, "--batch-size", 50_000]
    with subprocess.Popen(
        [sys.executable, "-m", "shardfuse.partition", *map(str, args)],
        env=subprocess_env(),
        stderr=subprocess.DEVNULL,
    ) as proc:
        kill_when(proc, lambda: any(p.stat().st_size > 0 for p in tmp_path.glob(".shards.tmp-*/shard-*")))
    assert not out.exists()
    rerun = run_stage("partition", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["total_rows"] == rows
