"""The launch stage's command line: every attempt logged, the earlier ones named; a failed rank's
exception in one line."""

from __future__ import annotations

import json

from shardfuse.io import stage_errors
from shardfuse.launch import staging_dir
from tests.support.helpers import run_stage
from tests.support.training import FAIL_AT_FORWARD_ENV, SMALL_TRAIN_CFG, write_failing_model


def test_launch_logs_every_attempt_and_names_the_earlier_ones(tmp_path):
    log = tmp_path / "train.log"
    for number in (1, 2):
        log.unlink(missing_ok=True)
        proc = run_stage("launch", "--nproc-per-node", "1", "--max-restarts", "-1", "--log", log)
        # By hand the console still shows the one line, and where the whole output is.
        assert proc.returncode == 2 and proc.stderr == (
            "shardfuse.launch: error: --max-restarts -1 must be >= 0 (the whole output: "
            f"{tmp_path / f'train.attempt-{number}.log'})\n"
        )
    first = (tmp_path / "train.attempt-1.log").read_text()
    assert "--max-restarts -1 must be >= 0" in first and "attempt" not in first
    second = log.read_text()
    assert "attempt 2; earlier attempts' logs: train.attempt-1.log" in second
    assert second == (tmp_path / "train.attempt-2.log").read_text()


def test_a_rank_that_raises_after_a_checkpoint_is_one_line_and_a_rerun_resumes_from_it(
    tmp_path, monkeypatch, digits_dataset, digits_shards
):
    """Real torchrun ranks: rank 1's model raises in step 6, rank 0 then fails on the broken connection;
    the line names rank 1. (No checkpoint yet, seen on the console: tests/workflow/test_ownership.py.)"""
    user_model = write_failing_model(tmp_path / "models")
    cfg = {**SMALL_TRAIN_CFG, "strategy": "ddp", "sync_every": 0, "checkpoint_every": 2, **user_model}
    out, log = tmp_path / "t" / "ranks", tmp_path / "logs" / "t.log"
    monkeypatch.setenv(FAIL_AT_FORWARD_ENV, "6")
    proc = run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", out, "--log", log, "--", "--run-name", "t",
        "--shard-dir", digits_shards, "--dataset-dir", digits_dataset, "--config-json", json.dumps(cfg),
    )  # fmt: skip
    assert proc.returncode == 2
    text = log.read_text()
    assert 'raise RuntimeError("boom in forward")' in text and "Connection closed by peer" in text
    # ddp keeps the ranks in step: rank 0 marked step 4's checkpoint complete before rank 1 reached step 6.
    checkpoints = staging_dir(out) / "checkpoints"
    # The launcher's one-line errors, as the workflow's console shows them (the Snakefile's onerror).
    assert stage_errors(log) == [
        f"shardfuse.launch: error: rank 1 failed: RuntimeError: boom in forward (full traceback: {log}); "
        f"a re-run with unchanged config and code resumes from the checkpoint of step 4 in {checkpoints}"
    ]
    # With --log everything goes to the log; the console gets the one line and where the log is.
    assert proc.stderr == f"{stage_errors(log)[0]} (the whole output: {log.with_name('t.attempt-1.log')})\n"
    assert not out.exists()
