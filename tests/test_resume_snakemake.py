"""Snakemake killed mid-training (kill -9 of its whole process group): the rerun resumes bitwise.

Its own file so that pytest-xdist (one file per worker at a time) runs it beside the other resume
tests; the helpers are tests/test_resume.py's.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import run_stage, snakemake_command, snakemake_failure, subprocess_env
from tests.test_resume import TRAIN_CFG, assert_same_ranks, launch_args, wait_for_checkpoint

pytestmark = pytest.mark.integration


def test_killed_snakemake_resumes_from_checkpoint_on_rerun(tmp_path, digits_dataset, digits_shards):
    reference = tmp_path / "reference"
    # The workflow adds decay_rule to every AdamW run with weight decay (config/README.md).
    cfg = {**TRAIN_CFG, "strategy": "ddp", "sync_every": 0, "decay_rule": "ndim>=2"}
    proc = run_stage("launch", *launch_args(reference, digits_dataset, digits_shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]

    workdir = tmp_path / "work"
    (workdir / "config").mkdir(parents=True)
    (workdir / "config" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "runs": {"r": {"strategy": "ddp", "merge_method": "consolidate"}},
                "datasets": {"digits": {"source": "digits"}},
                "run_defaults": {k: v for k, v in TRAIN_CFG.items()},
                "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"},
            }
        )
    )
    command = snakemake_command(workdir, "--cores", "2")
    with subprocess.Popen(
        command,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
        start_new_session=True,
    ) as snakemake:
        staging = next(iter(wait_for_staging(workdir)))
        wait_for_checkpoint(staging)
        os.killpg(snakemake.pid, signal.SIGKILL)  # snakemake, the launcher, torchrun and the ranks
        snakemake.wait(timeout=60)
    time.sleep(1)
    assert not list((workdir / "results" / "trainings").glob("*/ranks"))
    subprocess.run([*command, "--unlock"], check=True, capture_output=True, env=subprocess_env())
    rerun = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = [log for log in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in log.name]
    assert "resuming from checkpoint step" in log.read_text()
    # The killed attempt's log is kept beside it (Snakemake deleted the declared log before the rerun).
    killed = log.with_suffix(".attempt-1.log").read_text()
    assert "launch: " in killed and "resuming from checkpoint step" not in killed
    (ranks,) = (workdir / "results" / "trainings").glob("*/ranks")
    assert_same_ranks(reference, ranks)
    assert not (ranks / "checkpoints").exists()


def wait_for_staging(workdir: Path, timeout: float = 120) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list((workdir / "results" / "trainings").glob("*/.ranks.partial"))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("training never started")
