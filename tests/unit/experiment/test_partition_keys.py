"""The run keys of a shard set: `partition` and its partition_<param> keys name the shard set, join the
training's identity and reach the partition command as options; iid leaves every name and command as
they were before partitioners existed."""

from __future__ import annotations

import re
import shlex

import pytest

from shardfuse.data.partitioners import registry
from shardfuse.data.partitioners.assignment import Param
from shardfuse.experiment.keys import partition_args, shardset_name, training_name
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.partition_check import check_partition
from shardfuse.experiment.schema import ConfigError
from tests.support.helpers import base_config

SKEW = registry.Partitioner(
    "skew",
    registry.RECORDS[0].assign,
    "a test record with a parameter",
    {"alpha": Param(0.5, "a number > 0", lambda v: isinstance(v, (int, float)) and v > 0)},
)


@pytest.fixture
def skew(monkeypatch):
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, SKEW))


def resolved_run(**keys) -> dict:
    return load_experiment(base_config({"r": keys}), environ={}).runs["r"]


def test_writing_partition_iid_out_keeps_the_training_the_shard_set_and_the_command():
    implicit, explicit = resolved_run(drop_remainder=True), resolved_run(drop_remainder=True, partition="iid")
    assert implicit["partition"] == "iid"
    assert training_name(explicit) == training_name(implicit)
    assert shardset_name(explicit) == shardset_name(implicit) == "w2-seed0-drop"
    assert partition_args(explicit) == "--world-size 2 --seed 0 --drop-remainder"


def test_a_partitioners_params_name_its_shard_set_and_reach_the_command(skew):
    run = {**resolved_run(), "partition": "skew"}
    default, explicit, other = run, {**run, "partition_alpha": 0.5}, {**run, "partition_alpha": 0.1}
    assert shardset_name(default) == shardset_name(explicit) != shardset_name(other)
    assert shardset_name(other).startswith("w2-seed0-skew-")
    assert training_name(default) == training_name(explicit) != training_name(other)
    assert training_name(default) != training_name(run | {"partition": "iid"})
    args = shlex.split(partition_args(other))
    assert args[-4:] == ["--partitioner", "skew", "--params-json", '{"alpha": 0.1}']


def test_a_bad_partition_param_is_a_config_error_naming_the_key(skew):
    run = {**resolved_run(), "partition": "skew", "partition_alpha": -1}
    with pytest.raises(ConfigError, match=re.escape("config error at runs[r].partition: partitioner skew: ")):
        check_partition("r", run)


def test_the_config_refuses_a_partitioner_the_registry_does_not_have():
    with pytest.raises(ConfigError, match=r"runs\[r\].partition: 'nosuch' is not one of iid, dirichlet, "):
        resolved_run(partition="nosuch")
