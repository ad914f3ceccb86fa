"""The benchmarks run end to end at smoke size and write their report (timings are not checked here)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import REPO, missing_in_ci, subprocess_env

pytestmark = pytest.mark.bench

SECTIONS = (
    "## Machine",
    "## Targets",
    "## 1. Partition at scale",
    "## 2. Shard reader",
    "## 3. Scaling on this machine",
    "## 4. Pipeline overhead",
    "## 5. Metric logging during training",
    "## 6. GPU",
)


def test_run_all_smoke_writes_every_benchmark_table(tmp_path):
    out = tmp_path / "RESULTS.md"
    proc = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "run_all.py"),
            "--smoke",
            "--out",
            str(out),
            "--work-dir",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    text = out.read_text()
    for heading in SECTIONS:
        assert heading in text, heading
    assert "crashed" not in text
    for fragment in (
        "| partition MB/s",
        "| time to first batch s",
        "| samples/s W=1",
        "| whole DAG, wall",
        "| metrics + live |",
    ):
        assert fragment in text, fragment
    assert sorted(p.name for p in tmp_path.iterdir()) == ["RESULTS.md"]  # work files cleaned up


def test_fsdp_bench_quick_measures_every_shard_count_and_meets_its_memory_target():
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "fsdp.py"), "--quick"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "PASS" in line]
    assert [row.split("|")[1].strip() for row in rows] == ["2"], proc.stdout
    assert "| 1 (DDP) |" in proc.stdout


def test_peers_bench_quick_measures_both_peers():
    """The merge against mergekit (CI makes its venv: a missing one fails here rather than skip) and the
    training against the bare loop, at tiny sizes."""
    proc = subprocess.run(
        [sys.executable, str(REPO / "bench" / "peers.py"), "--quick"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    out = proc.stdout
    for model in ("mlp", "cnn", "transformer"):
        assert f"| {model} |" in out, out[-3000:]
    if "merge vs mergekit-pytorch: skipped" in out:
        missing_in_ci("mergekit is not installed (.ci/run makes /tmp/shardfuse-mergekit): " + out[:300])
    assert "| 2 x 8 | uniform |" in out and "| 2 x 8 | ties |" in out, out[-3000:]
