"""An interrupted partition leaves nothing that looks complete. (A killed rank resuming bitwise: tests/slow/
test_resume_killed_rank.py and test_resume_matrix.py; a non-finite loss stopping training: tests/slow/
test_training_edges.py.)"""

from __future__ import annotations

import json
import subprocess
import sys

import pyarrow.parquet as pq

from tests.support.helpers import run_stage, subprocess_env
from tests.support.training import kill_when


def test_interrupted_partition_leaves_nothing_that_looks_complete(tmp_path):
    import numpy as np
    import pyarrow as pa

    rows = 1_500_000  # 30 batches: the kill lands after the first is written, long before the last
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
