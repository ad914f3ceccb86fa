"""The typed train config is the one source of each train key's default: the schema's defaults, the keys
that join a training's identity only when set, and the keys the train rule passes all agree with it."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardfuse.experiment.keys import DERIVED_TRAIN_KEYS, OPTIONAL_TRAIN_KEYS, TRAIN_KEYS
from shardfuse.experiment.run_config import TrainConfig, flat_defaults
from shardfuse.io import UserError

REPO = Path(__file__).resolve().parents[2]
RUN_KEYS = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())["$defs"]["run"][
    "properties"
]


@pytest.mark.parametrize("key", sorted(set(flat_defaults()) - set(DERIVED_TRAIN_KEYS)))
def test_the_schema_default_of_every_train_key_is_the_typed_configs(key):
    assert "default" in RUN_KEYS[key], f"{key}: the schema gives no default"
    assert RUN_KEYS[key]["default"] == flat_defaults()[key]


def test_the_train_rule_passes_exactly_the_keys_the_typed_config_has():
    assert set(TRAIN_KEYS) | set(OPTIONAL_TRAIN_KEYS) | set(DERIVED_TRAIN_KEYS) == set(flat_defaults())
    assert {key: flat_defaults()[key] for key in OPTIONAL_TRAIN_KEYS} == OPTIONAL_TRAIN_KEYS


def test_a_flat_config_round_trips_and_fills_in_what_it_leaves_out():
    typed = TrainConfig.from_flat({"strategy": "diloco", "sync_every": 10, "lr": 0.01})
    assert (typed.sync.strategy, typed.sync.sync_every, typed.sync.outer_lr) == ("diloco", 10, 0.7)
    assert typed.optim.lr == 0.01 and typed.loop.batch_size == 32
    assert TrainConfig.from_flat(typed.flat()) == typed


def test_an_unknown_key_is_refused_with_the_keys_it_reads():
    with pytest.raises(UserError, match=r"unknown train config key\(s\) 'learning_rate' in --config-json"):
        TrainConfig.from_flat({"learning_rate": 0.1})
