"""The model registry, the tasks and the config keys that name them (fast: no torchrun, no snakemake)."""

from __future__ import annotations

import json
import math

import pytest
import torch
import yaml

from shardfuse.checkpoints.weights import save_weights
from shardfuse.experiment.keys import train_config, training_name
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError
from shardfuse.models.mlp import Standardized
from shardfuse.models.registry import build_model, check_output_shape
from shardfuse.models.spec import DataDescription, model_spec
from shardfuse.models.tasks import Totals, task_for
from shardfuse.models.usercode import check_code_unchanged, code_fingerprint, load_factory
from tests.support.data import CLASSIFICATION_INFO
from tests.support.helpers import REPO

REGRESSION_INFO = {
    "task": "regression",
    "num_features": 5,
    "num_classes": 0,
    "feature_names": [f"x{i}" for i in range(5)],
    "label_names": [],
    "target_names": ["y_a", "y_b"],
}
LM_INFO = {
    "task": "causal_lm",
    "num_features": 9,
    "num_classes": 0,
    "feature_names": [f"t{i}" for i in range(9)],
    "label_names": [],
    "vocab_size": 256,
    "block_size": 8,
}
USER_CODE = """
from torch import nn


class Bigram(nn.Module):
    def __init__(self, vocab_size):
        super().__init__()
        self.embed = nn.Embedding(vocab_size, vocab_size)

    def forward(self, tokens):
        return self.embed(tokens)


def build(description, width=8):
    if description.task == "causal_lm":
        return Bigram(description.vocab_size)
    return nn.Sequential(nn.Linear(description.num_features, width), nn.ReLU(),
                         nn.Linear(width, description.num_outputs))


def wrong_width(description):
    return nn.Linear(description.num_features, description.num_outputs + 1)


def not_a_module(description):
    return "a string"


NOT_CALLABLE = 3
"""


@pytest.fixture
def user_code(tmp_path, monkeypatch):
    """A code path with a user module, the working directory set to its parent (as in a workflow)."""
    code = tmp_path / "models"
    code.mkdir()
    (code / "usernets.py").write_text(USER_CODE)
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(code))
    yield "models"
    import sys

    sys.modules.pop("usernets", None)


# ---------------------------------------------------------------- tasks


def test_regression_metrics_match_scikit_learn():
    from sklearn.metrics import mean_absolute_error, mean_squared_error, r2_score

    generator = torch.Generator().manual_seed(0)
    targets = torch.randn(101, 3, generator=generator) * torch.tensor([1.0, 10.0, 0.1])
    outputs = targets + 0.3 * torch.randn(101, 3, generator=generator)
    task, totals = task_for("regression"), Totals()
    for start in range(0, 101, 17):  # batch by batch, as evaluation does
        task.accumulate(totals, outputs[start : start + 17], targets[start : start + 17])
    metrics = task.finish(totals)
    y, p = targets.double().numpy(), outputs.double().numpy()
    assert metrics["mse"] == pytest.approx(mean_squared_error(y, p), rel=1e-12)
    assert metrics["mae"] == pytest.approx(mean_absolute_error(y, p), rel=1e-12)
    assert metrics["r2"] == pytest.approx(r2_score(y, p), rel=1e-9)


def test_causal_lm_metrics_are_per_token_cross_entropy():
    logits = torch.randn(3, 5, 7, generator=torch.Generator().manual_seed(1))
    tokens = torch.randint(0, 7, (3, 6), generator=torch.Generator().manual_seed(2)).float()
    task, totals = task_for("causal_lm"), Totals()
    inputs, targets = task.batch(tokens, torch.empty(3, 0))
    assert torch.equal(inputs, tokens[:, :-1].long()) and torch.equal(targets, tokens[:, 1:].long())
    task.accumulate(totals, logits, targets)
    metrics = task.finish(totals)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), targets.reshape(-1)).item()
    assert metrics["loss"] == pytest.approx(expected, rel=1e-6)
    assert metrics["perplexity"] == pytest.approx(math.exp(expected), rel=1e-6)
    assert metrics["bits_per_token"] == pytest.approx(expected / math.log(2), rel=1e-6)


def test_lower_is_better_decides_gain_best_and_order():
    regression, classification = task_for("regression"), task_for("classification")
    assert regression.gain(merged=1.0, reference=3.0) == 2.0  # merged mse lower: a positive gain
    assert classification.gain(merged=0.9, reference=0.8) == pytest.approx(0.1)
    assert regression.best([3.0, 1.0, 2.0]) == 1.0 and classification.best([0.3, 0.9]) == 0.9
    assert sorted([3.0, 1.0, 2.0], key=regression.sort_key) == [1.0, 2.0, 3.0]
    assert regression.better(1.0, 1.0) and not regression.better(1.1, 1.0)


def test_regression_loss_is_measured_in_units_of_the_target_std():
    task = task_for("regression", target_scale=torch.tensor([10.0]))
    loss = task.loss(torch.tensor([[20.0]]), torch.tensor([[0.0]]))
    assert loss.item() == pytest.approx(4.0)  # (20 / 10)^2
    huber = task_for("regression", loss="huber", target_scale=torch.tensor([10.0]))
    assert huber.loss(torch.tensor([[20.0]]), torch.tensor([[0.0]])).item() == pytest.approx(1.5)


# ---------------------------------------------------------------- registry


def test_builtin_mlp_spec_keeps_the_run_keys():
    spec = model_spec(
        "mlp", {}, [], CLASSIFICATION_INFO, {"hidden_sizes": [5], "activation": "tanh", "dropout": 0}
    )
    assert spec["args"] == {"hidden_sizes": [5], "activation": "tanh", "dropout": 0}
    assert spec["code"] is None and spec["description"]["label_names"] == ["cat", "dog", "eel"]
    model = build_model(spec)
    assert [tuple(t.shape) for t in model.state_dict().values()] == [(4,), (4,), (5, 4), (5,), (3, 5), (3,)]


def test_legacy_mlp_spec_builds_the_same_network():
    legacy = {"type": "mlp", "num_features": 4, "num_classes": 3, "hidden_sizes": [5], "activation": "relu"}
    legacy["dropout"] = 0.0
    torch.manual_seed(0)
    old = build_model(legacy).state_dict()
    torch.manual_seed(0)
    new = build_model(model_spec("mlp", {"hidden_sizes": [5]}, [], CLASSIFICATION_INFO)).state_dict()
    assert list(old) == list(new) and all(torch.equal(old[k], new[k]) for k in old)


def test_user_model_is_wrapped_with_standardisation_and_regression_scale(user_code):
    spec = model_spec("usernets:build", {"width": 6}, [user_code], REGRESSION_INFO)
    model = build_model(spec)
    assert isinstance(model, Standardized)
    assert {"input_mean", "input_scale", "target_mean", "target_scale", "model.0.weight"} <= set(
        model.state_dict()
    )
    check_output_shape(model, spec, torch.device("cpu"))
    assert spec["code"]["files"] == {"models/usernets.py": spec["code"]["files"]["models/usernets.py"]}
    assert DataDescription.from_info(REGRESSION_INFO).num_outputs == 2


def test_user_causal_lm_model_gets_token_batches_without_wrapper(user_code):
    spec = model_spec("usernets:build", {}, [user_code], LM_INFO)
    model = build_model(spec)
    assert not isinstance(model, Standardized)
    check_output_shape(model, spec, torch.device("cpu"))


@pytest.mark.parametrize(
    ("ref", "message"),
    [
        ("nosuchmodule:build", r"module 'nosuchmodule' does not import \(ModuleNotFoundError"),
        ("usernets:missing", "has no callable 'missing'"),
        ("usernets:NOT_CALLABLE", "has no callable 'NOT_CALLABLE'"),
        ("usernets", "neither a built-in .* nor an import path"),
    ],
)
def test_bad_model_references_are_one_line_errors(user_code, ref, message):
    with pytest.raises(UserError, match=message) as caught:
        load_factory(ref, [user_code])
    assert "\n" not in str(caught.value)


def test_factory_returning_no_module_or_wrong_shape_is_caught_before_training(user_code):
    with pytest.raises(UserError, match=r"returned str, not a torch\.nn\.Module"):
        build_model(model_spec("usernets:not_a_module", {}, [user_code], CLASSIFICATION_INFO))
    spec = model_spec("usernets:wrong_width", {}, [user_code], CLASSIFICATION_INFO)
    with pytest.raises(UserError, match=r"returns shape \[2, 4\] .* task classification needs \[2, 3\]"):
        check_output_shape(build_model(spec), spec, torch.device("cpu"))
    with pytest.raises(UserError, match=r"rejected its arguments .* fix `model_args`"):
        build_model(model_spec("usernets:build", {"depth": 3}, [user_code], CLASSIFICATION_INFO))


def test_changed_user_code_is_named_by_later_stages(user_code, tmp_path):
    fingerprint = code_fingerprint("usernets:build", [user_code])
    check_code_unchanged("usernets:build", fingerprint, "merge")  # unchanged: no error
    (tmp_path / "models" / "usernets.py").write_text(USER_CODE + "\n# edited\n")
    with pytest.raises(UserError, match=r"user model code models/usernets.py changed since training"):
        check_code_unchanged("usernets:build", fingerprint, "merge")


# ---------------------------------------------------------------- config


def experiment(tmp_path, runs, datasets=None, defaults=None):
    config = yaml.safe_load((REPO / "config" / "config.yaml").read_text())
    config["runs"] = runs
    config["datasets"].update(datasets or {})
    config["run_defaults"].update(defaults or {})
    return load_experiment(config)


def test_default_keys_leave_training_names_and_commands_unchanged(tmp_path):
    found = experiment(tmp_path, {"a": {}, "b": {"model": "mlp", "model_args": {}, "init_from": None}})
    assert found.training("a") == found.training("b")
    command = train_config(found.runs["a"])
    assert not {"model", "model_args", "code_paths", "loss", "init_from", "code_digest"} & set(command)


def test_model_code_and_init_change_the_training_name(tmp_path, user_code):
    found = experiment(
        tmp_path,
        {
            "plain": {},
            "user": {"model": "usernets:build", "code_paths": [user_code]},
            "tuned": {"init_from": "run:plain"},
        },
    )
    names = {training_name(cfg) for cfg in found.runs.values()}
    assert len(names) == 3
    assert found.runs["user"]["code_digest"] == code_fingerprint("usernets:build", [user_code])["digest"]
    assert found.runs["tuned"]["init_source"]["training"] == found.training("plain")
    (tmp_path / "models" / "usernets.py").write_text(USER_CODE + "\n# edited\n")
    edited = experiment(tmp_path, {"user": {"model": "usernets:build", "code_paths": [user_code]}})
    assert edited.training("user") != found.training("user")


@pytest.mark.parametrize(
    ("runs", "message"),
    [
        ({"a": {"init_from": "run:b"}}, r"runs\[a\].init_from: no run named 'b'"),
        (
            {"a": {"init_from": "run:b"}, "b": {"init_from": "run:a"}},
            r"initialise each other in a cycle \(a -> b -> a\)",
        ),
        ({"a": {"init_from": "nope.safetensors"}}, r"init_from: nope.safetensors is not a file"),
        ({"a": {"model": "nosuch:build"}}, r"runs\[a\].model: model 'nosuch:build': module 'nosuch'"),
        ({"a": {"loss": "huber"}}, r"runs\[a\].loss: huber is a regression loss but dataset 'digits'"),
        ({"a": {"code_paths": ["nowhere"]}}, r"code path 'nowhere' is not a directory"),
    ],
)
def test_bad_model_and_init_keys_fail_before_any_job(tmp_path, monkeypatch, runs, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message) as caught:
        experiment(tmp_path, runs)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize(
    ("dataset", "message"),
    [
        ({"source": "digits", "task": "regression"}, r"source digits gives classification data"),
        (
            {"source": "synthetic", "num_rows": 100, "num_features": 3, "task": "regression"},
            "needs `num_outputs`",
        ),
        (
            {"source": "csv", "path": "x.csv", "feature_columns": ["a"], "task": "regression"},
            "needs `label_columns`",
        ),
        ({"source": "diabetes", "classes": [1]}, r"classes: only classification datasets use it"),
        (
            {
                "source": "synthetic",
                "num_rows": 100,
                "num_features": 3,
                "task": "regression",
                "num_outputs": 1,
                "num_classes": 3,
            },
            r"num_classes: only classification datasets use it but task is regression",
        ),
    ],
)
def test_dataset_task_keys_are_checked(tmp_path, dataset, message):
    with pytest.raises(ConfigError, match=message):
        experiment(tmp_path, {"a": {"dataset": "mine"}}, datasets={"mine": dataset})


def test_model_args_from_a_runs_table_cell(tmp_path, monkeypatch, user_code):
    table = tmp_path / "runs.tsv"
    table.write_text('run\tmodel\tcode_paths\tmodel_args\nuser\tusernets:build\tmodels\t{"width": 4}\n')
    found = experiment(tmp_path, str(table))
    assert found.runs["user"]["model_args"] == {"width": 4} and found.runs["user"]["code_paths"] == ["models"]


def test_init_from_file_mismatch_names_the_first_tensor(tmp_path):
    from shardfuse.rank.setup import load_init_weights

    spec = model_spec("mlp", {"hidden_sizes": [5]}, [], CLASSIFICATION_INFO)
    other = build_model(model_spec("mlp", {"hidden_sizes": [6]}, [], CLASSIFICATION_INFO))
    save_weights(tmp_path / "other.safetensors", other.state_dict(), {"model": spec})
    with pytest.raises(
        UserError, match=r"tensor 'net.0.weight' is torch.float32 \[6, 4\] but the model needs"
    ):
        load_init_weights(build_model(spec), tmp_path / "other.safetensors")
    same = build_model(spec)
    save_weights(tmp_path / "same.safetensors", same.state_dict(), {"model": spec})
    fresh = build_model(spec)
    load_init_weights(fresh, tmp_path / "same.safetensors")
    assert all(
        torch.equal(a, b)
        for a, b in zip(fresh.state_dict().values(), same.state_dict().values(), strict=True)
    )
    assert json.loads(json.dumps(spec)) == spec  # the spec travels as JSON in checkpoint headers


def test_the_fingerprint_hashes_what_the_model_imports_not_every_file_beside_it(tmp_path, monkeypatch):
    code = tmp_path / "code"
    (code / "pkg").mkdir(parents=True)
    (code / "net.py").write_text("import json\nfrom pkg import blocks\nfrom pkg.layers import dense\n")
    (code / "pkg" / "__init__.py").write_text("")
    (code / "pkg" / "blocks.py").write_text("from .layers import dense\n")
    (code / "pkg" / "layers.py").write_text("def dense(): ...\n")
    (code / "unrelated.py").write_text("x = 1\n")
    monkeypatch.chdir(tmp_path)
    before = code_fingerprint("net:build", ["code"])
    assert sorted(before["files"]) == [
        "code/net.py",
        "code/pkg/__init__.py",
        "code/pkg/blocks.py",
        "code/pkg/layers.py",
    ]
    (code / "unrelated.py").write_text("x = 2\n")
    (code / "another.py").write_text("y = 1\n")
    assert code_fingerprint("net:build", ["code"])["digest"] == before["digest"]  # nothing the model runs
    (code / "pkg" / "layers.py").write_text("def dense(): return 1\n")
    assert code_fingerprint("net:build", ["code"])["digest"] != before["digest"]  # imported twice removed
