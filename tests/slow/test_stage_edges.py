"""Edge paths of single stages that each pay a chain of processes or a wait of seconds, moved out of the
fast tier (which keeps every other error of these stages): a rank that raises after a checkpoint is one
line naming it and the checkpoint a re-run resumes from (tests/stages/test_launch_cli.py keeps the launch
stage's own errors); an adapter that fits no module, refused by the ranks' own check when the train stage
is run by hand (tests/unit/experiment/test_adapter_config.py: the config check before any job); a
tracking store another program holds locked (tests/stages/test_track_cli.py: the track stage's other
errors)."""

from __future__ import annotations

import json
import subprocess
import time

from shardfuse.console.failures import stage_errors
from shardfuse.launch import staging_dir
from tests.support.helpers import run_stage
from tests.support.tracking import active_runs, make_run_dir, track_cli_args, tracking_env
from tests.support.training import (
    FAIL_AT_FORWARD_ENV,
    LORA_CFG,
    SMALL_TRAIN_CFG,
    launch_args,
    write_failing_model,
)


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


def test_an_adapter_that_fits_no_module_is_one_line_from_the_train_stage_too(
    tmp_path, digits_dataset, digits_shards
):
    """By hand (no config check before it): the ranks' own check, one line, nothing left behind."""
    cfg = {**LORA_CFG, "epochs": 1, "adapter": {"type": "lora", "r": 12}}
    proc = run_stage("launch", *launch_args(tmp_path / "out", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 2 and not (tmp_path / "out").exists(), proc.stderr[-2000:]
    (line,) = {line for line in proc.stderr.splitlines() if line.startswith("shardfuse.train: error:")}
    assert "adapter.r 12 exceeds the smaller dimension of module 'net.2'" in line


def test_a_store_another_program_holds_locked_is_one_line_quickly_and_a_rerun_after_it_tracks(
    track_store, tmp_path
):
    """Another program (a sqlite3 shell, a stuck `mlflow ui`) holds the database's write lock: SQLite's
    own timeout, not MLflow's minutes of retries, then one line naming the URI and the fix; once the
    lock is gone the same command tracks the run."""
    import sqlite3

    run_dir, manifest = make_run_dir(tmp_path, "held")
    args = track_cli_args("held", run_dir, manifest, track_store["uri"], run_dir / "mlflow.json")
    holder = sqlite3.connect(track_store["uri"].removeprefix("sqlite:///"), isolation_level=None)
    try:
        holder.execute("BEGIN EXCLUSIVE")
        started = time.monotonic()
        proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), timeout=240)
        assert time.monotonic() - started < 60
    finally:
        holder.execute("ROLLBACK")
        holder.close()
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "Traceback" not in proc.stderr
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith(f"shardfuse.tracking: error: cannot use tracking URI {track_store['uri']} ("), line
    assert "database is locked" in line and "stop the other program, then re-run `snakemake -R track`" in line
    assert not (run_dir / "mlflow.json").exists()
    rerun = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), timeout=240)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    (parent,), _ = active_runs(track_store, "held")
    assert json.loads((run_dir / "mlflow.json").read_text())["parent_run_id"] == parent.info.run_id
