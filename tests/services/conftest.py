"""Fixtures of the service tier: the single-node SLURM cluster that .ci/run starts."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.helpers import slurm_state_dir


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
