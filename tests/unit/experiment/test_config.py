"""Config validation: every mistake is one clear error naming the key, before any job starts."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardfuse.experiment.keys import (
    DECAY_RULE,
    MAX_RUN_SEED,
    MAX_SEED,
    OPTIONAL_TRAIN_KEYS,
    RANK_SEED_STRIDE,
    shardset_name,
    train_config,
    training_name,
)
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.runs_table import read_runs_table
from shardfuse.experiment.schema import ConfigError, load_schema, read_config_file
from tests.support.helpers import base_config

REPO = Path(__file__).resolve().parents[3]


def test_repository_default_config_resolves_ddp_and_localsgd_runs(monkeypatch):
    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    experiment = load_experiment(config, environ={})
    strategies = {cfg["strategy"] for cfg in experiment.runs.values()}
    assert {"ddp", "localsgd"} <= strategies
    assert all(cfg["dataset"] == "digits" for cfg in experiment.runs.values())
    assert experiment.tracking_uri == "sqlite:///mlflow.db"


def test_default_experiment_sweeps_merge_methods_over_one_shared_w4_training(monkeypatch):
    monkeypatch.chdir(REPO)
    experiment = load_experiment(yaml.safe_load((REPO / "config" / "config.yaml").read_text()), environ={})
    sweep: dict[str, set[str]] = {}
    for run, cfg in experiment.runs.items():
        if cfg["world_size"] == 4 and cfg["strategy"] == "localsgd" and cfg["sync_every"] == 0:
            sweep.setdefault(experiment.training(run), set()).add(cfg["merge_method"])
    assert any(len(methods) >= 4 for methods in sweep.values())
    assert len(experiment.trainings) < len(experiment.runs)  # sweeps reuse trained ranks


def test_runs_table_cells_override_defaults_and_empty_cells_keep_them(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_text(
        "run\tstrategy\tsync_every\thidden_sizes\tlr\n# comment\na\tlocalsgd\t4\t32,16\t\nb\t\t\t[8]\t0.5\n"
    )
    experiment = load_experiment(base_config(str(table)), environ={})
    assert experiment.runs["a"]["strategy"] == "localsgd"
    assert experiment.runs["a"]["sync_every"] == 4
    assert experiment.runs["a"]["hidden_sizes"] == [32, 16]
    assert experiment.runs["a"]["lr"] == 0.05  # schema default
    assert experiment.runs["b"]["strategy"] == "ddp"
    assert experiment.runs["b"]["hidden_sizes"] == [8]
    assert experiment.runs["b"]["lr"] == 0.5


def test_runs_table_sets_keys_that_may_be_null(tmp_path):
    """The README's multi-node and merge rows: nproc_per_node, merge_weights, merge_density in cells."""
    table = tmp_path / "runs.tsv"
    table.write_text(
        "run\tstrategy\tworld_size\tnodes\tnproc_per_node\tmerge_method\tmerge_weights\tmerge_density\n"
        "big\tddp\t32\t4\t8\tconsolidate\t\t\n"
        "w\tlocalsgd\t2\t1\tnull\tweighted\t0.25,0.75\t\n"
        "t\tlocalsgd\t2\t\t\tties\t\t0.3\n"
    )
    runs = load_experiment(base_config(str(table)), environ={}).runs
    assert runs["big"]["nproc_per_node"] == 8 and runs["big"]["nodes"] == 4
    assert runs["w"]["nproc_per_node"] == 2  # null: world_size / nodes
    assert runs["w"]["merge_weights"] == [0.25, 0.75]
    assert runs["t"]["merge_density"] == 0.3


@pytest.mark.parametrize(
    ("runs", "expected"),
    [
        ({"r": {"world_sise": 2}}, "unknown key 'world_sise'"),
        ({"r": {"world_size": 0}}, "runs[r].world_size: 0 is less than the minimum of 1"),
        ({"r": {"world_size": "two"}}, "runs[r].world_size: 'two' is not of type 'integer'"),
        ({"r": {"strategy": "fsdp"}}, "runs[r].strategy: 'fsdp' is not one of ddp, localsgd, diloco"),
        ({"r": {"dataset": "mnist"}}, "runs[r].dataset: unknown dataset 'mnist'"),
        ({"r": {"strategy": "localsgd", "merge_method": "consolidate"}}, "consolidate needs identical ranks"),
        ({"r": {"sync_every": 3}}, "only localsgd and diloco sync every N steps"),
        (
            {"r": {"lr_schedule": "step"}},
            "runs[r].lr_schedule: 'step' is not one of constant, cosine, linear",
        ),
        ({"r": {"warmup_steps": -1}}, "runs[r].warmup_steps: -1 is less than the minimum of 0"),
        ({"r": {"grad_accum_steps": 0}}, "runs[r].grad_accum_steps: 0 is less than the minimum of 1"),
        ({"r": {"grad_clip_norm": 0}}, "runs[r].grad_clip_norm: 0 is less than or equal to the minimum of 0"),
        ({"r": {"optimizer": "adamw", "betas": [0.9, 1.0]}}, "runs[r].betas.1: 1.0 is greater than or equal"),
        ({"r": {"optimizer": "adamw", "betas": [0.9]}}, "runs[r].betas: [0.9] is too short"),
        ({"r": {"outer_lr": 0}}, "runs[r].outer_lr: 0 is less than or equal to the minimum of 0"),
        ({"r": {"keep": "first"}}, "runs[r].keep: 'first' is not one of last, best"),
        ({"r": {"init": "random"}}, "runs[r].init: 'random' is not one of shared, per_rank"),
        ({"r": {"patience": 0, "eval_every": 5}}, "runs[r].patience: 0 is less than the minimum of 1"),
        # The templated twins of the catalogue's cases (tests/contracts/test_error_catalogue.py).
        ({"r": {"eps": 1.0e-6}}, "runs[r].eps: eps is an AdamW setting but optimizer is sgd"),
        (
            {"r": {"strategy": "localsgd", "outer_momentum": 0.5}},
            "runs[r].outer_momentum: only strategy diloco",
        ),
        (
            {"r": {"strategy": "diloco", "sync_every": 4, "init": "per_rank"}},
            "diloco's outer step needs one shared starting point",
        ),
        ({"r": {"dropout": 1.0}}, "runs[r].dropout"),
        ({"bad name": {}}, "run name 'bad name' is not allowed"),
    ],
)
def test_invalid_run_is_one_error_naming_the_key(runs, expected):
    with pytest.raises(ConfigError) as info:
        load_experiment(base_config(runs), environ={})
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


def test_unknown_top_level_key_is_named():
    config = {**base_config({"r": {}}), "epochs": 3}
    with pytest.raises(ConfigError, match=r"unknown key 'epochs'; valid keys: datasets, mlflow"):
        load_experiment(config, environ={})


def test_synthetic_dataset_requires_its_sizes():
    config = base_config({"r": {}})
    config["datasets"]["digits"] = {"source": "synthetic", "num_rows": 100}
    with pytest.raises(
        ConfigError, match=r"datasets.digits: 'num_(features|classes)' is a required property"
    ):
        load_experiment(config, environ={})


def test_runs_table_unknown_column_and_bad_cell_are_named(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_text("run\tepoch\nr\t3\n")
    with pytest.raises(ConfigError, match=r"unknown column 'epoch'"):
        read_runs_table(table, {"epochs": {"type": "integer"}})
    table.write_text("run\tepochs\nr\tten\n")
    with pytest.raises(ConfigError, match=r"runs\[r\].epochs: 'ten' is not a valid integer"):
        load_experiment(base_config(str(table)), environ={})
    table.write_text("run\tepochs\nr\t3\nr\t4\n")
    with pytest.raises(ConfigError, match=r"run 'r' appears twice"):
        load_experiment(base_config(str(table)), environ={})


def test_missing_runs_table_says_where_paths_are_relative(tmp_path):
    with pytest.raises(ConfigError, match=r"does not exist.*relative to the working directory"):
        load_experiment(base_config(str(tmp_path / "nope.tsv")), environ={})


def test_tracking_uri_falls_back_to_environment_then_sqlite():
    config = base_config({"r": {}})
    assert load_experiment(config, environ={"MLFLOW_TRACKING_URI": "http://127.0.0.1:5000"}).tracking_uri == (
        "http://127.0.0.1:5000"
    )
    config["mlflow"] = {"tracking_uri": "sqlite:///x.db"}
    assert (
        load_experiment(config, environ={"MLFLOW_TRACKING_URI": "http://h"}).tracking_uri == "sqlite:///x.db"
    )


def test_shards_are_shared_by_runs_that_differ_only_in_training():
    experiment = load_experiment(
        base_config(
            {"a": {"strategy": "ddp"}, "b": {"strategy": "localsgd", "lr": 0.1}, "c": {"shard_seed": 1}}
        ),
        environ={},
    )
    shardsets = {run: shardset_name(cfg) for run, cfg in experiment.runs.items()}
    assert shardsets["a"] == shardsets["b"] == "w2-seed0"
    assert shardsets["c"] != shardsets["a"]
    assert shardset_name({"world_size": 4, "shard_seed": 3, "drop_remainder": True}) == "w4-seed3-drop"


def test_every_schema_key_is_documented_in_config_readme():
    schema = yaml.safe_load((REPO / "workflow" / "schemas" / "config.schema.yaml").read_text())
    readme = (REPO / "config" / "README.md").read_text()
    keys = [key for key in schema["properties"] if key != "mlflow"]
    keys += [*schema["$defs"]["run"]["properties"], *schema["$defs"]["dataset"]["properties"]]
    keys += [f"mlflow.{key}" for key in schema["properties"]["mlflow"]["properties"]]
    missing = [key for key in keys if f"| `{key}` |" not in readme]
    assert not missing


def names(config: dict) -> dict[str, str]:
    experiment = load_experiment(config, environ={})
    return {run: experiment.training(run) for run in experiment.runs}


def test_training_loop_defaults_are_the_schema_defaults():
    """OPTIONAL_TRAIN_KEYS decides what stays out of training names; it must agree with the schema."""
    run_props = load_schema()["$defs"]["run"]["properties"]
    assert {key: run_props[key]["default"] for key in OPTIONAL_TRAIN_KEYS} == OPTIONAL_TRAIN_KEYS


def test_new_keys_at_their_defaults_keep_the_repository_training_names(monkeypatch):
    """Writing every optional train key out at its default names the same trainings as leaving them
    out, and none of them reaches the train command: trainings from before the keys existed are reused."""
    monkeypatch.chdir(REPO)
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    implicit = names(config)
    experiment = load_experiment(config, environ={})
    for cfg in experiment.runs.values():
        assert not set(OPTIONAL_TRAIN_KEYS) & set(train_config(cfg))
        assert "decay_rule" not in train_config(cfg)
    explicit_defaults = {**OPTIONAL_TRAIN_KEYS, "min_lr": 0, "betas": [0.9, 0.999], "eps": 1.0e-8}
    config["run_defaults"] = {**config["run_defaults"], **explicit_defaults}
    assert names(config) == implicit


def test_defaults_written_in_runs_table_cells_keep_the_training_name(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_text(
        "run\toptimizer\tbetas\teps\tmin_lr\tgrad_clip_norm\tpatience\touter_lr\tinit\n"
        "implicit\tadamw\t\t\t\t\t\t\t\n"
        "explicit\tadamw\t0.9,0.999\t1e-8\t0\tnull\tnull\t0.7\tshared\n"
    )
    found = names(base_config(str(table)))
    assert found["implicit"] == found["explicit"]


NON_DEFAULT = [
    ({}, {"lr_schedule": "cosine"}),
    ({}, {"warmup_steps": 10}),
    ({"lr_schedule": "cosine"}, {"min_lr": 0.001}),
    ({}, {"grad_clip_norm": 1.0}),
    ({}, {"grad_accum_steps": 4}),
    ({"optimizer": "adamw"}, {"betas": [0.9, 0.95]}),
    ({"optimizer": "adamw"}, {"eps": 1.0e-6}),
    ({}, {"eval_every": 50}),
    ({"eval_every": 50}, {"keep": "best"}),
    ({"eval_every": 50}, {"patience": 3}),
    ({"strategy": "diloco", "sync_every": 16}, {"outer_lr": 0.5}),
    ({"strategy": "diloco", "sync_every": 16}, {"outer_momentum": 0.8}),
    ({"strategy": "localsgd"}, {"init": "per_rank"}),
]


@pytest.mark.parametrize(("base", "change"), NON_DEFAULT, ids=[next(iter(c)) for _, c in NON_DEFAULT])
def test_a_new_key_off_its_default_gives_a_new_training(base, change):
    runs = load_experiment(base_config({"a": base, "b": {**base, **change}}), environ={}).runs
    assert training_name(runs["a"]) != training_name(runs["b"])
    (key,) = change
    assert key not in train_config(runs["a"])
    assert train_config(runs["b"])[key] == change[key]


def test_diloco_is_a_strategy_with_its_own_training_names():
    runs = load_experiment(
        base_config(
            {"l": {"strategy": "localsgd", "sync_every": 16}, "d": {"strategy": "diloco", "sync_every": 16}}
        ),
        environ={},
    ).runs
    assert training_name(runs["d"]).startswith("digits-w2-diloco-")
    assert training_name(runs["d"]) != training_name(runs["l"])


def test_adamw_with_weight_decay_gets_the_decay_rule_and_a_new_training_name():
    """AdamW no longer decays biases and norm weights: only the runs this changes get decay_rule."""
    runs = load_experiment(
        base_config(
            {
                "adamw_wd": {"optimizer": "adamw", "weight_decay": 0.01},
                "adamw": {"optimizer": "adamw"},
                "sgd_wd": {"weight_decay": 0.01},
            }
        ),
        environ={},
    ).runs
    assert runs["adamw_wd"]["decay_rule"] == DECAY_RULE == "ndim>=2"
    assert train_config(runs["adamw_wd"])["decay_rule"] == "ndim>=2"
    before_the_rule = {key: value for key, value in runs["adamw_wd"].items() if key != "decay_rule"}
    assert training_name(before_the_rule) != training_name(runs["adamw_wd"])
    assert "decay_rule" not in runs["adamw"] and "decay_rule" not in train_config(runs["adamw"])
    assert "decay_rule" not in runs["sgd_wd"] and "decay_rule" not in train_config(runs["sgd_wd"])


def test_new_number_keys_are_floats_so_one_value_names_one_training():
    runs = load_experiment(
        base_config(
            {
                "int": {"strategy": "diloco", "sync_every": 4, "outer_lr": 1},
                "float": {"strategy": "diloco", "sync_every": 4, "outer_lr": 1.0},
            }
        ),
        environ={},
    ).runs
    assert training_name(runs["int"]) == training_name(runs["float"])
    assert isinstance(runs["int"]["outer_lr"], float)


def test_ddp_baseline_of_a_diloco_run_ignores_its_strategy_keys():
    experiment = load_experiment(
        base_config(
            {
                "ddp": {"strategy": "ddp"},
                "diloco": {"strategy": "diloco", "sync_every": 8, "outer_lr": 0.5},
                "per_rank": {"strategy": "localsgd", "init": "per_rank"},
            }
        ),
        environ={},
    )
    assert experiment.ddp_baseline("diloco") == "ddp"
    assert experiment.ddp_baseline("per_rank") == "ddp"


def test_exponent_yaml_reads_as_text_gets_a_hint(tmp_path):
    """PyYAML reads 1e-8 (no dot) as a string; the error says how to write it."""
    config = yaml.safe_load(
        "runs: {r: {optimizer: adamw, eps: 1e-8}}\ndatasets: {digits: {source: digits}}\n"
        "run_defaults: {dataset: digits}\n"
    )
    with pytest.raises(
        ConfigError, match=r"'1e-8' is not of type 'number' \(YAML reads 1e-8 as text; write 1\.0e-8\)"
    ):
        load_experiment(config, environ={})


def readme_runs_tables() -> list[tuple[str, str]]:
    """Every runs.tsv example of the READMEs: a fenced block whose first line is a `run` header."""
    found = []
    for readme in (REPO / "README.md", REPO / "config" / "README.md"):
        for block in re.findall(r"^```\n(run\t.*?)```", readme.read_text(), flags=re.MULTILINE | re.DOTALL):
            found.append((readme.relative_to(REPO).as_posix(), block))
    return found


def test_readme_runs_table_examples_load_as_written(tmp_path, monkeypatch):
    """The READMEs' runs.tsv rows (the multi-node one sets nproc_per_node, a key that may be null)
    resolve against the repository's config, each row as one run."""
    monkeypatch.chdir(REPO)
    examples = readme_runs_tables()
    assert len(examples) >= 4
    for index, (readme, block) in enumerate(examples):
        table = tmp_path / f"runs-{index}.tsv"
        table.write_text(block)
        config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
        config["runs"] = str(table)
        runs = load_experiment(config, environ={}).runs
        header, *rows = [line.split("\t") for line in block.splitlines()]
        assert len(runs) == len(rows), readme
        for row in rows:
            cells = dict(zip(header, row, strict=True))
            resolved = runs[cells.pop("run")]
            assert {key: str(resolved[key]) for key in cells} == cells, readme


def test_runs_table_cells_of_nullable_keys_parse_like_other_cells(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_text(
        "run\tstrategy\teval_every\tgrad_clip_norm\tpatience\tmerge_method\tmerge_weights\tinit_from\n"
        "set\tlocalsgd\t5\t1.5\t3\tweighted\t[1, 3]\t\n"
        "nulls\tlocalsgd\t5\tnull\tNone\tweighted\tnull\tnull\n"
        "empty\tlocalsgd\t5\t\t\tweighted\t\t\n"
    )
    runs = load_experiment(base_config(str(table)), environ={}).runs
    assert (runs["set"]["grad_clip_norm"], runs["set"]["patience"], runs["set"]["merge_weights"]) == (
        1.5,
        3,
        [1, 3],
    )
    for run in ("nulls", "empty"):
        assert [runs[run][key] for key in ("grad_clip_norm", "patience", "merge_weights", "init_from")] == [
            None
        ] * 4
    assert training_name(runs["nulls"]) == training_name(runs["empty"])


def number_keys() -> list[str]:
    """Run keys that hold numbers, or lists of numbers."""
    props = load_schema()["$defs"]["run"]["properties"]

    def types(prop):
        kind = prop.get("type", [])
        return set(kind) if isinstance(kind, list) else {kind}

    return sorted(
        key
        for key, prop in props.items()
        if "number" in types(prop) or "number" in types(prop.get("items", {}))
    )


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_every_number_key_refuses_nan_and_infinity(bad):
    keys = number_keys()
    assert {"lr", "dropout", "grad_clip_norm", "merge_density", "merge_weights", "betas"} <= set(keys)
    for key in keys:
        is_list = load_schema()["$defs"]["run"]["properties"][key].get("items")
        value = [0.5, bad] if is_list else bad
        with pytest.raises(ConfigError) as info:
            load_experiment(base_config({"r": {key: value}}), environ={})
        where = f"runs[r].{key}.1" if is_list else f"runs[r].{key}"
        assert f"config error at {where}: {bad} is not a finite number" in str(info.value)


def test_nan_in_run_defaults_and_model_args_is_refused():
    config = base_config({"r": {}})
    config["run_defaults"]["momentum"] = float("nan")
    with pytest.raises(ConfigError, match=r"at run_defaults\.momentum: nan is not a finite number"):
        load_experiment(config, environ={})
    with pytest.raises(ConfigError, match=r"runs\[r\]\.model_args\.dropout: inf is not a finite"):
        load_experiment(base_config({"r": {"model_args": {"dropout": float("inf")}}}), environ={})


@pytest.mark.parametrize("name", ["r\n", "r\n\n", "\nr", "r\t"])
def test_a_run_name_is_matched_in_full(name):
    with pytest.raises(ConfigError, match=r"run name .* is not allowed"):
        load_experiment(base_config({name: {}}), environ={})


def test_seed_bounds_are_what_torch_and_the_rank_seeds_take():
    """A seed passes the schema only if every rank's torch seed (train.py: seed x 1000003 + rank + 1)
    is a 64-bit integer; the other seeds are 64-bit integers too. torch itself checks the first."""
    import torch

    from shardfuse import io

    run_props = load_schema()["$defs"]["run"]["properties"]
    dataset_props = load_schema()["$defs"]["dataset"]["properties"]
    assert run_props["seed"]["maximum"] == MAX_RUN_SEED
    assert run_props["shard_seed"]["maximum"] == run_props["merge_seed"]["maximum"] == MAX_SEED
    assert dataset_props["seed"]["maximum"] == MAX_SEED == io.MAX_SEED == 2**63 - 1
    largest_rank_seed = MAX_RUN_SEED * RANK_SEED_STRIDE + 4095 + 1
    assert largest_rank_seed <= MAX_SEED < (MAX_RUN_SEED + 1) * RANK_SEED_STRIDE + 4096
    torch.manual_seed(largest_rank_seed)
    ok = load_experiment(base_config({"r": {"seed": MAX_RUN_SEED, "shard_seed": MAX_SEED}}), environ={})
    assert ok.runs["r"]["seed"] == MAX_RUN_SEED
    with pytest.raises(ConfigError, match=r"runs\[r\]\.seed: seed 9223344366822 is too large"):
        load_experiment(base_config({"r": {"seed": MAX_RUN_SEED + 1}}), environ={})
    config = base_config({"r": {}})
    config["datasets"]["digits"]["seed"] = 2**70
    with pytest.raises(ConfigError, match=r"datasets\.digits\.seed: seed 1180591620717411303424 is too"):
        load_experiment(config, environ={})


def test_runs_table_errors_name_the_file_line(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_text("# my sweep\nrun\tlr\n\na\t0.1\n# b is off\nb\t0.2\t7\n")
    with pytest.raises(ConfigError, match=r"runs\.tsv line 6 has more cells than the header"):
        load_experiment(base_config(str(table)), environ={})


CONFIG_TEXT = "datasets: {digits: {source: digits}}\nrun_defaults: {dataset: digits}\nruns: {r: {}}\n"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (
            CONFIG_TEXT + "datasets: {d: {source: digits}}\n",
            r"line 4: key 'datasets' appears twice at the top level \(first on line 1\)",
        ),
        (
            CONFIG_TEXT.replace("{source: digits}", "{source: digits, seed: 1,\n  seed: 2}"),
            r"line 2: key 'seed' appears twice under datasets\.digits \(first on line 1\)",
        ),
        (
            CONFIG_TEXT.replace("runs: {r: {}}", "runs: {r: {model_args: [{a: 1, a: 2}]}}"),
            r"key 'a' appears twice under runs\.r\.model_args\[0\]",
        ),
        (
            '{"datasets": {"digits": {"source": "digits"}}, "runs": {}, "runs": {}}',
            r"line 1: key 'runs' appears twice",
        ),
        (
            CONFIG_TEXT + "mlflow: !!python/name:os.system\n",
            r"line 4 uses the YAML tag !!python/name:os\.system, which is not allowed; plain YAML only",
        ),
        (CONFIG_TEXT + "mlflow: !custom {}\n", r"uses the YAML tag !custom, which is not allowed"),
        (
            "datasets: [a\n",
            r"line 2 is not valid YAML \(expected ',' or '\]', but got '<stream end>'\); fix the syntax",
        ),
        ("- a\n- b\n", r"holds a list, not a mapping of keys"),
    ],
    ids=["top_level", "nested", "in_a_list", "json", "python_tag", "local_tag", "syntax", "not_a_mapping"],
)
def test_config_files_are_read_strictly(tmp_path, text, message):
    path = tmp_path / "config.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=message) as info:
        read_config_file(path)
    assert "\n" not in str(info.value) and str(path) in str(info.value)
    with pytest.raises(ConfigError, match=message):  # as the Snakefile passes workflow.configfiles
        load_experiment(yaml.safe_load(CONFIG_TEXT), environ={}, config_files=[path])


def test_anchors_aliases_and_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "config.yaml"
    path.write_text(
        "datasets: {digits: {source: digits}}\n"
        "run_defaults: &base {dataset: digits, lr: 0.1}\n"
        "runs:\n  a: {<<: *base, lr: 0.2}\n  b: *base\n"
    )
    config = read_config_file(path)
    assert config["runs"]["a"] == {"dataset": "digits", "lr": 0.2}
    assert read_config_file(REPO / "config" / "config.yaml") == yaml.safe_load(
        (REPO / "config" / "config.yaml").read_text()
    )
    for example in (REPO / "config" / "examples").glob("*.yaml"):
        assert read_config_file(example) == yaml.safe_load(example.read_text())


def test_merge_align_reaches_the_merge_command_only_when_set():
    from shardfuse.experiment.keys import merge_align_args

    plain = {"merge_method": "uniform", "strategy": "localsgd"}
    experiment = load_experiment(
        base_config({"a": plain, "b": {**plain, "merge_align": "weight_matching"}}), environ={}
    )
    assert merge_align_args(experiment.runs["a"]) == ""  # the command of earlier runs is unchanged
    assert merge_align_args(experiment.runs["b"]) == "--align weight_matching"
    assert experiment.training("a") == experiment.training("b")  # alignment is a merge setting
    with pytest.raises(
        ConfigError, match="consolidate checks that the ranks are identical, there is nothing"
    ):
        load_experiment(base_config({"c": {"merge_method": "consolidate", "merge_align": "weight_matching"}}))


def test_an_alias_bomb_is_refused_before_anything_writes_it_out(tmp_path):
    """Nine aliases of nine aliases ... (a "billion laughs"): 490 million values once written out, from a
    file of 10 lines; refused from the node graph, each node counted once, before any key is checked."""
    text = 'a: &a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]\n'
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        text += f"{name}: &{name} [{', '.join([f'*{previous}'] * 9)}]\n"
    path = tmp_path / "bomb.yaml"
    path.write_text(text + "runs: {r: {epoch: 3}}\n")
    with pytest.raises(ConfigError) as refused:  # written out first, it would never end
        read_config_file(path)
    assert str(refused.value) == (
        f"config file {path} writes out to 490,329,070 values through its aliases (*name of an &name "
        "anchor), more than 1,000,000; write the values out or use fewer aliases"
    )
    path.write_text("common: &common {epochs: 2}\nruns: {r: {<<: *common}, s: {<<: *common}}\n")
    assert read_config_file(path)["runs"]["s"] == {"epochs": 2}  # aliases as the examples use them


def test_a_hidden_layer_too_wide_to_build_is_refused_when_the_config_loads():
    config = base_config({"r": {"hidden_sizes": [64, 1_000_000_000]}})
    with pytest.raises(
        ConfigError, match=r"runs\[r\]\.hidden_sizes\.1: 1000000000 is greater than the maximum of 65536"
    ):
        load_experiment(config, environ={})


def test_a_config_error_names_the_file_its_key_came_from(tmp_path):
    """Snakemake reads config/config.yaml, then each --configfile over it: an error said "fix it in
    config/config.yaml" for a key of the user's own file. It names the file that set the key (a run's
    key may come from run_defaults), and the location says which file when there are several."""
    from shardfuse.experiment.load import name_the_source

    default = ("config/config.yaml", {"run_defaults": {"lr": 0.05, "epochs": 10}, "mlflow": {"live": False}})
    mine = ("/home/me/sweep.yaml", {"run_defaults": {"lr": -0.1}, "runs": {"r": {"epochs": 0}}})
    both = [default, mine]
    assert name_the_source(
        "config error at run_defaults.lr: -0.1 is less than or equal to the minimum of 0; fix it in "
        "config/config.yaml",
        both,
    ) == (
        "config error at run_defaults.lr (in /home/me/sweep.yaml): -0.1 is less than or equal to the "
        "minimum of 0; fix it in /home/me/sweep.yaml"
    )
    assert name_the_source("config error at runs[r].epochs: 0 is less than the minimum of 1; x", both) == (
        "config error at runs[r].epochs (in /home/me/sweep.yaml): 0 is less than the minimum of 1; x"
    )
    assert name_the_source("config error at runs[q].lr: bad; x", both).startswith(
        "config error at runs[q].lr (in /home/me/sweep.yaml): "  # the run's lr is run_defaults'
    )
    assert name_the_source("config error at mlflow.live: bad; fix it in config/config.yaml", both) == (
        "config error at mlflow.live (in config/config.yaml): bad; fix it in config/config.yaml"
    )
    # One file, the user's (snakemake --configfile in a folder without config/config.yaml).
    assert name_the_source("config error at runs[r].epochs: 0; fix it in config/config.yaml", [mine]) == (
        "config error at runs[r].epochs: 0; fix it in /home/me/sweep.yaml"
    )
    assert name_the_source("config error at runs[r].epochs: 0; fix it in config/config.yaml", [default]) == (
        "config error at runs[r].epochs: 0; fix it in config/config.yaml"
    )
    table = "config error at runs[r].epochs: 0 is less than the minimum of 1; fix that cell in my_runs.tsv"
    assert name_the_source(table, both) == table  # the runs table is the file, and it is named
