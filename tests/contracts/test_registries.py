"""The records of the merge methods are the one source of what the config accepts: the schema's
merge_method enum, the merge_<param> keys and their defaults, the keys that reach the merge rule, and
the config's checks agree with the methods' own (tests/unit hold each method's math). The partitioners'
records likewise give the `partition` enum and the partition_<param> keys."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from shardfuse.experiment.keys import MERGE_PARAMS
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods.registry import BY_NAME, METHODS, RECORDS, resolve_params
from shardfuse.io import UserError
from tests.support.helpers import base_config

REPO = Path(__file__).resolve().parents[2]
SCHEMA = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
RUN_KEYS = SCHEMA["$defs"]["run"]["properties"]


def test_the_schema_enum_of_merge_methods_is_the_registry():
    assert RUN_KEYS["merge_method"]["enum"] == list(METHODS)


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
    assert {method: sorted(keys.values()) for method, keys in MERGE_PARAMS.items()} == {
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


@pytest.mark.parametrize("method", [m for m in METHODS if BY_NAME[m].check is not None])
@pytest.mark.parametrize("world_size", [1, 2, 3])
def test_the_config_accepts_a_world_size_exactly_when_the_method_does(method, world_size):
    by_config, by_method = _verdicts(method, world_size)
    assert by_config == by_method, f"{method} on {world_size} ranks: config {by_config}, method {by_method}"


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
    from shardfuse.data.sources.registry import SOURCES

    assert sorted(SCHEMA["$defs"]["dataset"]["properties"]["source"]["enum"]) == sorted(SOURCES)


def test_the_prepare_stage_and_the_config_loader_read_one_table_of_source_tasks():
    from shardfuse.data.sources.registry import SOURCES
    from shardfuse.experiment.keys import DEFAULT_TASKS, SOURCE_TASKS
    from shardfuse.prepare import SOURCE_TASKS as PREPARED_TASKS

    assert SOURCE_TASKS == PREPARED_TASKS == {name: record.tasks for name, record in SOURCES.items()}
    assert {name: tasks[0] for name, tasks in SOURCE_TASKS.items()} == DEFAULT_TASKS


def test_every_source_task_is_a_task_and_the_schema_enums_of_tasks_and_strategies_are_the_codes():
    from shardfuse.data.sources.registry import RECORDS as SOURCE_RECORDS
    from shardfuse.models.tasks import TASKS
    from shardfuse.rank.sync import STRATEGIES

    assert {task for record in SOURCE_RECORDS for task in record.tasks} <= set(TASKS)
    assert SCHEMA["$defs"]["dataset"]["properties"]["task"]["enum"] == list(TASKS)
    assert RUN_KEYS["strategy"]["enum"] == list(STRATEGIES)


def test_the_torch_free_list_of_built_in_models_is_the_registry_of_factories():
    from shardfuse.models.registry import BUILTINS
    from shardfuse.models.usercode import BUILTIN_MODELS

    assert tuple(BUILTINS) == BUILTIN_MODELS
