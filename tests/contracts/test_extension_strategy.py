"""Adding a strategy is one module and one record: a toy strategy, written into a temporary module and added
to the registry's RECORDS, trains through the real train stage (torchrun, two gloo ranks) and the gather
stage takes its training, with nothing else in the package told about it.

How the toy reaches the ranks: a monkeypatch lives in this process only, and the ranks are torchrun's
processes. So the toy's folder also holds a ``sitecustomize`` module (Python imports it at start-up from
PYTHONPATH) that adds the toy's record to ``RECORDS`` in every process of the launch — the launcher,
torchrun and each rank — the way any code that imports the registry before training would. No hook in
the package serves the test; the records are read at call time, which is what the test holds. A single
in-process rank would not do: averaging over one rank is a no-op, so it could not tell the toy ran.
"""

from __future__ import annotations

import importlib.util
import json

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from shardfuse.models.registry import build_model
from shardfuse.strategies import registry
from tests.support.helpers import call_stage
from tests.support.training import SMALL_TRAIN_CFG, launch_training

# The toy: the ranks average their parameters after every optimiser step, whatever sync_every says.
TOY_MODULE = """
import torch
import torch.distributed as torch_dist

from shardfuse.strategies.registry import ALWAYS, UNUSED, Strategy
from shardfuse.strategies.sync import Sync, local


class EveryStep(Sync):
    @classmethod
    def from_settings(cls, model, world_size, settings, group=None):
        return cls(model, world_size, 1, group)

    @torch.no_grad()
    def sync(self):
        for param in self.model.parameters():
            if param.requires_grad:
                shard = local(param)
                torch_dist.all_reduce(shard, op=torch_dist.ReduceOp.SUM, group=self.group)
                shard.div_(self.world_size)
        self.num_syncs += 1


RECORD = Strategy(
    "every_step",
    lambda: EveryStep,
    "a test's toy: local SGD that averages after every step",
    color="#000000",
    sync_every=UNUSED,
    sync_every_note="every_step averages after every step",
    identical_ranks=ALWAYS,
)
"""

# Python imports this at start-up in every process whose PYTHONPATH holds its folder.
SITECUSTOMIZE = """
import toy_strategy
from shardfuse.strategies import registry

registry.RECORDS = (*registry.RECORDS, toy_strategy.RECORD)
"""


@pytest.fixture
def toy(tmp_path, monkeypatch):
    """The toy's record, registered here (monkeypatch) and in every process the launch starts."""
    folder = tmp_path / "plugin"
    folder.mkdir()
    (folder / "toy_strategy.py").write_text(TOY_MODULE)
    (folder / "sitecustomize.py").write_text(SITECUSTOMIZE)
    spec = importlib.util.spec_from_file_location("toy_strategy", folder / "toy_strategy.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, module.RECORD))
    monkeypatch.setenv("PYTHONPATH", str(folder))  # tests.support.helpers.subprocess_env keeps it
    return module.RECORD


def test_a_toy_strategy_trains_through_the_train_stage_and_its_ranks_end_identical(
    toy, tmp_path, digits_dataset, digits_shards
):
    out = tmp_path / "toy" / "ranks"
    cfg = {**SMALL_TRAIN_CFG, "strategy": toy.name, "sync_every": 0}
    launch_training(out, digits_dataset, digits_shards, "toy", cfg)

    info = json.loads((out / "train.json").read_text())
    assert (info["strategy"], info["mode"], info["sync_every"]) == ("every_step", "every_step", 1)
    assert info["num_steps"] > 1 and info["num_syncs"] == info["num_steps"]  # the toy's hook ran every step
    model = build_model(info["model"])
    payload = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    assert info["bytes_all_reduced_per_rank"] == info["num_steps"] * payload

    # Each rank trained on its own shard, and averaging after every step left them bitwise the same.
    rank0, rank1 = (load_weights(out / f"rank-{rank}.safetensors")[0] for rank in (0, 1))
    base = load_weights(out / "base.safetensors")[0]
    assert rank0.keys() == rank1.keys() == base.keys()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)
    assert any(not torch.equal(rank0[name], base[name]) for name in rank0)  # and they did train

    proc = call_stage("gather", "--train-dir", out, "--world-size", 2, "--out", tmp_path / "gather.json")
    assert proc.returncode == 0, proc.stderr
    gathered = json.loads((tmp_path / "gather.json").read_text())
    assert gathered["strategy"] == "every_step" and [r["rank"] for r in gathered["ranks"]] == [0, 1]


def test_the_config_layer_reads_the_toy_from_its_record(toy):
    assert registry.mode_of(toy.name, 0) == "every_step"
    assert registry.mode_colors()["every_step"] == "#000000"
    assert registry.find_strategy(toy.name).publishes_identical("best")
    assert registry.find_strategy(toy.name).sync_every_problem(3) == (
        "sync_every: only localsgd and diloco sync every N steps (every_step averages after every step); "
        "remove sync_every or set strategy localsgd or diloco"
    )
