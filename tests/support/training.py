"""Helpers for tests that run real trainings: configs, the launcher arguments, kill points, bitwise checks."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import torch
import yaml

from shardfuse.checkpoints.weights import load_weights
from shardfuse.launch import staging_dir
from tests.support.helpers import REPO, call_stage, run_in, run_stage, subprocess_env

# The kill tests' training: long enough (12 epochs, a checkpoint every 40 steps) that the ranks still run
# when the first checkpoint is complete.
RESUME_CFG = {
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
    """Every published checkpoint (a rank's, or a replica's under fsdp) equal bitwise."""
    names = sorted(path.name for path in left.glob("rank-*.safetensors"))
    assert names and names == sorted(path.name for path in right.glob("rank-*.safetensors"))
    for name in names:
        a, _ = load_weights(left / name)
        b, _ = load_weights(right / name)
        assert a.keys() == b.keys()
        assert all(torch.equal(a[key], b[key]) for key in a), f"{name} differs"


def wait_for_checkpoint(staging: Path, timeout: float = 120, count: int = 1) -> int:
    """The newest complete checkpoint's step, once ``count`` are complete."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        done = sorted(
            int(path.parent.name.split("-")[1]) for path in staging.glob("checkpoints/step-*/COMPLETE")
        )
        if len(done) >= count:
            return done[-1]
        time.sleep(0.1)
    raise AssertionError(f"no complete checkpoint in {staging} within {timeout} s")


def rank_pids(marker: str, rank: int) -> list[int]:
    """The processes of one rank of one launch (identified by its out dir): forked from the agent
    (shardfuse/cluster/agent.py), a process named ``rank-<rank>`` with the agent's command line; started
    as a fresh interpreter (SHARDFUSE_RANK_START=spawn), ``python -m shardfuse.train`` with RANK set."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = b" ".join((entry / "cmdline").read_bytes().split(b"\0"))
            environ = (entry / "environ").read_bytes().split(b"\0")
            name = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if b"shardfuse.train" not in cmdline or marker.encode() not in cmdline:
            continue
        forked = name == f"rank-{rank}"
        spawned = f"RANK={rank}".encode() in environ and b"shardfuse.agent" not in cmdline
        if forked or spawned:
            found.append(int(entry.name))
    return found


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


def wait_for_staging(workdir: Path, timeout: float = 120) -> list[Path]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = list((workdir / "results" / "trainings").glob("*/.ranks.partial"))
        if found:
            return found
        time.sleep(0.1)
    raise AssertionError("training never started")


SMALL_TRAIN_CFG = {
    "hidden_sizes": [16],
    "activation": "relu",
    "dropout": 0.1,
    "optimizer": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "batch_size": 64,
    "epochs": 2,
    "seed": 3,
}

# The session's small trainings of SMALL_TRAIN_CFG (tests/conftest.py small_trainings): name -> keys.
SMALL_TRAININGS = {
    "ddp": {"strategy": "ddp", "sync_every": 0},
    "independent": {"strategy": "localsgd", "sync_every": 0},
    "localsgd": {"strategy": "localsgd", "sync_every": 5},
}


def launch_training(out, digits_dataset, digits_shards, name, cfg: dict):
    """A real 2-rank gloo training of ``cfg`` through the launcher, into ``out``; its process."""
    proc = run_stage(
        "launch",
        "--nproc-per-node",
        2,
        "--out-dir",
        out,
        "--",
        "--run-name",
        name,
        "--shard-dir",
        digits_shards,
        "--dataset-dir",
        digits_dataset,
        "--config-json",
        json.dumps(cfg),
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def run_training(tmp_path, digits_dataset, digits_shards, name, **overrides):
    out = tmp_path / name / "train"
    launch_training(out, digits_dataset, digits_shards, name, {**SMALL_TRAIN_CFG, **overrides})
    return out


# The ddp kill tests' training (the workflow adds decay_rule to every AdamW run with weight decay).
DDP_RESUME_CFG = {**RESUME_CFG, "strategy": "ddp", "sync_every": 0, "decay_rule": "ndim>=2"}


def train_reference(out: Path, dataset: Path, shards: Path, cfg: dict) -> Path:
    """An uninterrupted 2-rank training of ``cfg``: what a killed and resumed one must equal bitwise."""
    proc = run_stage("launch", *launch_args(out, dataset, shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


def kill_a_rank_and_resume(out: Path, dataset: Path, shards: Path, cfg: dict) -> float:
    """Train ``cfg`` into ``out`` with one torchrun restart allowed, SIGKILL rank 1 once a checkpoint is
    complete, and check that torchrun restarted it and it resumed from that checkpoint or a later one.
    Returns the time of the kill (ms since the epoch)."""
    with subprocess.Popen(
        [sys.executable, "-m", "shardfuse.launch", *map(str, launch_args(out, dataset, shards, cfg, 1))],
        stderr=subprocess.PIPE,
        text=True,
        env=subprocess_env(),
    ) as launcher:
        step = wait_for_checkpoint(staging_dir(out))
        (pid,) = rank_pids(str(staging_dir(out)), rank=1)
        killed_ms = time.time() * 1000
        os.kill(pid, signal.SIGKILL)
        _, stderr = launcher.communicate(timeout=300)
    assert launcher.returncode == 0, stderr[-3000:]
    # The rank really died, and the agent's log says which (torch's summary names the first failure it
    # sees: for forked ranks, usually the peer that lost its connection).
    assert f"shardfuse.agent: rank 1 (pid {pid}) was killed by signal 9 (SIGKILL; the kernel's" in stderr
    resumed = [line for line in stderr.splitlines() if "resuming from checkpoint step" in line]
    assert resumed and int(resumed[0].split("step ")[1].split()[0]) >= step
    return killed_ms


def assert_resumed_bitwise(reference: Path, resumed: Path) -> None:
    """The resumed training's ranks, step metrics and train.json rank records equal the reference's."""
    assert_same_ranks(reference, resumed)
    metrics = pq.read_table(resumed / "metrics" / "rank-0.parquet")
    steps = metrics.column("step").to_pylist()
    assert steps == list(range(1, len(steps) + 1))  # one row per step, none lost or doubled
    expected = pq.read_table(reference / "metrics" / "rank-0.parquet")
    for column in ("loss", "lr", "grad_norm", "val_score"):
        assert np.array_equal(
            metrics.column(column).to_numpy(), expected.column(column).to_numpy(), equal_nan=True
        ), column
    assert (
        json.loads((resumed / "train.json").read_text())["ranks"]
        == json.loads((reference / "train.json").read_text())["ranks"]
    )


def train_and_gather(tmp_path, dataset, shards, name, world_size, **cfg) -> Path:
    """A localsgd training (MLP [128, 128] by default; ``cfg`` overrides) and its gather.json."""
    out = tmp_path / name / "ranks"
    config = {
        "hidden_sizes": [128, 128], "activation": "relu", "dropout": 0.0, "optimizer": "adamw", "lr": 0.003,
        "momentum": 0.9, "weight_decay": 0.0, "batch_size": 32, "epochs": 20, "seed": 0,
        "strategy": "localsgd", "sync_every": 0, **cfg,
    }  # fmt: skip
    proc = run_stage(
        "launch", "--nproc-per-node", world_size, "--out-dir", out, "--", "--run-name", name,
        "--shard-dir", shards, "--dataset-dir", dataset, "--config-json", json.dumps(config), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    gather = tmp_path / name / "gather.json"
    proc = call_stage("gather", "--train-dir", out, "--world-size", world_size, "--out", gather)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return gather


# A small language model with what real ones bring (tests/support/models/tied_lm.py: tied embeddings, a
# dict output, a buffer its forward updates), trained one epoch per shard.
TIED_LM = {
    "model": "tied_lm:build",
    "code_paths": [str(REPO / "tests/support/models")],
    "optimizer": "adamw",
    "lr": 0.01,
    "batch_size": 32,
    "epochs": 1,
    "checkpoint_every": 0,
    "dropout": 0.0,
}


def merged_path(tmp_path, gather, align: str = "none", method: str = "uniform") -> Path:
    """Where :func:`merge_and_evaluate` writes the merged weights."""
    return tmp_path / f"{gather.parent.name}-{method}-{align}.safetensors"


def merge_and_evaluate(
    tmp_path, dataset, gather, align: str, method: str = "uniform", **params
) -> tuple[dict, dict]:
    """The ``method`` merge (uniform by default) of a gathered training after ``align``, evaluated:
    (merge.json, eval.json); the weights are at :func:`merged_path`."""
    merged = merged_path(tmp_path, gather, align, method)
    record, evaluation = merged.with_suffix(".json"), merged.with_suffix(".eval.json")
    proc = call_stage(
        "merge", "--gather", gather, "--method", method, "--params-json", json.dumps(params),
        "--align", align, "--out-weights", merged, "--out-json", record,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = call_stage(
        "evaluate", "--run", "r", "--test", dataset / "test.parquet", "--gather", gather,
        "--merged", merged, "--out", evaluation,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(record.read_text()), json.loads(evaluation.read_text())


def write_resume_config(workdir: Path, runs: dict | None = None, **run_defaults) -> None:
    """``workdir``/config/config.yaml: ``runs`` (by default one ddp run ``r``) on digits with RESUME_CFG
    as the run defaults (``run_defaults`` override it)."""
    (workdir / "config").mkdir(parents=True, exist_ok=True)
    (workdir / "config" / "config.yaml").write_text(
        yaml.safe_dump(
            {
                "runs": runs or {"r": {"strategy": "ddp", "merge_method": "consolidate"}},
                "datasets": {"digits": {"source": "digits"}},
                "run_defaults": {**RESUME_CFG, **run_defaults},
                "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"},
            }
        )
    )


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


# A user model (``flaky:build``) with a bug: on rank 1 its forward raises, in training mode only (set-up's
# check of the output shape runs in eval mode), from its FAIL_AT_FORWARD_ENV-th call on (default 1).
FAILING_MODEL = """
import os

from torch import nn


class Flaky(nn.Module):
    def __init__(self, description):
        super().__init__()
        self.net = nn.Linear(description.num_features, description.num_outputs)
        self.calls = 0

    def forward(self, x):
        if self.training and os.environ["RANK"] == "1":
            self.calls += 1
            if self.calls >= int(os.environ.get("SHARDFUSE_TEST_FAIL_AT_FORWARD", "1")):
                raise RuntimeError("boom in forward")
        return self.net(x)


def build(description):
    return Flaky(description)
"""
FAIL_AT_FORWARD_ENV = "SHARDFUSE_TEST_FAIL_AT_FORWARD"


def write_failing_model(code_dir: Path) -> dict:
    """FAILING_MODEL as ``code_dir``/flaky.py; the run keys that train it."""
    code_dir.mkdir(parents=True, exist_ok=True)
    (code_dir / "flaky.py").write_text(FAILING_MODEL)
    return {"model": "flaky:build", "code_paths": [str(code_dir)]}


# The system metrics a rank samples on a machine without a GPU (under MLflow's names).
CPU_METRICS = {
    "system/cpu_utilization_percentage",
    "system/system_memory_usage_megabytes",
    "system/system_memory_usage_percentage",
    "system/system_memory_total_megabytes",
    "system/process_cpu_utilization_percentage",
    "system/process_rss_megabytes",
}


# The ensemble tests' training: one epoch, no dropout, independent ranks.
ENSEMBLE_TRAIN_CFG = {
    "hidden_sizes": [16],
    "activation": "relu",
    "dropout": 0.0,
    "optimizer": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "batch_size": 64,
    "epochs": 1,
    "seed": 3,
    "strategy": "localsgd",
    "sync_every": 0,
}


EVAL_BATCH_SIZE = 97  # several batches, the last one short: the ensemble is combined batch by batch


def train_merge_evaluate(root, digits_dataset, shard_dir, world_size, trained_ranks=None):
    """A real training of ``world_size`` ranks (or a copy of ``trained_ranks``), gathered, merged
    (uniform) and evaluated by the stages."""
    ranks, gather, run_dir = "training/ranks", "training/gather.json", "run"
    launch = ["shardfuse.launch", "--nproc-per-node", world_size, "--out-dir", ranks, "--",
              "--run-name", "t", "--shard-dir", shard_dir, "--dataset-dir", digits_dataset,
              "--config-json", json.dumps(ENSEMBLE_TRAIN_CFG)]  # fmt: skip
    steps = [
        launch,
        ["shardfuse.gather", "--train-dir", ranks, "--world-size", world_size, "--out", gather],
        ["shardfuse.merge", "--gather", gather, "--method", "uniform", "--params-json", "{}", "--run", "r",
         "--out-weights", f"{run_dir}/merged.safetensors", "--out-json", f"{run_dir}/merge.json"],
        ["shardfuse.evaluate", "--run", "r", "--test", digits_dataset / "test.parquet", "--gather", gather,
         "--merged", f"{run_dir}/merged.safetensors", "--batch-size", EVAL_BATCH_SIZE,
         "--out", f"{run_dir}/eval.json"],
    ]  # fmt: skip
    if trained_ranks is not None:
        shutil.copytree(trained_ranks, root / ranks)
        steps = steps[1:]
    (root / run_dir).mkdir()  # as snakemake makes an output's directory
    for command in steps:
        proc = run_in(root, command)
        assert proc.returncode == 0, proc.stderr[-3000:]
    evaluation = json.loads((root / run_dir / "eval.json").read_text())
    paths = [root / ranks / f"rank-{rank}.safetensors" for rank in range(world_size)]
    return evaluation, paths


# Per-rank adapters (the LoRA Soups setting) on the built-in MLP: independent training, its own A per rank.
LORA = {
    "type": "lora",
    "r": 4,
    "alpha": 8,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "init": "per_rank",
}
LORA_CFG = {
    "hidden_sizes": [64], "activation": "relu", "dropout": 0.0, "optimizer": "adamw", "lr": 0.01,
    "momentum": 0.9, "weight_decay": 0.0, "batch_size": 32, "epochs": 4, "seed": 3,
    "strategy": "localsgd", "sync_every": 0, "checkpoint_every": 0, "adapter": LORA,
}  # fmt: skip
