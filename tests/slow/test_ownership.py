"""Ownership under the kill cases that take a whole workflow each: kill -9 of snakemake alone (the
orphaned training stops, an immediate rerun resumes bitwise) and a published training that Snakemake
deleted before a rerun (restored, not retrained); and a `--keep-going` run whose two trainings fail, its
one-line errors the last thing on the console. The fast tier keeps the lock, the failed job's one-line
error and the kill of snakemake's whole process group (tests/workflow/)."""

from __future__ import annotations

import os
import signal
import subprocess

from tests.support.helpers import snakemake_command, snakemake_failure, subprocess_env
from tests.support.training import (
    assert_same_ranks,
    training_processes,
    wait_for_checkpoint,
    wait_for_staging,
    write_failing_model,
    write_resume_config,
)


def test_kill_9_of_snakemake_alone_leaves_no_orphan_and_an_immediate_rerun_resumes_bitwise(
    tmp_path, ddp_resume_reference
):
    # The race of issue 18: only snakemake is killed (not its process group), so the training would
    # run on as an orphan beside the rerun's training on the same checkpoints.
    workdir = tmp_path / "work"
    write_resume_config(workdir)
    command = snakemake_command(workdir, "--cores", "2", "--until", "gather")
    with subprocess.Popen(
        command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=subprocess_env()
    ) as sm:
        (staging,) = wait_for_staging(workdir)
        wait_for_checkpoint(staging)
        os.kill(sm.pid, signal.SIGKILL)  # snakemake only: launcher, torchrun and ranks see it go
        sm.wait(timeout=60)
    # The rerun starts at once, while the old training may still be shutting down.
    subprocess.run([*command, "--unlock"], check=True, capture_output=True, env=subprocess_env())
    rerun = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=600)
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    attempts = sorted((workdir / "logs" / "train").glob("*.attempt-*.log"))
    assert "snakemake (pid" in attempts[0].read_text()  # the orphan noticed and stopped
    assert "resuming from checkpoint step" in attempts[-1].read_text()
    (ranks,) = (workdir / "results" / "trainings").glob("*/ranks")
    assert_same_ranks(ddp_resume_reference, ranks)
    assert training_processes(str(staging)) == []  # nothing of either training runs on


def test_a_published_training_deleted_by_snakemake_is_restored_not_retrained(tmp_path):
    write_resume_config(tmp_path, epochs=2)
    command = snakemake_command(tmp_path, "--cores", "2", "--until", "gather")
    first = subprocess.run(command, capture_output=True, text=True, env=subprocess_env())
    assert first.returncode == 0, snakemake_failure(tmp_path, first)
    (ranks,) = (tmp_path / "results" / "trainings").glob("*/ranks")
    before = {p.name: p.read_bytes() for p in ranks.iterdir() if p.is_file()}
    # What --rerun-incomplete does to a training that finished after its workflow was killed.
    rerun = subprocess.run(
        [*command, "--forcerun", "train"], capture_output=True, text=True, env=subprocess_env()
    )
    assert rerun.returncode == 0, snakemake_failure(tmp_path, rerun)
    log = next(p for p in (tmp_path / "logs" / "train").glob("*.log") if ".attempt-" not in p.name)
    assert "restored from its published copy" in log.read_text()
    assert "shardfuse.agent" not in log.read_text()  # no rank started
    assert {p.name: p.read_bytes() for p in ranks.iterdir() if p.is_file()} == before


def test_failed_jobs_one_line_errors_are_the_last_thing_on_the_console(tmp_path):
    """Two trainings fail in one `--keep-going` run: one on a stage's own check (warmup longer than the
    run), one on a rank's exception (a user model whose forward raises on rank 1 in the first step).
    After Snakemake's own messages, each failed job's heading, then its one-line error; the rank's
    exception once, naming the rank and the log with its traceback."""
    write_failing_model(tmp_path / "models")
    runs = {
        "warm": {"strategy": "ddp", "merge_method": "consolidate", "warmup_steps": 100000},
        "flaky": {
            "strategy": "ddp", "merge_method": "consolidate", "model": "flaky:build", "code_paths": ["models"]
        },
    }  # fmt: skip
    write_resume_config(tmp_path, runs, epochs=1)
    proc = subprocess.run(
        snakemake_command(tmp_path, "--cores", "2", "--keep-going"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert proc.returncode == 1  # Snakemake's own status for a failed job, unchanged
    console = proc.stderr.strip().splitlines()
    headings = [
        i for i, line in enumerate(console) if line.startswith("shardfuse: train failed (logs/train/")
    ]
    assert len(headings) == 2, console[-30:]
    # After the blocks only Snakemake's closing lines (the log's path, the time, its own summary).
    tail = console[headings[0] :]
    closing = [line for line in tail if not line.startswith(("shardfuse: ", "  "))]
    assert all(
        line.startswith(("Complete log", "Elapsed time", "WorkflowError", "At least one job"))
        for line in closing
    ), tail
    blocks = {}
    for start in headings:
        log = console[start].removeprefix("shardfuse: train failed (").removesuffix("):")
        lines = console[start + 1 :]
        blocks[log] = lines[
            : next((i for i, line in enumerate(lines) if not line.startswith("  ")), len(lines))
        ]
    warm = [
        lines for lines in blocks.values()
        if any("shardfuse.train: error: warmup_steps 100000 is longer than the run's 40 optimiser steps"
               in line for line in lines)
    ]  # fmt: skip
    assert len(warm) == 1, blocks
    ((log, lines),) = [(log, lines) for log, lines in blocks.items() if lines is not warm[0]]
    # The rank's exception, once, first under its job's heading.
    expected = (
        f"  shardfuse.launch: error: rank 1 failed: RuntimeError: boom in forward (full traceback: {log}); "
        "no checkpoint was complete, so a re-run starts over"
    )
    assert [line for line in console if "boom in forward" in line] == [lines[0]] == [expected]
    assert 'raise RuntimeError("boom in forward")' in (tmp_path / log).read_text()
