"""One owner per training: the lock and its record, and a failed job's one-line error on the console (a
stage's own, or a rank's exception). The kill -9 races of whole workflows: tests/slow/test_ownership.py."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import yaml

from shardfuse.cluster.ownership import own_training, owner_path
from shardfuse.io import UserError, failed_job_errors
from tests.support.helpers import REPO, snakemake_command, subprocess_env
from tests.support.training import write_failing_model, write_resume_config

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
        "launch: python -m torch.distributed.run ...\n"
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


def test_a_failed_stages_one_line_error_is_the_last_thing_on_the_console(tmp_path):
    write_resume_config(tmp_path, epochs=1, warmup_steps=100000)
    proc = subprocess.run(
        snakemake_command(tmp_path, "--cores", "2"), capture_output=True, text=True, env=subprocess_env()
    )
    assert proc.returncode == 1  # Snakemake's own status for a failed job, unchanged
    tail = proc.stderr.strip().splitlines()[-8:]
    assert any(line.startswith("shardfuse: train failed (logs/train/") for line in tail), tail
    assert any(
        "shardfuse.train: error: warmup_steps 100000 is longer than the run's 40 optimiser steps" in line
        for line in tail
    ), tail


def test_a_ranks_exception_is_one_line_on_the_console_naming_the_rank_and_the_log(tmp_path):
    write_failing_model(tmp_path / "models")  # rank 1's forward raises in the first step
    write_resume_config(tmp_path, epochs=1, model="flaky:build", code_paths=["models"])
    proc = subprocess.run(
        snakemake_command(tmp_path, "--cores", "2"), capture_output=True, text=True, env=subprocess_env()
    )
    assert proc.returncode == 1
    console = proc.stderr.strip().splitlines()
    (failed,) = [line for line in console if line.startswith("shardfuse: train failed (logs/train/")]
    log = failed.removeprefix("shardfuse: train failed (").removesuffix("):")
    # After Snakemake's own messages, under the job's heading: the rank's exception, once on the console.
    errors = [line for line in console if "boom in forward" in line]
    assert errors == [
        f"  shardfuse.launch: error: rank 1 failed: RuntimeError: boom in forward (full traceback: {log}); "
        "no checkpoint was complete, so a re-run starts over"
    ]
    assert console.index(errors[0]) == console.index(failed) + 1
    assert 'raise RuntimeError("boom in forward")' in (tmp_path / log).read_text()


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
