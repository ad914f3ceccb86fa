"""One owner per training: the lock and its record, no orphans after a killed snakemake, a published
training restored instead of retrained, and a failed job's one-line error on the console."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from shardfuse.console import failed_job_errors
from shardfuse.io import UserError
from shardfuse.ownership import own_training, owner_path
from tests.helpers import REPO, run_stage, snakemake_command, snakemake_failure, subprocess_env
from tests.test_resume import TRAIN_CFG, assert_same_ranks, launch_args, wait_for_checkpoint
from tests.test_resume_snakemake import wait_for_staging

HOLD_LOCK = """
import sys, time
from pathlib import Path
from shardfuse.ownership import own_training
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


def write_config(workdir: Path, **run_defaults) -> None:
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "config" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "runs": {"r": {"strategy": "ddp", "merge_method": "consolidate"}},
                "datasets": {"digits": {"source": "digits"}},
                "run_defaults": {**TRAIN_CFG, **run_defaults},
                "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"},
            }
        )
    )


@pytest.mark.integration
def test_a_failed_stages_one_line_error_is_the_last_thing_on_the_console(tmp_path):
    write_config(tmp_path, epochs=1, warmup_steps=100000)
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


def training_processes(marker: str) -> list[int]:
    """Processes (torchrun, ranks, launcher) whose command line names ``marker``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


@pytest.mark.integration
@pytest.mark.slow
def test_kill_9_of_snakemake_alone_leaves_no_orphan_and_an_immediate_rerun_resumes_bitwise(
    tmp_path, digits_dataset, digits_shards
):
    # The race of issue 18: only snakemake is killed (not its process group), so the training would
    # run on as an orphan beside the rerun's training on the same checkpoints.
    reference = tmp_path / "reference"
    cfg = {**TRAIN_CFG, "strategy": "ddp", "sync_every": 0, "decay_rule": "ndim>=2"}
    proc = run_stage("launch", *launch_args(reference, digits_dataset, digits_shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]

    workdir = tmp_path / "work"
    write_config(workdir)
    command = snakemake_command(workdir, "--cores", "2")
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
    assert_same_ranks(reference, ranks)
    assert training_processes(str(staging)) == []  # nothing of either training runs on


@pytest.mark.integration
@pytest.mark.slow
def test_a_published_training_deleted_by_snakemake_is_restored_not_retrained(tmp_path):
    write_config(tmp_path, epochs=2)
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
    assert "torch.distributed.run" not in log.read_text()  # no rank started
    assert {p.name: p.read_bytes() for p in ranks.iterdir() if p.is_file()} == before


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
