"""Helpers for the contract tests that add a toy extension (a source, a task) and run it through the real
stages in this process: the toy's module written to a temporary directory and imported, and the stages
from prepare to evaluate called through their ``main`` (one rank, gloo, no torchrun)."""

from __future__ import annotations

import importlib.util
import json
import socket
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest

from tests.support.helpers import call_stage
from tests.support.training import SMALL_TRAIN_CFG


def import_toy_module(directory: Path, name: str, code: str) -> ModuleType:
    """Write ``code`` to DIRECTORY/NAME.py and import it as module ``name`` (left in sys.modules, as a
    registered extension's module is, so that "module:Class" references resolve)."""
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(code))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def stage_ok(stage: str, *args: object) -> str:
    """Call a stage's main in this process; its stdout, or the test fails with its stderr."""
    proc = call_stage(stage, *args)
    assert proc.returncode == 0, f"{stage} failed:\n{proc.stderr[-3000:]}"
    return proc.stdout


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def train_one_rank(monkeypatch: pytest.MonkeyPatch, dataset: Path, shards: Path, out: Path, **cfg) -> None:
    """The train stage as torchrun would start its only rank (world size 1, gloo on CPU), in this process."""
    for name, value in {"RANK": 0, "LOCAL_RANK": 0, "WORLD_SIZE": 1, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(name, str(value))
    monkeypatch.setenv("MASTER_PORT", str(_free_port()))
    config = json.dumps({**SMALL_TRAIN_CFG, "strategy": "ddp", "sync_every": 0, **cfg})
    stage_ok(
        "train",
        "--run-name", "toy", "--shard-dir", shards, "--dataset-dir", dataset,
        "--config-json", config, "--out-dir", out,
    )  # fmt: skip


def prepare_to_evaluate(monkeypatch: pytest.MonkeyPatch, root: Path, spec: dict, **cfg) -> dict:
    """prepare, partition (one shard), train, gather, merge (uniform) and evaluate of a dataset ``spec``
    under ``root``; the eval.json written."""
    dataset, shards, run = root / "dataset", root / "shards", root / "run"
    ranks, gather = (
        root / "training" / "ranks",
        root / "training" / "gather.json",
    )  # as the workflow lays them
    stage_ok("prepare", "--name", "toy", "--spec-json", json.dumps(spec), "--out-dir", dataset)
    stage_ok(
        "partition", "--input", dataset / "train.parquet", "--world-size", 1, "--seed", 0, "--out-dir", shards
    )
    train_one_rank(monkeypatch, dataset, shards, ranks, **cfg)
    stage_ok("gather", "--train-dir", ranks, "--world-size", 1, "--out", gather)
    stage_ok(
        "merge", "--gather", gather, "--method", "uniform",
        "--out-weights", run / "merged.safetensors", "--out-json", run / "merge.json",
    )  # fmt: skip
    stage_ok(
        "evaluate", "--run", "toy", "--test", dataset / "test.parquet", "--gather", gather,
        "--merged", run / "merged.safetensors", "--out", run / "eval.json",
    )  # fmt: skip
    return json.loads((run / "eval.json").read_text())
