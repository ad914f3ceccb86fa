"""One owner per training: the lock and its record, and a failed job's one-line error (a stage's own, or a
rank's exception). The kill -9 races of whole workflows and the console of a run whose trainings fail:
tests/slow/test_ownership.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from shardfuse.cluster.ownership import own_training, owner_path
from shardfuse.console.failures import failed_job_errors
from shardfuse.io import UserError
from tests.support.helpers import REPO, subprocess_env

HOLD_LOCK = """
import sys, time
from pathlib import Path
from shardfuse.cluster.ownership import own_training
with own_training(Path(sys.argv[1]), wait_seconds=0):
    print("owned", flush=True)
    time.sleep(60)
"""


def test_a_second_owner_waits_then_refuses_naming_the_first_and_how_to_stop_it(tmp_path):
    out = tmp_path / "trainings" / "t" / "ranks"
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLD_LOCK, str(out)], stdout=subprocess.PIPE, text=True, env=subprocess_env()
    )
    try:
        assert holder.stdout.readline().strip() == "owned"
        started = time.monotonic()
        with pytest.raises(UserError) as refused, own_training(out, wait_seconds=1.0):
            pass
        assert time.monotonic() - started >= 1.0  # it waited for the owner first
        message = str(refused.value)
        assert f"training t is already running: pid {holder.pid} on " in message
        assert f"stop it with `kill {holder.pid}`" in message
        assert "\n" not in message
    finally:
        holder.kill()
        holder.wait()
    # The owner died (its lock went with it): its record is taken over at once.
    with own_training(out, wait_seconds=0) as record:
        assert record["pid"] == os.getpid()
        assert yaml.safe_load(owner_path(out).read_text())["pid"] == os.getpid()
    assert not owner_path(out).exists()  # the record goes with its owner


def test_failed_job_errors_name_the_rule_the_log_and_the_one_line_error(tmp_path):
    job_log = tmp_path / "logs" / "train" / "t.log"
    job_log.parent.mkdir(parents=True)
    job_log.write_text(
        "launch: python -m shardfuse.agent ...\n"
        "[rank1]: shardfuse.train: error: warmup_steps 9 is longer than the run's 4 optimiser steps\n"
        "shardfuse.train: error: warmup_steps 9 is longer than the run's 4 optimiser steps\n"
        "Traceback (most recent call last):\n"
        "shardfuse.launch: error: training failed: exit status 1\n"
    )
    snakemake_log = tmp_path / "snakemake.log"
    snakemake_log.write_text(
        "[Tue Dec  1 05:02:52 2026]\nError in rule train:\n    message: None\n    jobid: 5\n"
        "    output: results/trainings/t/ranks\n"
        "    log: logs/train/t.log (check log file(s) for error details)\n"
        "Error in rule merge:\n    jobid: 7\n"
        "    log: logs/merge/r.log (check log file(s) for error details)\n"
    )
    assert failed_job_errors(snakemake_log, tmp_path) == [
        "shardfuse: train failed (logs/train/t.log):",
        "  shardfuse.train: error: warmup_steps 9 is longer than the run's 4 optimiser steps",
        "  shardfuse.launch: error: training failed: exit status 1",
        "shardfuse: merge failed; no one-line error in logs/merge/r.log: read it for the cause",
    ]


def test_the_readme_names_the_recovery_of_every_kill_case():
    readme = (REPO / "README.md").read_text()
    for piece in (
        "IncompleteFilesException",
        "--cleanup-metadata",
        "--rerun-incomplete",
        "scancel",
        "--unlock",
    ):
        assert piece in readme, piece
