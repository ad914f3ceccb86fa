"""The records of the merge methods are the one source of what the config accepts: the schema's
merge_method enum, the merge_<param> keys and their defaults, the keys that reach the merge rule, and
the config's checks agree with the methods' own (tests/unit hold each method's math). The partitioners'
records likewise give the `partition` enum and the partition_<param> keys."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path

import pytest
import yaml

from shardfuse.experiment.keys import merge_param_keys
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods.registry import RECORDS, method_record, names, resolve_params
from shardfuse.io import UserError
from tests.support.helpers import base_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
RUN_KEYS = SCHEMA["$defs"]["run"]["properties"]


def test_the_schema_enum_of_merge_methods_is_the_registry():
    assert RUN_KEYS["merge_method"]["enum"] == list(names())


def test_every_method_param_is_a_config_key_whose_schema_default_is_the_methods_default():
    params = {name for record in RECORDS for name in record.params}
    schema_keys = {key.removeprefix("merge_") for key in RUN_KEYS if key.startswith("merge_")}
    assert params <= schema_keys, f"no config key for {sorted(params - schema_keys)}"
    for record in RECORDS:
        for name, param in record.params.items():
            default = RUN_KEYS[f"merge_{name}"].get("default")
            if default is not None:  # null: each method's own default
                assert default == param.default, (
                    f"merge_{name}: schema {default!r}, {record.name} {param.default!r}"
                )


def test_the_keys_that_reach_the_merge_rule_are_the_methods_params():
    assert {method: sorted(merge_param_keys(method).values()) for method in names()} == {
        record.name: sorted(record.params) for record in RECORDS
    }


def _verdicts(method: str, world_size: int) -> tuple[bool, bool]:
    """(config accepts, merge stage accepts) a run of ``method`` on ``world_size`` ranks."""
    config = base_config({"r": {"merge_method": method, "strategy": "localsgd", "sync_every": 0}})
    config["run_defaults"]["world_size"] = world_size
    try:
        load_experiment(config, environ={})
        by_config = True
    except ConfigError:
        by_config = False
    try:
        resolve_params(method, {}, [10] * world_size)
        by_method = True
    except UserError:
        by_method = False
    return by_config, by_method


@pytest.mark.parametrize("method", [m for m in names() if method_record(m).check is not None])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_config_accepts_a_world_size_exactly_when_the_method_does(method, world_size):
    by_config, by_method = _verdicts(method, world_size)
    assert by_config == by_method, f"{method} on {world_size} ranks: config {by_config}, method {by_method}"


DATASET_KEYS = SCHEMA["$defs"]["dataset"]["properties"]


def test_the_schema_enum_of_partitioners_is_the_registry_and_its_default_the_first_record():
    from shardfuse.data.partitioners import registry

    assert RUN_KEYS["partition"]["enum"] == list(registry.names())
    assert RUN_KEYS["partition"]["default"] == registry.DEFAULT == registry.RECORDS[0].name


def test_every_partitioner_param_is_a_config_key_whose_schema_default_is_the_records():
    from shardfuse.data.partitioners import registry

    for record in registry.RECORDS:
        for name, param in record.params.items():
            assert f"partition_{name}" in RUN_KEYS, f"no config key partition_{name} ({record.name})"
            default = RUN_KEYS[f"partition_{name}"].get("default")
            if default is not None:  # null: each partitioner's own default
                assert default == param.default, f"partition_{name}: schema {default!r}, {record.name}"


def test_the_schema_enums_of_partitioner_choices_are_the_partitioners_own():
    from shardfuse.data.partitioners import pathological, size
    from shardfuse.data.partitioners.assignment import LABEL_COLUMN
    from shardfuse.data.shard_format import LABEL_COLUMN as SHARD_LABEL_COLUMN

    assert RUN_KEYS["partition_assignment"]["enum"] == [*pathological.ASSIGNMENTS, None]
    assert RUN_KEYS["partition_law"]["enum"] == [*size.LAWS, None]
    assert LABEL_COLUMN == SHARD_LABEL_COLUMN
    # Each partition_<param> key belongs to some partitioner (a stray key would be refused for all).
    from shardfuse.data.partitioners import registry

    taken = {f"partition_{param}" for record in registry.RECORDS for param in record.params}
    assert {key for key in RUN_KEYS if key.startswith("partition_")} == taken


def test_the_schema_enum_of_dataset_sources_is_the_registry():
    from shardfuse.data.sources.registry import source_names

    assert sorted(DATASET_KEYS["source"]["enum"]) == sorted(source_names())


def test_every_source_serves_a_task_and_the_schema_enum_of_tasks_is_the_codes():
    from shardfuse.data.labels import find_layout
    from shardfuse.data.sources.registry import RECORDS as SOURCES
    from shardfuse.models.tasks import task_names

    for source in SOURCES:
        assert source.tasks(), f"{source.name} gives {source.labels}, which no task trains on"
        assert all(find_layout(layout) for layout in source.labels)
    assert DATASET_KEYS["task"]["enum"] == list(task_names())


def test_the_schema_enum_of_strategies_is_the_registry_and_their_own_keys_are_train_keys():
    from shardfuse.experiment.keys import OPTIONAL_TRAIN_KEYS
    from shardfuse.experiment.run_config import SyncConfig
    from shardfuse.strategies.registry import RECORDS as STRATEGY_RECORDS
    from shardfuse.strategies.registry import names

    assert RUN_KEYS["strategy"]["enum"] == list(names())
    assert RUN_KEYS["strategy"]["default"] == SyncConfig().strategy
    own_keys = {key for record in STRATEGY_RECORDS for key in record.own_keys}
    # Each is a typed sync setting that joins a training's name only when set (so it can be refused
    # off its default for the other strategies).
    assert own_keys <= set(OPTIONAL_TRAIN_KEYS) & {f.name for f in fields(SyncConfig)}


def test_every_key_a_source_takes_is_a_schema_key_with_the_sources_default():
    from shardfuse.data.sources.registry import RECORDS as SOURCES
    from shardfuse.data.sources.registry import SPLIT_DEFAULTS

    taken = set().union(*(source.allowed() for source in SOURCES))
    assert taken == set(DATASET_KEYS), (
        f"schema only: {set(DATASET_KEYS) - taken}, records only: {taken - set(DATASET_KEYS)}"
    )
    for key, value in SPLIT_DEFAULTS.items():
        assert DATASET_KEYS[key]["default"] == value, key
    for source in SOURCES:
        for key, value in source.defaults.items():
            if "default" in DATASET_KEYS[key]:
                assert DATASET_KEYS[key]["default"] == value, f"{source.name}.{key}"


def test_the_schemas_required_keys_per_source_are_the_records():
    from shardfuse.data.sources.registry import RECORDS as SOURCES

    required: dict[str, set[str]] = {source.name: set() for source in SOURCES}
    for rule in SCHEMA["$defs"]["dataset"]["allOf"]:
        condition = rule["if"].get("properties", {}).get("source")
        if condition is not None:
            for name in condition.get("enum", [condition.get("const")]):
                required[name] |= set(rule["then"]["required"])
    assert required == {source.name: set(source.required) for source in SOURCES}


def test_the_config_loader_and_the_prepare_stage_give_a_spec_without_task_the_same_task():
    from shardfuse.data.sources.registry import find_source
    from shardfuse.data.sources.spec import validate_spec
    from shardfuse.models.tasks import named_task

    for spec in ({"source": "digits"}, {"source": "diabetes"}, {"source": "digits_images"}):
        config = base_config({"r": {"dataset": "d"}})
        config["datasets"] = {"d": spec}
        resolved = load_experiment(config, environ={}).datasets["d"]
        assert (
            named_task(resolved) == validate_spec(spec)["task"] == find_source(spec["source"]).default_task()
        )


def test_every_built_in_model_record_names_a_factory_that_builds_it():
    from shardfuse.models.catalog import RECORDS as MODEL_RECORDS

    for record in MODEL_RECORDS:
        assert callable(record.build()), record.name


def test_the_schema_enum_of_epoch_steps_is_its_records_and_its_default_the_typed_configs():
    from shardfuse.data import epoch_steps
    from shardfuse.experiment.run_config import LoopConfig

    assert RUN_KEYS["epoch_steps"]["enum"] == list(epoch_steps.names())
    assert RUN_KEYS["epoch_steps"]["default"] == epoch_steps.DEFAULT == LoopConfig().epoch_steps


def test_the_schema_enum_of_orphans_is_the_memberships_and_its_default_the_typed_configs():
    from shardfuse.cluster.membership import ORPHANS, Member
    from shardfuse.experiment.run_config import SyncConfig

    assert RUN_KEYS["orphans"]["enum"] == list(ORPHANS)
    assert RUN_KEYS["orphans"]["default"] == ORPHANS[0] == SyncConfig().orphans == Member(0, 0, 0).orphans
