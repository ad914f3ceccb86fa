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


def test_two_runs_differing_only_in_alpha_get_their_own_shard_sets_and_trainings():
    low, high = (resolved_run(partition="dirichlet", partition_alpha=alpha) for alpha in (0.1, 1))
    assert shardset_name(low) != shardset_name(high)
    assert shardset_name(low).startswith("w2-seed0-dirichlet-")
    assert training_name(low) != training_name(high) != training_name(resolved_run())
    # 1 and 1.0 are one alpha (YAML reads 1 as an integer, runs.tsv as a float): one shard set
    assert shardset_name(high) == shardset_name(resolved_run(partition="dirichlet", partition_alpha=1.0))
    assert '"alpha": 1.0' in partition_args(high)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"partition": "dirichlet", "partition_alpha": 0}, "parameter 'alpha' must be a number > 0"),
        ({"partition": "dirichlet"}, "'alpha' must be a number > 0 (the Dirichlet concentration), got None"),
        ({"partition": "pathological", "partition_classes_per_rank": 2, "partition_alpha": 0.5},
         "partitioner pathological does not take partition_alpha (it takes partition_classes_per_rank, "),
        ({"partition_min_rows": 5}, "partitioner iid does not take partition_min_rows (it takes no "),
        ({"partition": "column", "partition_column": "label"}, "partition_column 'label' is the label"),
        ({"partition": "column", "partition_column": "user", "partition_groups": [[1, 2]]},
         "partition_groups lists 1 groups of values (2 values) for 2 ranks; give every rank a non-empty"),
        ({"partition": "column", "partition_column": "user", "partition_groups": [[1], [1]]},
         "partition_groups names 1 for two ranks"),
        ({"partition": "size", "partition_sizes": [0.5, 0.2]}, "are 2 fractions summing to 0.7; give 2"),
        ({"partition": "size", "partition_sizes": [1.5, -0.5]},
         "'sizes' must be null or a list of fractions >= 0"),
        ({"partition": "size"}, "takes partition_sizes (a fraction per rank) or partition_law"),
        ({"partition": "continuous", "partition_column": "x0", "partition_strictness": 2},
         "parameter 'strictness' must be a number from 0 (iid) to 1"),
        ({"partition": "shards", "drop_remainder": True},
         "drop_remainder makes iid's shards equal; partitioner shards decides its own shard sizes"),
    ],
)  # fmt: skip
def test_bad_partition_keys_are_one_config_error_before_any_job(keys, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        resolved_run(**keys)


def test_a_label_partition_on_a_dataset_without_class_labels_is_refused():
    config = base_config({"r": {"partition": "dirichlet", "partition_alpha": 0.5}})
    config["datasets"] = {"d": {"source": "diabetes"}}
    config["run_defaults"]["dataset"] = "d"
    with pytest.raises(
        ConfigError, match="partitioner dirichlet splits by class labels, but dataset d is a regression"
    ):
        load_experiment(config, environ={})
    config["runs"] = {"r": {"partition": "size", "partition_law": "linear"}}
    assert load_experiment(config, environ={}).runs["r"]["partition"] == "size"


def test_more_classes_per_rank_than_the_spec_lists_is_refused_before_the_data_is_read():
    config = base_config({"r": {"partition": "pathological", "partition_classes_per_rank": 4}})
    config["datasets"]["digits"]["classes"] = [0, 1, 2]
    with pytest.raises(
        ConfigError, match="partition_classes_per_rank 4 is more than the 3 classes of the data"
    ):
        load_experiment(config, environ={})


def column_config(dataset: dict, **run) -> dict:
    config = base_config({"r": {"partition": "column", "partition_column": "writer", **run}})
    config["datasets"]["digits"] = dataset
    return config


@pytest.mark.parametrize(
    ("dataset", "run", "message"),
    [
        ({"source": "digits"}, {},
         "config error at runs[r].partition: partitioner column groups rows by column 'writer', which the "
         "split files of dataset digits do not carry (they carry no column beyond inputs and targets); set "
         "the dataset's writers: N and group by column writer"),
        ({"source": "digits", "writers": 13}, {"partition_column": "site"},
         "groups rows by column 'site', which the split files of dataset digits do not carry (they carry "
         "writer)"),
        ({"source": "csv", "path": "users.csv", "feature_columns": ["a"], "label_column": "y",
          "keep_columns": ["user"]}, {"partition_column": "site"},
         "do not carry (they carry user); add it to the dataset's keep_columns"),
        ({"source": "diabetes"}, {},
         "they carry no column beyond inputs and targets); a csv or parquet dataset carries its "
         "keep_columns"),
        ({"source": "digits", "writers": 3}, {"world_size": 4},
         "config error at runs[r].partition: partitioner column: column 'writer' holds 3 groups, fewer than "
         "the 4 ranks; use at most 3 ranks or another column"),
    ],
)  # fmt: skip
def test_a_column_partition_over_a_column_the_splits_lack_or_too_few_groups_is_refused_before_any_job(
    dataset, run, message
):
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(column_config(dataset, **run), environ={})


def test_a_column_partition_over_carried_groups_loads_and_named_groups_need_no_group_per_rank():
    dealt = load_experiment(column_config({"source": "digits", "writers": 13}, world_size=4), environ={})
    assert shardset_name(dealt.runs["r"]).startswith("w4-seed0-column-")
    named = column_config(
        {"source": "digits", "writers": 3}, world_size=4, partition_groups=[[0], [1], [2], [0]]
    )
    with pytest.raises(ConfigError, match="partition_groups names 0 for two ranks"):
        load_experiment(named, environ={})
    named["runs"]["r"]["partition_groups"] = [[0], [1], [2], []]  # every rank needs a value
    with pytest.raises(ConfigError, match="give every rank a non-empty list"):
        load_experiment(named, environ={})
    named = column_config({"source": "digits", "writers": 4}, world_size=2, partition_groups=[[0, 3], [1]])
    assert load_experiment(named, environ={}).runs["r"]["partition_groups"] == [[0, 3], [1]]
