"""A merge killed while it writes 400 MB rank files' mean leaves nothing that looks complete, and the rerun
finishes (the fast tier interrupts the partition stage the same way, tests/stages/test_resume.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch

from tests.support.helpers import run_stage, subprocess_env, write_train_dir
from tests.support.training import kill_when


def test_interrupted_merge_leaves_nothing_that_looks_complete(tmp_path):
    big = {f"w{i}": torch.randn(4096, 4096) for i in range(6)}  # ~400 MB per rank: the merge takes a while
    ranks = write_train_dir(tmp_path / "ranks", big, 2, lambda rank: {k: v + rank for k, v in big.items()})
    gathered = run_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", tmp_path / "gather.json")
    assert gathered.returncode == 0, gathered.stderr
    out_weights, out_json = tmp_path / "run" / "merged.safetensors", tmp_path / "run" / "merge.json"
    args = [
        "--gather",
        tmp_path / "gather.json",
        "--method",
        "uniform",
        "--out-weights",
        out_weights,
        "--out-json",
        out_json,
    ]
    with subprocess.Popen(
        [sys.executable, "-m", "shardfuse.merge", *map(str, args)],
        env=subprocess_env(),
        stderr=subprocess.DEVNULL,
    ) as proc:
        kill_when(proc, lambda: any(p.stat().st_size > 0 for p in out_weights.parent.glob(".merged*tmp*")))
    assert not out_weights.exists() and not out_json.exists()
    rerun = run_stage("merge", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(out_json.read_text())["sha256"]
