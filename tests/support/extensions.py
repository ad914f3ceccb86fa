"""Helpers of the extension contract tests (tests/contracts/test_extension_*.py): a toy extension written
into a temporary module and imported from there, a training's checkpoints as the train stage lays them
out, and the stages after training run in this process (so that a registry patched here is the one they
see)."""

from __future__ import annotations

import json
import socket
from pathlib import Path

import torch

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.io import write_json
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from tests.support.extension import import_toy_module as write_module  # noqa: F401 (re-used)
from tests.support.helpers import call_stage


def write_ranks(
    out: Path, dataset: Path, num_ranks: int, run: str = "t", rows: list[int] | None = None, **model_args
) -> dict:
    """A training directory as the train stage lays it out (base, rank files with their sidecars,
    train.json) of the built-in mlp on ``dataset``, each rank its own seeded weights and its shard's
    ``rows`` (default 100 + rank); the model spec."""
    info = json.loads((dataset / "dataset.json").read_text())
    spec = model_spec("mlp", {"hidden_sizes": [8], **model_args}, [], info)
    meta = {"run": run, "world_size": num_ranks, "strategy": "localsgd", "model": spec}
    for rank in (None, *range(num_ranks)):
        torch.manual_seed(1000 if rank is None else rank)
        name = "base" if rank is None else f"rank-{rank}"
        counts = {} if rank is None else {"rows": 100 + rank if rows is None else rows[rank], "num_steps": 3}
        save_weights(
            out / f"{name}.safetensors", build_model(spec).state_dict(), {**meta, "rank": rank, **counts}
        )
    write_json(out / "train.json", {**meta, "num_steps": 3})
    return spec


def gather_merge_evaluate(
    root: Path, dataset: Path, ranks: Path, method: str, params: dict
) -> tuple[dict, dict]:
    """gather, merge with ``method`` and evaluate on the test split, each stage's main in this process:
    (merge.json, eval.json); the merged weights are root/run/merged.safetensors."""
    gather, run = root / "gather.json", root / "run"
    steps = [
        ("gather", "--train-dir", ranks, "--world-size", len(list(ranks.glob("rank-*.safetensors"))),
         "--out", gather),
        ("merge", "--gather", gather, "--method", method, "--params-json", json.dumps(params), "--run", "r",
         "--out-weights", run / "merged.safetensors", "--out-json", run / "merge.json"),
        ("evaluate", "--run", "r", "--test", dataset / "test.parquet", "--gather", gather,
         "--merged", run / "merged.safetensors", "--batch-size", 97, "--out", run / "eval.json"),
    ]  # fmt: skip
    for stage, *args in steps:
        proc = call_stage(stage, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads((run / "merge.json").read_text()), json.loads((run / "eval.json").read_text())


def tensors_of(path: Path) -> dict[str, torch.Tensor]:
    return load_weights(path)[0]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]
