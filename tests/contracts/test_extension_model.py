"""Adding a built-in model is its factory and one record (README, Development): a toy model written into a
temporary module, registered by extending the torch-free catalog's RECORDS (shardfuse.models.catalog), is
trained by the real train stage, then gathered, merged and evaluated."""

from __future__ import annotations

import json
import sys

import pytest

from shardfuse import train
from shardfuse.metrics.system import INTERVAL_ENV
from shardfuse.models import catalog
from tests.support.extensions import free_port, gather_merge_evaluate, tensors_of, write_module
from tests.support.helpers import call_stage

# A linear read-out of the digits' pixels (0..16), scaled by its own argument.
TOY = """
import torch
from torch import nn


class Toy(nn.Module):
    def __init__(self, num_features, num_outputs, scale):
        super().__init__()
        self.scale = scale
        self.read_out = nn.Linear(num_features, num_outputs)

    def forward(self, features):
        return self.read_out(features * self.scale)


def build(description, scale=0.0625):
    return Toy(description.num_features, description.num_outputs, float(scale))
"""


@pytest.fixture()
def toy_model(tmp_path, monkeypatch):
    module = write_module(tmp_path, "toy_builtin_model", TOY)
    monkeypatch.delitem(sys.modules, "toy_builtin_model")
    monkeypatch.syspath_prepend(str(tmp_path))  # the record names its factory by import path
    toy = catalog.BuiltinModel("toy", f"{module.__name__}:build", "a toy built-in of this test")
    monkeypatch.setattr(catalog, "RECORDS", (*catalog.RECORDS, toy))
    return module


def test_a_built_in_model_added_as_one_record_is_trained_merged_and_evaluated(
    tmp_path, toy_model, digits_dataset, monkeypatch
):
    shards, ranks = tmp_path / "shards", tmp_path / "training" / "ranks"
    proc = call_stage(
        "partition", "--input", digits_dataset / "train.parquet", "--world-size", 1, "--seed", 0,
        "--out-dir", shards,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    # One rank of the train stage, in this process (torchrun's environment for a world of one).
    for key, value in {"RANK": 0, "WORLD_SIZE": 1, "LOCAL_RANK": 0, "MASTER_ADDR": "127.0.0.1"}.items():
        monkeypatch.setenv(key, str(value))
    monkeypatch.setenv("MASTER_PORT", str(free_port()))
    monkeypatch.setenv(INTERVAL_ENV, "0")  # no system-metrics thread
    config = {"model": "toy", "model_args": {"scale": 0.0625}, "optimizer": "sgd", "lr": 0.1,
              "batch_size": 64, "epochs": 2, "seed": 0, "strategy": "ddp"}  # fmt: skip
    train.main(
        ["--run-name", "t", "--shard-dir", str(shards), "--dataset-dir", str(digits_dataset),
         "--config-json", json.dumps(config), "--out-dir", str(ranks), "--no-step-metrics"]
    )  # fmt: skip
    trained = tensors_of(ranks / "rank-0.safetensors")
    assert set(trained) == {"read_out.weight", "read_out.bias"}  # the toy's own tensors, nothing wrapped
    assert json.loads((ranks / "train.json").read_text())["model"]["model"] == "toy"
    record, evaluation = gather_merge_evaluate(tmp_path, digits_dataset, ranks, "uniform", {})
    assert record["num_parameters"] == 64 * 10 + 10
    # Two epochs of a linear read-out learn the digits well beyond chance (0.1), and the merge of one
    # rank is that rank.
    assert evaluation["merged"]["accuracy"] > 0.5
    assert evaluation["merged"] == {k: v for k, v in evaluation["ranks"][0].items() if k != "rank"}
