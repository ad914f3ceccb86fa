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


def prepare_and_partition(out_root: Path, name: str, spec: str, world_size: int = 2) -> tuple[Path, Path]:
    """(dataset dir, shard dir) made by the prepare and partition stages."""
    dataset, shards = out_root / name, out_root / f"{name}-shards" / f"w{world_size}-seed0"
    for stage, *args in (
        ("prepare", "--name", name, "--spec-json", spec, "--out-dir", dataset),
        (
            "partition",
            "--input",
            dataset / "train.parquet",
            "--world-size",
            world_size,
            "--seed",
            0,
            "--out-dir",
            shards,
        ),
    ):
        command = [sys.executable, "-m", f"shardfuse.{stage}", *map(str, args)]
        subprocess.run(command, check=True, env=subprocess_env(), capture_output=True)
    return dataset, shards


@pytest.fixture(scope="session")
def diabetes_data(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's diabetes data (regression, 10 features, one float target), prepared and in 2 shards."""
    return prepare_and_partition(tmp_path_factory.mktemp("datasets"), "diabetes", '{"source": "diabetes"}')


@pytest.fixture(scope="session")
def digits_images_data(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's digits as 1x8x8 images (a tensor column), prepared and in 2 shards."""
    spec = '{"source": "digits_images"}'
    return prepare_and_partition(tmp_path_factory.mktemp("datasets"), "digits_images", spec)


@pytest.fixture(scope="session")
def stdlib_tokens_data(tmp_path_factory) -> tuple[Path, Path]:
    """The Python standard library's json package as byte tokens in blocks of 33, in 2 shards."""
    spec = '{"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 32, "max_tokens": 40000}'
    return prepare_and_partition(tmp_path_factory.mktemp("datasets"), "stdlib", spec)


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
