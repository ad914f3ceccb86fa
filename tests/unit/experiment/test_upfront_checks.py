"""Issue 29: what a held-out check found only after training (or never) is refused when the config
loads: names that are not strings or do not fit a file name, a one-class classifier, merge_align on a
model without permutation groups, a registered model name MLflow refuses; a runs.tsv BOM is dropped."""

from __future__ import annotations

import errno
import os

import pytest

from shardfuse.experiment import init_check
from shardfuse.experiment.keys import LONGEST_FILE_OF_NAME, MAX_NAME_LENGTH, NAME_MAX
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.model_checks import check_align, check_registered_model
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import write_json
from shardfuse.models.catalog import aligned_names
from tests.support.helpers import base_config


def config_with(runs=None, datasets=None, **top) -> dict:
    config = base_config(runs if runs is not None else {"r": {}})
    if datasets is not None:
        config["datasets"] = datasets
    return {**config, **top}


def test_the_name_bound_is_the_longest_file_the_workflow_writes_from_a_name(tmp_path):
    if os.pathconf(tmp_path, "PC_NAME_MAX") != NAME_MAX:
        pytest.skip("this filesystem's NAME_MAX is not 255")
    assert len(LONGEST_FILE_OF_NAME.replace("NAME", "n" * MAX_NAME_LENGTH)) == NAME_MAX
    inputs = tmp_path / ".snakemake" / "shardfuse" / "inputs"
    write_json(inputs / f"{'n' * MAX_NAME_LENGTH}.json", {})  # io.atomic_path's sibling fits
    with pytest.raises(OSError) as caught:
        write_json(inputs / f"{'n' * (MAX_NAME_LENGTH + 1)}.json", {})
    assert caught.value.errno == errno.ENAMETOOLONG
    load_experiment(config_with({"n" * MAX_NAME_LENGTH: {}}), environ={})
    with pytest.raises(ConfigError, match=f"at most {MAX_NAME_LENGTH} fit"):
        load_experiment(config_with({"n" * (MAX_NAME_LENGTH + 1): {}}), environ={})


def test_a_dataset_name_whose_training_name_is_too_long_is_refused_with_the_length_it_may_have():
    name = "d" * (MAX_NAME_LENGTH - 5)
    config = config_with(datasets={name: {"source": "digits"}})
    config["run_defaults"]["dataset"] = name
    with pytest.raises(ConfigError) as caught:
        load_experiment(config, environ={})
    assert "runs[r].dataset: its training name" in str(caught.value)
    limit = MAX_NAME_LENGTH - len("-w2-ddp-") - 10  # this run's training name: dataset-w2-ddp-<digest>
    assert str(caught.value).endswith(f"shorten the dataset's name to at most {limit} characters")


@pytest.mark.parametrize("name", [8, True, None, 2024])
@pytest.mark.parametrize("kind", ["run", "dataset"])
def test_a_name_yaml_did_not_read_as_text_is_refused_with_a_hint_to_quote_it(kind, name):
    config = config_with({name: {}}) if kind == "run" else config_with(datasets={name: {"source": "digits"}})
    with pytest.raises(ConfigError) as caught:
        load_experiment(config, environ={})
    assert str(caught.value).startswith(f"config error at {kind}s: {kind} name {name!r} is not a string: ")
    assert "quote it" in str(caught.value)


def test_a_runs_table_with_a_byte_order_mark_reads_its_run_column(tmp_path):
    table = tmp_path / "runs.tsv"
    table.write_bytes("run\tlr\nr\t0.5\n".encode("utf-8-sig"))
    assert load_experiment(config_with(str(table)), environ={}).runs["r"]["lr"] == 0.5


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "digits"},
        {"source": "digits_images"},
        {"source": "synthetic", "num_rows": 100, "num_features": 4, "num_classes": 3},
        {"source": "csv", "path": "x.csv", "feature_columns": ["a"], "label_column": "y"},
        {"source": "image_folder", "path": "images", "image_size": [8, 8]},
    ],
)
def test_one_class_is_refused_for_every_classification_source(spec):
    with pytest.raises(ConfigError, match=r"classes: \[3\] keeps a single class"):
        load_experiment(config_with(datasets={"digits": {**spec, "classes": [3]}}), environ={})


def test_registered_model_names_are_refused_exactly_where_mlflow_refuses_them():
    from mlflow.exceptions import MlflowException
    from mlflow.store.model_registry.file_store import _validate_model_name

    names = ["digits", "my model", "a.b-c_d", "ünïcode", " ", "team/digits", "a:b", "50%", ".", "..", "..x"]
    names += ["x..", "a.", ".hidden"]
    for name in names:
        try:
            _validate_model_name(name)
            mlflow_refuses = False
        except MlflowException:
            mlflow_refuses = True
        try:
            check_registered_model(name)
            refused = False
        except ConfigError:
            refused = True
        assert refused == mlflow_refuses, name


def test_the_builtins_the_config_aligns_name_a_groups_function_merge_can_import():
    from shardfuse.models import catalog

    assert set(aligned_names()) == {"mlp", "cnn"}
    for name in aligned_names():  # the record's module:function imports; no tensors, no groups
        assert catalog.builtin(name).permutation_groups([]) == {}


@pytest.mark.parametrize("model", ["transformer", "hf"])
def test_merge_align_on_a_builtin_without_groups_is_refused_without_a_subprocess(model, monkeypatch):
    monkeypatch.setattr(init_check.subprocess, "run", None)  # calling it would fail
    run = {"merge_align": "weight_matching", "strategy": "localsgd", "model": model}
    with pytest.raises(ConfigError, match=f"'{model}' does not; set merge_align: none"):
        check_align("r", run, {})


GROUPED = """
import torch.nn as nn


class Net(nn.Module):
    def __init__(self, num_features, num_outputs):
        super().__init__()
        self.fc1 = nn.Linear(num_features, 8)
        self.fc2 = nn.Linear(8, num_outputs)

    def forward(self, x):
        return self.fc2(self.fc1(x).relu())

    def permutation_groups(self):
        return {"h": [("fc1.weight", 0), ("fc1.bias", 0), ("fc2.weight", 1)]}


def build(description):
    return Net(description.num_features, description.num_outputs)
"""


def test_a_user_model_with_permutation_groups_aligns_and_its_pass_is_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    (tmp_path / "models" / "grouped.py").write_text(GROUPED)
    run = {"model": "grouped:build", "code_paths": ["models"], "merge_align": "weight_matching"}
    run.update(strategy="localsgd", init="per_rank", merge_method="uniform")
    config = config_with({"r": run})
    assert load_experiment(config, environ={}).runs["r"]["merge_align"] == "weight_matching"
    (cached,) = (tmp_path / init_check.CACHE_DIR).glob("*.json")
    assert cached.read_text().replace(" ", "").replace("\n", "") == '{"checked":true,"groups":1}'
    monkeypatch.setattr(init_check.subprocess, "run", None)  # the cached pass: no subprocess
    load_experiment(config, environ={})
