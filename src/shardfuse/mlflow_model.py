"""The merged model as an MLflow pyfunc model: logged by the track rule, loadable anywhere, never pickled.

The model directory holds ``merged.safetensors`` (weights, with the model spec in its header) and this
package's source; MLflow imports this module (``loader_module``) and calls :func:`_load_pyfunc`::

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("runs:/<parent run id>/model")   # or models:/<name>/<version>
    model.predict(pd.DataFrame({"x0": [...], ..., "x63": [...]}))
    # -> DataFrame: prediction (class index), probability_0 .. probability_{C-1}
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.io import UserError

WEIGHTS_FILE = "merged.safetensors"
MODEL_NAME = "model"
WEIGHTS_TAG = "shardfuse.weights_sha256"
REQUIREMENTS = ("torch", "safetensors", "numpy", "pandas")


def feature_names(spec: dict[str, Any]) -> list[str]:
    return [f"x{i}" for i in range(spec["num_features"])]


class MergedModel:
    """A shardfuse MLP on CPU; ``predict`` takes the feature columns x0..x{F-1} of a DataFrame."""

    def __init__(self, weights_path: str | Path) -> None:
        from shardfuse.checkpoint import load_weights
        from shardfuse.models import build_model

        tensors, metadata = load_weights(weights_path)
        self.spec = metadata["model"]
        self.model = build_model(self.spec)
        self.model.load_state_dict(tensors)
        self.model.eval()
        self.columns = feature_names(self.spec)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None):
        import pandas as pd
        import torch

        frame = model_input if isinstance(model_input, pd.DataFrame) else pd.DataFrame(model_input)
        missing = [c for c in self.columns if c not in frame.columns]
        if missing:
            raise UserError(
                f"input lacks feature column(s) {', '.join(missing[:5])}; pass x0..x{len(self.columns) - 1}"
            )
        features = torch.from_numpy(frame[self.columns].to_numpy(dtype=np.float32, copy=True))
        with torch.no_grad():
            probabilities = torch.softmax(self.model(features), dim=1).numpy()
        out = pd.DataFrame(probabilities, columns=[f"probability_{c}" for c in range(probabilities.shape[1])])
        out.insert(0, "prediction", probabilities.argmax(axis=1).astype(np.int64))
        return out


def _load_pyfunc(data_path: str) -> MergedModel:
    """MLflow's entry point: ``data_path`` is the logged data directory (or the weights file itself)."""
    path = Path(data_path)
    return MergedModel(path / WEIGHTS_FILE if path.is_dir() else path)


def model_signature(spec: dict[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema

    # "double" inputs: MLflow rejects float64 columns for a float32 schema; predict casts to float32.
    inputs = Schema([ColSpec("double", name) for name in feature_names(spec)])
    outputs = Schema(
        [ColSpec("long", "prediction")]
        + [ColSpec("float", f"probability_{c}") for c in range(spec["num_classes"])]
    )
    return ModelSignature(inputs=inputs, outputs=outputs)


def _requirements() -> list[str]:
    """Pinned explicitly: MLflow would otherwise load the model in a subprocess to infer them (slow)."""
    pins = []
    for name in ("mlflow", *REQUIREMENTS):
        with contextlib.suppress(importlib.metadata.PackageNotFoundError):
            pins.append(f"{name}=={importlib.metadata.version(name).split('+')[0]}")
    return pins


def _quoted(value: str, what: str) -> str:
    if "'" in value:
        raise UserError(f"{what} {value!r} contains a quote; choose a name without quotes")
    return f"'{value}'"


def find_logged_model(client, experiment_id: str, run_id: str, weights_sha256: str):
    """The READY logged model of ``run_id`` made from these weights, or None."""
    found = client.search_logged_models(
        [experiment_id],
        filter_string=f"source_run_id = '{run_id}' AND tags.`{WEIGHTS_TAG}` = '{weights_sha256}'",
    )
    ready = [m for m in found if str(m.status).endswith("READY")]
    return ready[0] if ready else None


@contextlib.contextmanager
def _global_tracking_uri(uri: str) -> Iterator[None]:
    """MLflow's model logging only knows the global tracking URI: set it, then restore it exactly.

    set_tracking_uri also writes (or, for None, removes) $MLFLOW_TRACKING_URI, so that is restored too.
    """
    import mlflow
    from mlflow.tracking._tracking_service import utils

    saved_global, saved_env = utils._tracking_uri, os.environ.get("MLFLOW_TRACKING_URI")
    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(saved_global)
        if saved_env is not None:
            os.environ["MLFLOW_TRACKING_URI"] = saved_env


@contextlib.contextmanager
def _no_site_packages_scan() -> Iterator[None]:
    """Spare Model.log its scan of every installed distribution (a share of each track job's time).

    MLflow checks the pinned requirements against the installed packages, and first maps every
    importable module to its distribution by reading all of site-packages. Our pins are read from the
    installed versions (:func:`_requirements`), so the check cannot fail; with an empty map (private to
    MLflow, hence guarded and restored) it reads each pin's version from the package metadata instead.
    """
    try:
        from mlflow.utils import requirements_utils
    except ImportError:
        yield
        return
    if getattr(requirements_utils, "_MODULES_TO_PACKAGES", "") is not None:
        yield  # already built in this process (or renamed): nothing to spare
        return
    requirements_utils._MODULES_TO_PACKAGES = {}
    try:
        yield
    finally:
        requirements_utils._MODULES_TO_PACKAGES = None
        requirements_utils._PACKAGES_TO_MODULES = None


def _save_pyfunc(path, mlflow_model, validate_serving_input: bool = True, **kwargs):
    """``mlflow.pyfunc.save_model``, taking the ``validate_serving_input`` flag that Model.log reads."""
    import mlflow.pyfunc

    return mlflow.pyfunc.save_model(path=path, mlflow_model=mlflow_model, **kwargs)


# The pyfunc flavor as Model.log sees it ("pyfunc" names the logged model's flavor, as log_model does),
# with a save_model that accepts validate_serving_input (MLflow's transformers flavor does the same).
_PYFUNC_FLAVOR = types.SimpleNamespace(__name__="pyfunc", save_model=_save_pyfunc)


def log_merged_model(tracking_uri: str, run_id: str, weights_path: Path, weights_sha256: str, spec: dict):
    """Log ``weights_path`` as a pyfunc model named ``model`` under ``run_id``; return its model id.

    Written as ``mlflow.pyfunc.log_model`` would write it, but without MLflow's check that the saved
    model serves its input example: that check loads the model, i.e. imports torch (bench/tracking.py
    measures the difference) in a stage that otherwise only reads files. The evaluate stage has already
    built and scored this model from the same header, and tests/test_tracking.py loads the logged model
    and compares its predictions with the weights'.
    """
    import mlflow
    import pandas as pd
    from mlflow.models import Model

    with (
        tempfile.TemporaryDirectory(prefix="shardfuse-model-") as tmp,
        _global_tracking_uri(tracking_uri),
        _no_site_packages_scan(),
    ):
        data_dir = Path(tmp) / "data"
        data_dir.mkdir()
        shutil.copy2(weights_path, data_dir / WEIGHTS_FILE)
        package = Path(tmp) / "shardfuse"
        shutil.copytree(Path(__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
        # Model.log puts the model in the active run's experiment: resume our run (the caller sets its
        # status afterwards).
        with mlflow.start_run(run_id=run_id, log_system_metrics=False):
            info = Model.log(
                artifact_path=None,
                name=MODEL_NAME,
                flavor=_PYFUNC_FLAVOR,
                tags={WEIGHTS_TAG: weights_sha256},
                validate_serving_input=False,
                loader_module=__name__,
                data_path=str(data_dir),
                code_paths=[str(package)],
                signature=model_signature(spec),
                # One row of zeros: shown in the UI and as the serving example.
                input_example=pd.DataFrame([[0.0] * spec["num_features"]], columns=feature_names(spec)),
                pip_requirements=_requirements(),
            )
    return info.model_id


def register_model(client, name: str, run_id: str, model_id: str) -> str:
    """Ensure a version of registered model ``name`` holds ``model_id``; return its version."""
    from mlflow.exceptions import MlflowException

    # The artifact location, not models:/<id>: the registry would resolve that against the global URI.
    source = client.get_logged_model(model_id).artifact_location
    for version in client.search_model_versions(f"name = {_quoted(name, 'registered model name')}"):
        if version.source == source:
            return str(version.version)
    try:
        client.create_registered_model(name)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_ALREADY_EXISTS":
            raise
    return str(client.create_model_version(name, source=source, run_id=run_id, model_id=model_id).version)


def delete_unregistered_models(client, experiment_id: str, run_id: str, keep: str | None = None) -> None:
    """Soft-delete the logged models of ``run_id`` (but ``keep``) that no registry version uses."""
    models = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    if not models:
        return
    sources = {v.source for v in client.search_model_versions(f"run_id = '{run_id}'")}
    for model in models:
        if model.model_id != keep and model.artifact_location not in sources:
            client.delete_logged_model(model.model_id)
