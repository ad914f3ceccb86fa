"""Shared by the logged-model tests (tests/stages/test_mlflow_model.py: the built-in models, fast tier;
tests/slow/test_mlflow_user_models.py: user models loaded from their logged code): hand-written dataset
descriptions, a SQLite store, and helpers that save, log and load a model."""

from __future__ import annotations

import shutil
import subprocess
import sys
import urllib.parse
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch
from mlflow.tracking import MlflowClient

from shardfuse.checkpoints.weights import save_weights
from shardfuse.models.registry import build_model, set_data_stats
from shardfuse.track import model_logging
from tests.support.helpers import subprocess_env

USER_CODE = Path(__file__).resolve().parent / "mlflow_user_model"
IRIS = {
    "task": "classification",
    "num_features": 4,
    "num_classes": 3,
    "feature_names": ["sepal length (cm)", "sepal width (cm)", "petal_length", "petal_width"],
    "label_names": ["setosa", "versicolor", "virginica"],
}
PRICES = {
    "task": "regression",
    "num_features": 3,
    "feature_names": ["age", "bmi", "bp"],
    "target_names": ["progression", "cost"],
}
TEXT = {"task": "causal_lm", "num_features": 6, "vocab_size": 11, "block_size": 6}
PREDICT_ELSEWHERE = """
import sys, mlflow, pandas as pd
out = mlflow.pyfunc.load_model(sys.argv[1]).predict(pd.read_parquet(sys.argv[2]))
out.to_parquet(sys.argv[3])
"""
LOG_WITHOUT_TORCH = """
import json, sys
from shardfuse.track import model_logging
from shardfuse.checkpoints.weights import read_metadata
uri, run_id, weights, sha = sys.argv[1:]
model_id = model_logging.log_merged_model(uri, run_id, weights, sha, read_metadata(weights)["model"])
heavy = sorted(m for m in sys.modules if m == "torch" or m.startswith(("torch.", "sf_")))
print(json.dumps({"model_id": model_id, "heavy": heavy}))
"""


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment("models", artifact_location=str(root / "artifacts"))
    return {"uri": uri, "client": client, "experiment_id": experiment_id}


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    """The workflow's directory, holding the user code under code/ (a relative code path, as in a
    run); this process's sys.path and user modules are restored afterwards."""
    work = tmp_path / "work"
    shutil.copytree(USER_CODE, work / "code")
    (work / "code" / "notes.txt").write_text("not code: stays out of the model\n")
    monkeypatch.chdir(work)
    monkeypatch.setattr(sys, "path", list(sys.path))
    yield work
    for name in [m for m in sys.modules if m.startswith("sf_")]:
        del sys.modules[name]


def _save(path: Path, spec: dict, seed: int = 0):
    """A freshly initialised model with non-trivial data statistics, saved as a merged checkpoint."""
    torch.manual_seed(seed)
    model = build_model(spec)
    num_features, num_outputs = spec["description"]["num_features"], spec["description"]["num_outputs"]
    set_data_stats(
        model,
        (torch.randn(num_features), torch.rand(num_features) + 0.5),
        (torch.randn(num_outputs) * 100, torch.rand(num_outputs) * 50 + 1),
    )
    sha = save_weights(path, model.state_dict(), {"model": spec})
    return model.eval(), sha


def _log(store, weights: Path, sha: str, spec: dict) -> str:
    run_id = store["client"].create_run(store["experiment_id"]).info.run_id
    return f"models:/{model_logging.log_merged_model(store['uri'], run_id, weights, sha, spec)}"


def _env(store) -> dict[str, str]:
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("MLFLOW_")}
    return {**env, "MLFLOW_TRACKING_URI": store["uri"]}


def _predict_elsewhere(store, uri: str, frame: pd.DataFrame, cwd: Path) -> pd.DataFrame:
    cwd.mkdir(parents=True, exist_ok=True)
    frame.to_parquet(cwd / "input.parquet")
    proc = subprocess.run(
        [sys.executable, "-c", PREDICT_ELSEWHERE, uri, "input.parquet", "output.parquet"],
        cwd=cwd, env=_env(store), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return pd.read_parquet(cwd / "output.parquet")


def _predict_here(store, uri: str, frame: pd.DataFrame, monkeypatch) -> pd.DataFrame:
    """Load and predict in this process: for the built-in models, whose logged model carries no code
    (the user-model and causal-LM tests load theirs in a fresh process in another directory)."""
    monkeypatch.setenv("MLFLOW_TRACKING_URI", store["uri"])
    return mlflow.pyfunc.load_model(uri).predict(frame)


def _features(info: dict, rows: int = 25, seed: int = 0) -> pd.DataFrame:
    values = np.random.default_rng(seed).normal(size=(rows, info["num_features"]))
    return pd.DataFrame(values, columns=info["feature_names"])


def _outputs(model, frame: pd.DataFrame) -> np.ndarray:
    with torch.no_grad():
        return model(torch.tensor(frame.to_numpy(), dtype=torch.float32)).numpy()


def _model_dir(store, uri: str) -> Path:
    location = store["client"].get_logged_model(uri.removeprefix("models:/")).artifact_location
    return Path(urllib.parse.urlparse(location).path)
