"""Kills and restarts: training resumes from its newest checkpoint and ends bitwise identical."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shardfuse.checkpoint import load_weights
from shardfuse.launch import staging_dir
from tests.helpers import REPO, run_stage, subprocess_env, write_train_dir

pytestmark = pytest.mark.integration

TRAIN_CFG = {
    "hidden_sizes": [32],
    "activation": "relu",
    "dropout": 0.1,
    "optimizer": "adamw",
    "lr": 0.003,
    "momentum": 0.9,
    "weight_decay": 0.01,
    "batch_size": 16,
    "epochs": 12,
    "seed": 1,
    "checkpoint_every": 40,
    "keep_checkpoints": 2,
    "nonfinite_loss": "error",
}


def launch_args(out: Path, dataset: Path, shards: Path, cfg: dict, max_restarts: int = 0) -> list:
    return [
        "--nproc-per-node",
        2,
        "--max-restarts",
        max_restarts,
        "--out-dir",
        out,
        "--",
        "--run-name",
        "r",
        "--shard-dir",
        shards,
        "--dataset-dir",
        dataset,
        "--config-json",
        json.dumps(cfg),
    ]


def assert_same_ranks(left: Path, right: Path) -> None:
    for rank in (0, 1):
        a, _ = load_weights(left / f"rank-{rank}.safetensors")
        b, _ = load_weights(right / f"rank-{rank}.safetensors")
        assert a.keys() == b.keys()
        assert all(torch.equal(a[name], b[name]) for name in a), f"rank {rank} differs"


def wait_for_checkpoint(staging: Path, timeout: float = 120) -> int:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = sorted(staging.glob("checkpoints/step-*/COMPLETE"))
        if done:
            return int(done[-1].parent.name.split("-")[1])
        time.sleep(0.1)
    raise AssertionError(f"no complete checkpoint in {staging} within {timeout} s")


def rank_pids(marker: str, rank: int) -> list[int]:
    """Training processes (python -m shardfuse.train) of one launch, identified by its out dir."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes().split(b"\0")
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        if (
            b"shardfuse.train" in cmdline
            and marker.encode() in b" ".join(cmdline)
            and f"RANK={rank}".encode() in environ
            and b"torch.distributed.run" not in b" ".join(cmdline)
        ):
            found.append(int(entry.name))
    return found


# A user model (config/examples/models/resmlp.py, imported from its code path in every rank) and a
# regression task resume as bitwise as the built-in classifier.
USER_MODEL = {"model": "resmlp:build", "code_paths": [str(REPO / "config/examples/models")]}


# The built-in CNN (BatchNorm: running statistics and a counter in every checkpoint) on images and the
# built-in transformer on byte tokens resume as bitwise too.
CNN = {"model": "cnn", "model_args": {"channels": [8, 16]}, "epochs": 6, "dropout": 0.0}
TRANSFORMER = {"model": "transformer", "model_args": {"width": 32, "layers": 1, "heads": 2}, "epochs": 3}
SLOW = pytest.mark.slow
# The training loop's state resumes bitwise too: the schedule (a function of the step), accumulation
# (checkpoints fall between optimiser steps), clipping, and DiLoCo's outer parameters and momentum with
# validation's best weights and patience (keep: best publishes a step before the end).
SCHEDULE_ACCUM = {
    "lr_schedule": "cosine",
    "warmup_steps": 15,
    "min_lr": 0.0003,
    "grad_accum_steps": 3,
    "grad_clip_norm": 0.5,
    "decay_rule": "ndim>=2",
    "checkpoint_every": 13,
}
DILOCO = {
    "sync_every": 5,
    "grad_accum_steps": 2,
    "eval_every": 12,
    "keep": "best",
    "patience": 40,
    "checkpoint_every": 20,
}


@pytest.mark.parametrize(
    ("strategy", "data", "extra"),
    [
        ("ddp", "digits", {}),
        ("localsgd", "digits", {}),
        pytest.param(
            "localsgd",
            "digits",
            {**USER_MODEL, "model_args": {"width": 16, "blocks": 1}, "epochs": 6},
            marks=SLOW,
        ),
        pytest.param("ddp", "diabetes", {"loss": "huber", "epochs": 16, "checkpoint_every": 20}, marks=SLOW),
        pytest.param("ddp", "digits_images", CNN, marks=SLOW),
        pytest.param("localsgd", "stdlib", {**TRANSFORMER, "checkpoint_every": 10}, marks=SLOW),
        pytest.param("ddp", "digits", SCHEDULE_ACCUM, marks=SLOW),
        pytest.param("diloco", "digits", DILOCO, marks=SLOW),
    ],
    ids=["ddp", "localsgd", "user-model", "regression", "cnn", "transformer", "schedule-accum", "diloco"],
)
def test_killed_rank_is_restarted_by_torchrun_and_resumes_bitwise_identical(
    tmp_path, request, strategy, data, extra
):
    if data == "digits":
        dataset, shards = request.getfixturevalue("digits_dataset"), request.getfixturevalue("digits_shards")
    else:
        fixture = {
            "diabetes": "diabetes_data",
            "digits_images": "digits_images_data",
            "stdlib": "stdlib_tokens_data",
        }
        dataset, shards = request.getfixturevalue(fixture[data])
    cfg = {**TRAIN_CFG, "strategy": strategy, "sync_every": 7 if strategy == "localsgd" else 0, **extra}
    reference = tmp_path / "reference"
    proc = run_stage("launch", *launch_args(reference, dataset, shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]

    killed = tmp_path / "killed"
    with subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shardfuse.launch",
            *map(str, launch_args(killed, dataset, shards, cfg, max_restarts=1)),
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    ) as launcher:
        step = wait_for_checkpoint(staging_dir(killed))
        (pid,) = rank_pids(str(staging_dir(killed)), rank=1)
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    assert "exitcode: -9" in stderr  # the rank really died
    resumed = [line for line in stderr.splitlines() if "resuming from checkpoint step" in line]
    assert resumed and int(resumed[0].split("step ")[1].split()[0]) >= step
    assert_same_ranks(reference, killed)
    metrics = pq.read_table(killed / "metrics" / "rank-0.parquet")
    steps = metrics.column("step").to_pylist()
    assert steps == list(range(1, len(steps) + 1))  # one row per step, none lost or doubled
    expected = pq.read_table(reference / "metrics" / "rank-0.parquet")
    for column in ("loss", "lr", "grad_norm", "val_score"):
        assert np.array_equal(
            metrics.column(column).to_numpy(), expected.column(column).to_numpy(), equal_nan=True
        ), column
    assert (
        json.loads((killed / "train.json").read_text())["ranks"]
        == json.loads((reference / "train.json").read_text())["ranks"]
    )


def test_nonfinite_loss_stops_training_naming_rank_and_step(tmp_path, digits_dataset, digits_shards):
    cfg = {
        **TRAIN_CFG,
        "strategy": "localsgd",
        "sync_every": 0,
        "optimizer": "sgd",
        "lr": 1e12,
        "dropout": 0.0,
    }
    proc = run_stage("launch", *launch_args(tmp_path / "out", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 2
    assert "loss is nan at step" in proc.stderr or "loss is inf at step" in proc.stderr
    assert (
        "; lower lr, check the data for extreme values, or set nonfinite_loss: skip to skip such batches"
        in proc.stderr
    )
    assert not (tmp_path / "out").exists()


def test_nonfinite_loss_skip_policy_finishes(tmp_path, digits_dataset, digits_shards):
    cfg = {
        **TRAIN_CFG,
        "strategy": "ddp",
        "sync_every": 0,
        "optimizer": "sgd",
        "lr": 1e12,
        "dropout": 0.0,
        "epochs": 1,
        "nonfinite_loss": "skip",
    }
    proc = run_stage("launch", *launch_args(tmp_path / "out", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (tmp_path / "out" / "train.json").is_file()


def kill_when(proc: subprocess.Popen, condition, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            proc.kill()
            proc.wait(timeout=30)
            return
        if proc.poll() is not None:
            raise AssertionError("the stage finished before it could be interrupted; make the input larger")
        time.sleep(0.01)
    raise AssertionError("the interruption point never came")


def test_interrupted_partition_leaves_nothing_that_looks_complete(tmp_path):
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = 3_000_000
    source = tmp_path / "train.parquet"
    rng = np.random.default_rng(0)
    columns = {f"x{i}": rng.standard_normal(rows, dtype=np.float32) for i in range(8)}
    pq.write_table(
        pa.table({**columns, "label": (np.arange(rows) % 10).astype(np.int64)}),
        source,
        row_group_size=100_000,
    )
    out = tmp_path / "shards"
    args = ["--input", source, "--world-size", 4, "--seed", 0, "--out-dir", out, "--batch-size", 50_000]
    with subprocess.Popen(
        [sys.executable, "-m", "shardfuse.partition", *map(str, args)],
        env=subprocess_env(),
        stderr=subprocess.DEVNULL,
    ) as proc:
        kill_when(proc, lambda: any(p.stat().st_size > 0 for p in tmp_path.glob(".shards.tmp-*/shard-*")))
    assert not out.exists()
    rerun = run_stage("partition", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads((out / "manifest.json").read_text())["total_rows"] == rows


def test_interrupted_merge_leaves_nothing_that_looks_complete(tmp_path):
    big = {f"w{i}": torch.randn(4096, 4096) for i in range(6)}  # ~400 MB per rank: the merge takes a while
    ranks = write_train_dir(tmp_path / "ranks", big, 2, lambda rank: {k: v + rank for k, v in big.items()})
    gathered = run_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", tmp_path / "gather.json")
    assert gathered.returncode == 0, gathered.stderr
    out_weights, out_json = tmp_path / "run" / "merged.safetensors", tmp_path / "run" / "merge.json"
    args = [
        "--gather",
        tmp_path / "gather.json",
        "--method",
        "uniform",
        "--out-weights",
        out_weights,
        "--out-json",
        out_json,
    ]
    with subprocess.Popen(
        [sys.executable, "-m", "shardfuse.merge", *map(str, args)],
        env=subprocess_env(),
        stderr=subprocess.DEVNULL,
    ) as proc:
        kill_when(proc, lambda: any(p.stat().st_size > 0 for p in out_weights.parent.glob(".merged*tmp*")))
    assert not out_weights.exists() and not out_json.exists()
    rerun = run_stage("merge", *args)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    assert json.loads(out_json.read_text())["sha256"]
