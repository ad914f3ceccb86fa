"""Training edge cases that each take a whole training: a non-finite loss stops the training naming the
rank and the step (and nothing is published), the skip policy for non-finite losses finishes,
train_seconds leaves out a rank that reaches the loop late, and the ensemble of a world-size-one run is
its single rank. (The fast tier keeps the ensemble of two ranks and the step timing of every training.)"""

from __future__ import annotations

import json
import subprocess
import sys

from tests.support.helpers import run_stage, subprocess_env
from tests.support.training import RESUME_CFG, SMALL_TRAIN_CFG, launch_args, train_merge_evaluate

# Plain SGD at lr 1e12: the loss leaves the finite numbers within the first steps.
DIVERGING_CFG = {**RESUME_CFG, "sync_every": 0, "optimizer": "sgd", "lr": 1e12, "dropout": 0.0}


def test_nonfinite_loss_stops_training_naming_rank_and_step(tmp_path, digits_dataset, digits_shards):
    cfg = {**DIVERGING_CFG, "strategy": "localsgd"}
    proc = run_stage("launch", *launch_args(tmp_path / "out", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 2
    assert "loss is nan at step" in proc.stderr or "loss is inf at step" in proc.stderr
    assert (
        "; lower lr, check the data for extreme values, or set nonfinite_loss: skip to skip such batches"
        in proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_nonfinite_loss_skip_policy_finishes(tmp_path, digits_dataset, digits_shards):
    cfg = {**DIVERGING_CFG, "strategy": "ddp", "epochs": 1, "nonfinite_loss": "skip"}
    proc = run_stage("launch", *launch_args(tmp_path / "out", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "train.json").is_file()


# torchrun's entry point for one rank, with rank 1 reaching the training loop late (a slow start-up).
LATE_RANK = """
import time
import shardfuse.train as train

start = train.resume_or_start

def late_start(setup):
    if setup.ctx.rank == 1:
        time.sleep({delay})
    return start(setup)

train.resume_or_start = late_start
train.run_cli(train.main)
"""


def test_train_seconds_leave_out_a_rank_that_reaches_the_loop_late(tmp_path, digits_dataset, digits_shards):
    # localsgd's ranks first meet at a sync inside the loop, so without a common start rank 0 would
    # wait out rank 1's delay in its own loop time, and train_seconds (the slowest rank's loop) would
    # count it. (ddp's wrapper meets the ranks before the loop.)
    delay = 2.0
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK.format(delay=delay))
    out = tmp_path / "train"
    cfg = json.dumps({**SMALL_TRAIN_CFG, "strategy": "localsgd", "sync_every": 5})
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(script),
            "--run-name", "late", "--shard-dir", str(digits_shards), "--dataset-dir", str(digits_dataset),
            "--config-json", cfg, "--out-dir", str(out),
        ],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "train.json").read_text())["train_seconds"] < delay


def test_the_ensemble_of_a_world_size_one_run_is_its_single_rank(tmp_path, digits_dataset):
    shards = tmp_path / "shards"
    subprocess.run(
        [sys.executable, "-m", "shardfuse.partition", "--input", str(digits_dataset / "train.parquet"),
         "--world-size", "1", "--seed", "0", "--out-dir", str(shards)],
        check=True, env=subprocess_env(), capture_output=True,
    )  # fmt: skip
    evaluation, _ = train_merge_evaluate(tmp_path, digits_dataset, shards, 1)
    (rank,) = evaluation["ranks"]
    assert evaluation["ensemble"] == {k: v for k, v in rank.items() if k != "rank"}
    assert evaluation["fusion_gap"] == evaluation["ensemble"]["accuracy"] - evaluation["merged"]["accuracy"]
