"""Shared fixtures: a tiny real dataset and shard set, made with the project's own stages.

Helpers and constants live in tests/helpers.py.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import MEASUREMENTS, slurm_state_dir, subprocess_env


def pytest_terminal_summary(terminalreporter) -> None:
    if MEASUREMENTS:
        terminalreporter.section("measurements")
        for line in MEASUREMENTS:
            terminalreporter.write_line(line)


@pytest.fixture(scope="session")
def digits_dataset(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("datasets") / "digits"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardfuse.prepare",
            "--name",
            "digits",
            "--spec-json",
            '{"source": "digits", "test_fraction": 0.2, "seed": 0}',
            "--out-dir",
            str(out),
        ],
        check=True,
        env=subprocess_env(),
    )
    return out


@pytest.fixture(scope="session")
def digits_shards(digits_dataset, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("shards") / "w2-seed0"
    subprocess.run(
        [
            sys.executable,
            "-m",
            "shardfuse.partition",
            "--input",
            str(digits_dataset / "train.parquet"),
            "--world-size",
            "2",
            "--seed",
            "0",
            "--out-dir",
            str(out),
        ],
        check=True,
        env=subprocess_env(),
    )
    return out


@pytest.fixture(scope="session")
def slurm_cluster() -> Path:
    """The single-node cluster of scripts/slurm-up.sh. CI must have it: there a missing cluster fails."""
    try:
        sinfo = ["sinfo", "-h", "-o", "%T"]
        states = subprocess.run(sinfo, capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        states = ""
    if not any(state.strip().rstrip("*") in {"idle", "mixed", "allocated"} for state in states.splitlines()):
        message = "no SLURM cluster answers sinfo; start one with `bash scripts/slurm-up.sh` (as root)"
        if os.environ.get("CI"):
            pytest.fail(message)
        pytest.skip(message)
    return slurm_state_dir()
