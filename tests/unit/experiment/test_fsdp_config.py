"""The fsdp run key (issue 31) as the config loads: 1 (the default) leaves every training name as it was,
S > 1 names a new training, and each combination sharding cannot serve is one line before any job. The
lookup of a user model's wrap units (a subprocess on the meta device) runs for real in
tests/slow/test_model_checks.py."""

from __future__ import annotations

import re

import pytest

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from tests.support.helpers import base_config


def experiment(world_size=4, **run):
    config = base_config({"r": {"strategy": "ddp", "merge_method": "consolidate", **run}})
    config["run_defaults"]["world_size"] = world_size
    return load_experiment(config, environ={})


def test_fsdp_1_keeps_the_training_name_and_sharding_names_a_new_training():
    plain = experiment()
    assert experiment(fsdp=1).training("r") == plain.training("r")
    assert experiment(fsdp=1, fsdp_precision="fp32").training("r") == plain.training("r")
    sharded = experiment(fsdp=2)
    assert sharded.training("r") != plain.training("r")
    assert sharded.runs["r"]["fsdp"] == 2


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"fsdp": 3}, "runs[r].fsdp: 3 shards per replica do not divide world_size 4"),
        (
            {"fsdp": 2, "model": "cnn"},
            "runs[r].fsdp: fsdp 2 needs the model's wrap units, which the built-in cnn",
        ),
        (
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "uniform", "init": "per_rank"},
            "runs[r].init: init 'per_rank' with fsdp 2: it draws each rank's own weights",
        ),
        (
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "uniform", "merge_align": "weight_matching"},
            "runs[r].merge_align: merge_align 'weight_matching' with fsdp 2",
        ),
        ({"fsdp": 2, "adapter": {"type": "lora", "r": 4}}, "runs[r].adapter: adapter"),
        ({"fsdp": 2, "keep": "best", "eval_every": 5}, "runs[r].keep: keep 'best' with fsdp 2"),
        ({"fsdp": 2, "precision": "bf16"}, "runs[r].precision: bf16 autocast with fsdp 2"),
        ({"fsdp_precision": "bf16"}, "runs[r].fsdp_precision: sets FSDP's mixed precision but fsdp is 1"),
        ({"fsdp": 0}, "runs[r]"),
    ],
)
def test_what_sharding_cannot_serve_is_one_line(run, message, monkeypatch):
    monkeypatch.setattr(
        "shardfuse.experiment.model_checks.check_model_adapter", lambda *a, **k: {"checked": True}
    )
    with pytest.raises(ConfigError) as caught:
        experiment(**run)
    assert message in str(caught.value) and "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (  # one replica: slerp has one model to interpolate, refused before training, not after it
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "slerp", "model": "transformer"},
            "runs[r].merge_method: slerp interpolates exactly 2 models but the run has 1 ranks; use "
            "world_size 2 or another merge method (merge fuses 1 replica(s) (world_size 2 / fsdp 2))",
        ),
        (  # one weight per replica, not per rank
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "weighted", "merge_weights": [1, 2],
             "model": "transformer"},
            "runs[r].merge_weights: 2 weights for 1 replica(s) (world_size 2 / fsdp 2); give one weight",
        ),
    ],
)  # fmt: skip
def test_merge_settings_are_checked_against_the_replicas_merge_fuses(run, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        experiment(world_size=2, **run)
