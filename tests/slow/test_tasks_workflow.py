"""Every task x {ddp, localsgd without sync} through the whole workflow, as a user runs it: real data
(scikit-learn's iris with its string class names, a synthetic multi-output regression, the Python
standard library's own source as a byte-level corpus), a user model from a code path, init_from another
run, tracked in a real MLflow store."""

from __future__ import annotations

import csv
import json
import sysconfig
from pathlib import Path

import pytest
import torch
import yaml

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import planned_jobs, snakemake
from tests.support.tracking import mlflow_tracking_uri

# A whole experiment in one fixture: 530-610 s on a slow 2-core machine, near the default 900 s limit.
pytestmark = pytest.mark.timeout(1800)

# A user module, as a researcher would write one: a classifier/regressor and a tiny causal LM.
USER_MODELS = '''
import torch
from torch import nn


class TinyLM(nn.Module):
    """Token and position embeddings, one causal self-attention layer, a tied read-out."""

    def __init__(self, vocab_size, block_size, width):
        super().__init__()
        self.tokens = nn.Embedding(vocab_size, width)
        self.positions = nn.Embedding(block_size, width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)
        self.norm = nn.LayerNorm(width)

    def forward(self, tokens):
        length = tokens.shape[1]
        hidden = self.tokens(tokens) + self.positions(torch.arange(length, device=tokens.device))
        mask = torch.triu(torch.ones(length, length, dtype=torch.bool, device=tokens.device), 1)
        attended, _ = self.attention(hidden, hidden, hidden, attn_mask=mask, need_weights=False)
        return self.norm(hidden + attended) @ self.tokens.weight.T


def build(description, width=16):
    if description.task == "causal_lm":
        return TinyLM(description.vocab_size, description.block_size, width)
    return nn.Sequential(
        nn.Linear(description.num_features, width), nn.Tanh(), nn.Linear(width, description.num_outputs)
    )
'''
STDLIB_JSON = str(Path(sysconfig.get_paths()["stdlib"]) / "json" / "*.py")
TASK_OF = {"iris": "classification", "multi": "regression", "stdlib": "causal_lm"}
SCORE_OF = {"iris": "accuracy", "multi": "mse", "stdlib": "loss"}
USER_MODEL = {"model": "usernets:build", "code_paths": ["models"]}
# numeric columns with a user model and the built-in MLP; byte tokens with a user LM. Images (a tensor
# column) with the built-in CNN are the README's digits_cnn example (tests/slow/test_examples_kinds.py:
# its merge's BatchNorm statistics and its logged model's image signature).
MODEL_OF = {"iris": USER_MODEL, "multi": {}, "stdlib": USER_MODEL}
TRANSFORMER = {"model": "transformer", "model_args": {"width": 32, "layers": 1, "heads": 2}}


def write_iris(path: Path) -> None:
    from sklearn.datasets import load_iris

    iris = load_iris()
    with open(path, "w", newline="") as fh:
        writer = csv.writer(fh)
        writer.writerow([*iris.feature_names, "species"])
        for row, target in zip(iris.data, iris.target, strict=True):
            writer.writerow([*row, iris.target_names[target]])


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tasks")
    (path / "models").mkdir()
    (path / "models" / "usernets.py").write_text(USER_MODELS)
    write_iris(path / "iris.csv")
    runs = {}
    for data in TASK_OF:
        model = MODEL_OF[data]
        runs[f"{data}_ddp"] = {"dataset": data, "strategy": "ddp", "merge_method": "consolidate", **model}
        runs[f"{data}_indep"] = {"dataset": data, "strategy": "localsgd", "merge_method": "uniform", **model}
    runs["stdlib_transformer"] = {
        "dataset": "stdlib",
        "strategy": "localsgd",
        "sync_every": 4,
        "merge_method": "uniform",
        **TRANSFORMER,
    }
    runs["iris_tuned"] = {
        "dataset": "iris",
        "strategy": "localsgd",
        "merge_method": "task_arithmetic",
        "init_from": "run:iris_ddp",
        "model": "usernets:build",
        "code_paths": ["models"],
    }
    config = {
        "runs": runs,
        "datasets": {
            "iris": {
                "source": "csv",
                "path": "iris.csv",
                "feature_columns": ["sepal length (cm)", "sepal width (cm)", "petal length (cm)"],
                "label_column": "species",
            },
            "multi": {"source": "synthetic", "task": "regression", "num_rows": 600, "num_features": 4},
            "stdlib": {"source": "text", "paths": [STDLIB_JSON], "block_size": 16, "max_tokens": 12000},
        },
        "run_defaults": {"world_size": 2, "epochs": 3, "batch_size": 32, "optimizer": "adamw", "lr": 0.01},
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db", "experiment": "tasks"},
    }
    config["datasets"]["multi"]["num_outputs"] = 3
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(path)
    return path


def evaluation(workdir: Path, run: str) -> dict:
    return json.loads((workdir / "results" / "runs" / run / "eval.json").read_text())


@pytest.mark.parametrize("data", sorted(TASK_OF))
@pytest.mark.parametrize("strategy", ["ddp", "indep"])
def test_every_task_trains_merges_and_evaluates_with_its_own_metrics(workdir, data, strategy):
    from shardfuse.models.tasks import task_for

    task = task_for(TASK_OF[data])
    found = evaluation(workdir, f"{data}_{strategy}")
    assert (found["task"], found["score"]) == (task.name, SCORE_OF[data])
    assert set(found["merged"]) == set(task.metrics) == set(found["base"])
    assert all(set(rank) == {"rank", *task.metrics} for rank in found["ranks"])
    # Training taught something: the merged model beats the untrained initial one on the task's score.
    assert task.gain(found["merged"][task.score], found["base"][task.score]) > 0
    if strategy == "ddp":
        assert found["fusion_gain"] == 0.0  # consolidate keeps the (identical) ranks


def test_summary_has_each_tasks_columns(workdir):
    with open(workdir / "results" / "experiments" / "tasks" / "summary.csv", newline="") as fh:
        rows = {row["run"]: row for row in csv.DictReader(fh)}
    assert rows["iris_ddp"]["test_accuracy_merged"] and not rows["iris_ddp"]["test_mse_merged"]
    assert rows["multi_indep"]["test_mse_merged"] and rows["multi_indep"]["test_r2_merged"]
    assert not rows["multi_indep"]["test_accuracy_merged"]
    assert (
        float(rows["multi_indep"]["test_mse_ddp_baseline"])
        == evaluation(workdir, "multi_ddp")["merged"]["mse"]
    )
    assert rows["stdlib_ddp"]["test_perplexity_merged"] and rows["stdlib_ddp"]["task"] == "causal_lm"


def test_mlflow_has_each_tasks_metrics_and_the_user_model_predicts_string_labels(workdir):
    import mlflow
    import pandas as pd
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("tasks")
    parents = {
        r.info.run_name: r
        for r in client.search_runs([experiment.experiment_id], "tags.`shardfuse.complete` = 'true'")
    }
    assert {"iris_ddp", "multi_indep", "stdlib_indep"} <= set(parents)
    assert "test_r2_merged" in parents["multi_indep"].data.metrics
    assert "test_accuracy_merged" not in parents["multi_indep"].data.metrics
    assert "test_bits_per_token_merged" in parents["stdlib_indep"].data.metrics
    assert parents["iris_indep"].data.params["model"] == "usernets:build"

    with mlflow_tracking_uri(f"sqlite:///{workdir}/mlflow.db"):
        _loaded_models_predict(mlflow, pd, parents)


def _loaded_models_predict(mlflow, pd, parents) -> None:
    model = mlflow.pyfunc.load_model(f"runs:/{parents['iris_indep'].info.run_id}/iris_indep")
    frame = pd.DataFrame(
        {"sepal length (cm)": [5.0, 6.7], "sepal width (cm)": [3.4, 3.0], "petal length (cm)": [1.5, 5.6]}
    )
    predicted = model.predict(frame)
    assert set(predicted["prediction"]) <= {"setosa", "versicolor", "virginica"}
    assert predicted["prediction"][0] == "setosa"
    assert {"probability_setosa", "probability_versicolor", "probability_virginica"} <= set(predicted.columns)


def test_init_from_a_run_starts_from_its_merged_model_and_follows_its_merge(workdir):
    tuned = evaluation(workdir, "iris_tuned")
    base, _ = load_weights(
        workdir / "results" / "trainings" / tuned["training"] / "ranks" / "base.safetensors"
    )
    merged, _ = load_weights(workdir / "results" / "runs" / "iris_ddp" / "merged.safetensors")
    assert base.keys() == merged.keys() and all(torch.equal(base[k], merged[k]) for k in base)
    # Re-running the pretrained run's merge re-trains the run that starts from it (a DAG edge).
    plan = snakemake(workdir, "-n", "--forcerun", "results/runs/iris_ddp/merged.safetensors")
    assert planned_jobs(plan.stdout).get("train") == 1


def test_builtin_transformer_trains_on_bytes_and_its_tied_embedding_is_one_tensor(workdir):
    found = evaluation(workdir, "stdlib_transformer")
    assert found["merged"]["bits_per_byte"] == pytest.approx(found["merged"]["bits_per_token"])
    assert found["merged"]["loss"] < found["base"]["loss"]
    merged, metadata = load_weights(
        workdir / "results" / "runs" / "stdlib_transformer" / "merged.safetensors"
    )
    embeddings = [name for name, t in merged.items() if tuple(t.shape) == (256, 32)]
    assert len(embeddings) == 1, embeddings  # the read-out shares the token embedding: stored once
    assert metadata["model"]["model"] == "transformer"
