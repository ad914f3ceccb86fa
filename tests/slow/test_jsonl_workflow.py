"""Supervised fine-tuning from JSON Lines through the whole workflow, as a user runs it: prompt/completion
records made from the Python standard library (a function's signature as the prompt, the first paragraph
of its docstring as the completion), a ddp and an independent 2-rank training of the built-in
transformer with the completion-only loss, merged, evaluated and tracked. The merged model's test loss in
eval.json is recomputed by hand from merged.safetensors and test.parquet: the mean next-token
cross-entropy over the completion tokens only."""

from __future__ import annotations

import csv
import importlib
import inspect
import json
from pathlib import Path

import mlflow
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from shardfuse.scoring.scorer import model_from_file
from tests.support.helpers import snakemake

pytestmark = pytest.mark.timeout(900)
MODULES = (
    "json", "textwrap", "shlex", "fnmatch", "glob", "base64", "difflib", "shutil", "inspect", "posixpath"
)  # fmt: skip


def write_pairs(path: Path) -> int:
    """Prompt/completion pairs in ``path``; the same completions labelled by their module (text
    classification: which module's docstring is this?) beside it in kinds.jsonl."""
    count = 0
    with open(path, "w") as file, open(path.with_name("kinds.jsonl"), "w") as kinds:
        for name in MODULES:
            module = importlib.import_module(name)
            for function_name, function in inspect.getmembers(module, inspect.isfunction):
                if function_name.startswith("_") or not function.__doc__:
                    continue
                try:
                    signature = inspect.signature(function)
                except (TypeError, ValueError):
                    continue
                prompt = f"def {name}.{function_name}{signature}:\n"
                completion = inspect.cleandoc(function.__doc__).split("\n\n")[0]
                file.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
                kinds.write(json.dumps({"text": completion, "module": name}) + "\n")
                count += 1
    return count


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("sft")
    assert write_pairs(path / "pairs.jsonl") > 100
    config = {
        "datasets": {
            "pairs": {
                "source": "jsonl",
                "paths": ["pairs.jsonl"],
                "prompt_field": "prompt",
                "completion_field": "completion",
                "block_size": 32,
            },
            "kinds": {
                "source": "jsonl",
                "task": "classification",
                "paths": ["kinds.jsonl"],
                "label_field": "module",
                "block_size": 48,
            },
        },
        "runs": {
            "sft_ddp": {"strategy": "ddp", "merge_method": "consolidate"},
            "sft_indep": {"strategy": "localsgd", "sync_every": 0, "merge_method": "uniform"},
            "kinds_uniform": {
                "dataset": "kinds",
                "strategy": "localsgd",
                "sync_every": 0,
                "merge_method": "uniform",
                "epochs": 5,
            },
        },
        "run_defaults": {
            "dataset": "pairs",
            "world_size": 2,
            "model": "transformer",
            "model_args": {"width": 32, "layers": 1, "heads": 2},
            "optimizer": "adamw",
            "lr": 0.003,
            "batch_size": 16,
            "epochs": 3,
        },
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db", "experiment": "sft"},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(path)
    return path


def test_the_prepared_splits_mask_the_prompts(workdir):
    info = json.loads((workdir / "results" / "datasets" / "pairs" / "dataset.json").read_text())
    assert info["source"] == "jsonl" and 0 < info["loss_tokens"] < info["num_tokens"]
    assert "loss_mask" in pq.read_schema(workdir / "results" / "datasets" / "pairs" / "test.parquet").names
    shards = sorted((workdir / "results" / "shards" / "pairs").glob("*/shard-*.parquet"))
    assert len(shards) == 2 and all(
        pq.read_schema(shard).names == ["tokens", "loss_mask"] for shard in shards
    )


@pytest.mark.parametrize("run", ["sft_ddp", "sft_indep"])
def test_the_merged_test_loss_is_the_mean_over_completion_tokens_only(workdir, run):
    evaluation = json.loads((workdir / "results" / "runs" / run / "eval.json").read_text())
    model = model_from_file(workdir / "results" / "runs" / run / "merged.safetensors").module
    table = pq.read_table(workdir / "results" / "datasets" / "pairs" / "test.parquet")
    tokens = torch.tensor(table.column("tokens").to_pylist(), dtype=torch.long)
    mask = torch.tensor(table.column("loss_mask").to_pylist(), dtype=torch.bool)
    with torch.no_grad():
        logits = model(tokens[:, :-1]).float()
    losses = torch.nn.functional.cross_entropy(
        logits.reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), reduction="none"
    ).reshape(mask.shape)
    by_hand = (losses[mask].double().sum() / mask.sum()).item()
    unmasked = losses.double().mean().item()
    assert evaluation["merged"]["loss"] == pytest.approx(by_hand, rel=1e-5)
    assert abs(by_hand - unmasked) > 1e-3  # the prompts' tokens would have changed it
    # Training taught the completions something: the merged model beats the untrained initial one.
    assert evaluation["merged"]["loss"] < evaluation["base"]["loss"]


def test_summary_carries_both_runs_with_bits_per_byte(workdir):
    with open(workdir / "results" / "experiments" / "sft" / "summary.csv") as file:
        rows = {row["run"]: row for row in csv.DictReader(file)}
    assert set(rows) == {"sft_ddp", "sft_indep", "kinds_uniform"}
    for run in ("sft_ddp", "sft_indep"):
        assert float(rows[run]["test_bits_per_byte_merged"]) > 0
    assert float(rows["kinds_uniform"]["test_accuracy_merged"]) > 0


def test_a_text_classifier_trains_merges_and_is_scored_on_its_token_rows(workdir, monkeypatch):
    """The same completions labelled by module (jsonl, task classification): the merged built-in
    transformer's test accuracy in eval.json recomputed by hand from merged.safetensors and the test
    split's padded token rows; the logged MLflow model names the modules."""
    info = json.loads((workdir / "results" / "datasets" / "kinds" / "dataset.json").read_text())
    assert info["pad_id"] == 256 and info["label_names"] == sorted(MODULES)
    evaluation = json.loads((workdir / "results" / "runs" / "kinds_uniform" / "eval.json").read_text())
    model = model_from_file(workdir / "results" / "runs" / "kinds_uniform" / "merged.safetensors").module
    table = pq.read_table(workdir / "results" / "datasets" / "kinds" / "test.parquet")
    tokens = torch.tensor(table.column("tokens").to_pylist(), dtype=torch.long)
    labels = torch.tensor(table.column("label").to_pylist())
    with torch.no_grad():
        accuracy = (model(tokens).argmax(dim=1) == labels).double().mean().item()
    assert evaluation["merged"]["accuracy"] == pytest.approx(accuracy)
    counts = torch.bincount(labels)
    assert evaluation["merged"]["accuracy"] > counts.max().item() / len(labels)  # above the majority class
    record = json.loads((workdir / "results" / "runs" / "kinds_uniform" / "mlflow.json").read_text())
    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{workdir}/mlflow.db")
    logged = mlflow.pyfunc.load_model(f"runs:/{record['parent_run_id']}/kinds_uniform")
    predicted = logged.predict(pd.DataFrame({"tokens": [list(b"Return the arguments as a list.")]}))
    assert predicted["prediction"][0] in MODULES
