"""mergekit 0.1.5's merge functions as the second reference for the merge methods (bench/mergekit_check.py).

mergekit pulls transformers and friends, so it lives in its own virtual environment, named by
$SHARDFUSE_MERGEKIT_PYTHON (.ci/run makes one with `pip install mergekit==0.1.5` under the torch pin). The
script exits non-zero when any matched method is beyond half a float32 ulp of mergekit's float64 result,
so this test fails then. In CI a missing environment fails; elsewhere the test is skipped.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.support.helpers import subprocess_env
from tests.support.tracking import service_unavailable

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]


def test_every_matched_merge_method_is_within_half_an_ulp_of_mergekit():
    python = os.environ.get("SHARDFUSE_MERGEKIT_PYTHON", "/tmp/mkvenv/bin/python")
    probe = (
        subprocess.run([python, "-c", "import mergekit"], capture_output=True, text=True)
        if (os.access(python, os.X_OK))
        else None
    )
    if probe is None or probe.returncode != 0:
        service_unavailable(
            f"no python with mergekit at {python}: python3 -m venv V && V/bin/pip install torch==2.13.0 "
            "mergekit==0.1.5, then set SHARDFUSE_MERGEKIT_PYTHON=V/bin/python"
        )
    proc = subprocess.run(
        [python, str(REPO / "bench" / "mergekit_check.py")],
        capture_output=True, text=True, timeout=600, env=subprocess_env(), cwd=REPO,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert "PASS: every matched method within 0.5 float32 ulp of mergekit" in proc.stdout
    for method in (
        "uniform",
        "ties",
        "dare",
        "della",
        "breadcrumbs",
        "sce",
        "nuslerp",
        "multislerp",
        "karcher",
    ):
        assert f"| {method} |" in proc.stdout, method
