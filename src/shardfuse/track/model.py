"""The merged model as an MLflow pyfunc model: logged by the track rule, loadable anywhere, never pickled.

The model directory holds ``data/merged.safetensors`` (weights, with the model spec in its header) and
``code/``: this package and, for a user model, the user's modules and packages, each under its own
name. MLflow puts ``code/`` on sys.path, imports this module (``loader_module``) and calls
:func:`_load_pyfunc`, so the model loads in any process with the pinned requirements::

    import mlflow, pandas as pd
    model = mlflow.pyfunc.load_model("runs:/<parent run id>/<run name>")   # or models:/<name>/<version>
    model.predict(pd.DataFrame({"pixel_0_0": [...], ..., "pixel_7_7": [...]}))  # the data's own names

Columns, by task (the logged signature says the same; each task's module says what it returns and how it
predicts):

- classification: input the features; output ``prediction`` (the label as the data spelled it) and
  ``probability_<label>`` per class
- regression: input the features; output one column per target, named after it, in its units
- causal_lm: input ``tokens``, one token id sequence per row (the last block_size count); output
  ``probability_0`` .. ``probability_{V-1}``, the distribution of the next token (no generation)

Features are named as in the dataset (x0..x{F-1} when it names none). A checkpoint from before the
model registry knows no names: it takes x0..x{F-1} and predicts the class index.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import shutil
import tempfile
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.io import UserError
from shardfuse.models.catalog import exports_hf
from shardfuse.models.spec import description_of, normalized_spec
from shardfuse.models.task import Outputs, numbered
from shardfuse.models.tasks import Task, task_for
from shardfuse.models.usercode import stage_code

WEIGHTS_FILE = "merged.safetensors"
MODEL_NAME = "model"
WEIGHTS_TAG = "shardfuse.weights_sha256"
REQUIREMENTS = ("torch", "safetensors", "numpy", "pandas")
HF_DIR = "hf"  # model hf: the transformers export inside the logged model's data
HF_REQUIREMENTS = ("transformers", "tokenizers")
FILES_DIR = "files"  # the spec's model_files, at their paths relative to the workflow's directory
TOKENS = "tokens"  # the input column of a model that reads token rows (causal_lm)
TENSOR = "x"  # a tensor-input model's input (images): an array [N, *shape], or a column of arrays
PACKAGE = Path(__file__).resolve().parents[1]  # the shardfuse package, shipped with the model


@dataclass(frozen=True)
class Interface:
    """The columns a logged model takes and returns, read from its spec without torch (the track job
    logs models without importing it, so this reads shardfuse.models.spec, not shardfuse.models.registry).
    The task says what the model returns (shardfuse.models.task.Outputs) and how it predicts."""

    task: Task
    inputs: tuple[str, ...]
    outputs: Outputs
    block_size: int | None  # token rows: the tokens a row sees (the last block_size count)
    tensor_shape: tuple[int, ...] | None = None  # tensor inputs (images): one row's shape, e.g. (1, 8, 8)


def interface(spec: dict[str, Any]) -> Interface:
    """The model's columns; names the data lacks are numbered (x0.., target_0.., probability_0..)."""
    description = description_of(spec)
    try:
        task = task_for(description.task)
    except UserError:
        raise UserError(
            f"unknown task {description.task!r} in the checkpoint's model spec; re-train with this shardfuse"
        ) from None
    outputs = task.logged_outputs(description)
    inputs = numbered(description.feature_names, int(description.num_features), "x")
    block_size = None
    if outputs.token_rows:  # num_features holds the same as block_size for a token block
        inputs, block_size = (TOKENS,), int(description.block_size or description.num_features)
    tensor_shape = None
    if description.input_kind == "tensor":
        inputs, tensor_shape = (TENSOR,), tuple(int(n) for n in description.feature_shape)
    return Interface(task, inputs, outputs, block_size, tensor_shape)


def feature_names(spec: dict[str, Any]) -> list[str]:
    """The input columns ``predict`` reads."""
    return list(interface(spec).inputs)


def _columns(frame, names: tuple[str, ...]):
    missing = [name for name in names if name not in frame.columns]
    if missing:
        more = f" (and {len(missing) - 5} more)" if len(missing) > 5 else ""
        expected = ", ".join(names) if len(names) <= 8 else f"{', '.join(names[:4])}, …, {names[-1]}"
        raise UserError(
            f"input lacks column(s) {', '.join(missing[:5])}{more}; the model takes {len(names)} "
            f"column(s): {expected}"
        )
    return frame[list(names)]


def _tensor_rows(model_input: Any, shape: tuple[int, ...]) -> np.ndarray:
    """float32 [N, *shape] from an array, or from a DataFrame column ``x`` holding one array per row."""
    if isinstance(model_input, np.ndarray):
        values = model_input
    else:
        cells = _columns(model_input, (TENSOR,))[TENSOR]
        values = np.stack([np.asarray(cell, dtype=np.float32) for cell in cells]) if len(cells) else None
    if values is None or values.size % int(np.prod(shape)) or values.shape[0] == 0:
        raise UserError(
            f"the model takes inputs shaped [N, {', '.join(map(str, shape))}]; pass such an array"
        )
    values = np.asarray(values, dtype=np.float32).reshape(-1, *shape)
    return np.ascontiguousarray(values)


def _token_ids(cell: Any, row: int, vocab_size: int) -> np.ndarray:
    ids = np.asarray(cell)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise UserError(f"row {row} of column {TOKENS!r} is not a non-empty sequence of int token ids")
    outside = ids[(ids < 0) | (ids >= vocab_size)]
    if outside.size:
        raise UserError(f"row {row} holds token id {outside[0]}, outside the vocabulary 0..{vocab_size - 1}")
    return ids.astype(np.int64)


@contextlib.contextmanager
def _working_directory(path: Path | None) -> Iterator[None]:
    """Build the model with relative model_files resolving into the logged copy (code paths are made
    absolute first: they resolve against the directory the model was loaded from)."""
    if path is None:
        yield
        return
    previous = Path.cwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


class MergedModel:
    """A shardfuse model on CPU; ``predict`` takes and returns the columns of :class:`Interface`.

    ``code_dir`` replaces the user code paths recorded in the spec (relative to the workflow's
    directory): there the logged model keeps its copy of that code, the code that now counts."""

    def __init__(
        self, weights_path: str | Path, code_dir: str | Path | None = None, hf_dir: str | Path | None = None
    ) -> None:
        from shardfuse.checkpoints.weights import load_weights
        from shardfuse.models.adapter import file_ties, load_state
        from shardfuse.models.registry import build_model

        tensors, metadata = load_weights(weights_path)
        self.spec = metadata["model"]
        self.interface = interface(self.spec)
        spec = normalized_spec(self.spec)
        if spec.get("code") and code_dir is not None:
            spec = {**spec, "code": {**spec["code"], "paths": [str(code_dir)]}}
        if hf_dir is not None:  # build from the shipped export, not the training's pretrained folder
            spec = {**spec, "args": {**spec["args"], "pretrained": str(hf_dir)}}
        files_dir = Path(weights_path).parent / FILES_DIR
        with _working_directory(files_dir if files_dir.is_dir() else None):
            self.model = build_model(spec)
        load_state(self.model, tensors, str(weights_path), file_ties(metadata))
        self.model.eval()
        self.columns = list(self.interface.inputs)

    def predict(self, model_input: Any, params: dict[str, Any] | None = None):
        import pandas as pd

        frame = model_input
        if not isinstance(model_input, (pd.DataFrame, np.ndarray)):
            frame = pd.DataFrame(model_input)
        outputs = self.interface.outputs
        if outputs.token_rows:
            cells = _columns(frame, (TOKENS,))[TOKENS]
            block_size, vocab_size = self.interface.block_size, len(outputs.names)
            rows = [_token_ids(cell, row, vocab_size)[-block_size:] for row, cell in enumerate(cells)]
        elif self.interface.tensor_shape is not None:
            rows = _tensor_rows(model_input, self.interface.tensor_shape)
        else:
            rows = _columns(frame, self.interface.inputs).to_numpy(dtype=np.float32, copy=True)
        return self.interface.task.predict(self.model, rows, outputs)


def _load_pyfunc(data_path: str) -> MergedModel:
    """MLflow's entry point: ``data_path`` is the logged data directory (or the weights file itself)."""
    path = Path(data_path).resolve()
    # The model's code/ (MLflow has put it on sys.path) is beside MLmodel, data_path is <model>/data/data.
    code_dir = next((p / "code" for p in path.parents if (p / "MLmodel").is_file()), None)
    weights = path / WEIGHTS_FILE if path.is_dir() else path
    hf_dir = weights.parent / HF_DIR
    return MergedModel(
        weights,
        code_dir if code_dir is not None and code_dir.is_dir() else None,
        hf_dir if hf_dir.is_dir() else None,
    )


def model_signature(spec: dict[str, Any]):
    from mlflow.models import ModelSignature
    from mlflow.types import ColSpec, Schema, TensorSpec
    from mlflow.types.schema import Array

    shape = interface(spec)
    if shape.tensor_shape is not None:
        inputs = Schema([TensorSpec(np.dtype(np.float32), (-1, *shape.tensor_shape))])
    elif shape.outputs.token_rows:
        inputs = Schema([ColSpec(Array("long"), TOKENS)])
    else:
        # "double" inputs: MLflow rejects float64 columns for a float32 schema; predict casts to float32.
        inputs = Schema([ColSpec("double", name) for name in shape.inputs])
    columns = zip(shape.outputs.types, shape.outputs.names, strict=True)
    outputs = [ColSpec(kind, name) for kind, name in columns]
    return ModelSignature(inputs=inputs, outputs=Schema(outputs))


def input_example(spec: dict[str, Any]):
    """One row of zeros (for token rows, one block of token 0): shown in the UI and as the serving example."""
    import pandas as pd

    shape = interface(spec)
    if shape.tensor_shape is not None:
        return np.zeros((1, *shape.tensor_shape), dtype=np.float32)
    if shape.outputs.token_rows:
        return pd.DataFrame({TOKENS: [[0] * int(shape.block_size or 1)]})
    return pd.DataFrame([[0.0] * len(shape.inputs)], columns=list(shape.inputs))


def _code_paths(spec: dict[str, Any], staging: Path) -> tuple[list[str], list[str]]:
    """(code_paths, extra requirements): this package and, for a user model, its code
    (:func:`shardfuse.models.usercode.stage_code` says which entries and why)."""
    package = staging / PACKAGE.name
    shutil.copytree(PACKAGE, package, ignore=shutil.ignore_patterns("__pycache__"))
    user_paths, extra = stage_code(spec, staging, reserved={PACKAGE.name})
    return [str(package), *user_paths], extra


def _stage_model_files(spec: dict[str, Any], files_dir: Path) -> None:
    """Copy the files the model is built from (``model_files``, a pretrained folder) to their relative
    paths under ``files_dir``: the logged model builds itself there, wherever it is loaded."""
    for entry in (spec.get("code") or {}).get("model_files", []):
        source = Path(entry)
        if source.is_absolute() or ".." in source.parts:
            continue  # found where it is (an absolute path stays one)
        target = files_dir / source
        target.parent.mkdir(parents=True, exist_ok=True)
        if source.is_dir():
            shutil.copytree(source, target, dirs_exist_ok=True)
        else:
            shutil.copy2(source, target)


def _requirements(extra: list[str] | tuple[str, ...] = ()) -> list[str]:
    """Pinned explicitly: MLflow would otherwise load the model in a subprocess to infer them (slow)."""
    pins = []
    for name in ("mlflow", *REQUIREMENTS, *extra):
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


def log_merged_model(
    tracking_uri: str,
    run_id: str,
    weights_path: Path,
    weights_sha256: str,
    spec: dict,
    name: str = MODEL_NAME,
    hf_dir: Path | None = None,
):
    """Log ``weights_path`` as a pyfunc model ``name`` (the track stage: the run's name) under ``run_id``;
    return its model id.

    Written as ``mlflow.pyfunc.log_model`` would write it, but without MLflow's check that the saved
    model serves its input example: that check loads the model, i.e. imports torch (bench/tracking.py
    measures the difference) in a stage that otherwise only reads files. The evaluate stage has already
    built and scored this model from the same header, and tests/unit/track/test_tracking.py loads the
    logged model and compares its predictions with the weights'.
    """
    import mlflow
    from mlflow.models import Model

    signature = model_signature(spec)  # first: a malformed spec fails before anything is written
    with (
        tempfile.TemporaryDirectory(prefix="shardfuse-model-") as tmp,
        _global_tracking_uri(tracking_uri),
        _no_site_packages_scan(),
    ):
        staging, data_dir = Path(tmp) / "code", Path(tmp) / "data"
        staging.mkdir()
        code_paths, extra_requirements = _code_paths(spec, staging)
        data_dir.mkdir()
        shutil.copy2(weights_path, data_dir / WEIGHTS_FILE)
        if hf_dir is not None:  # the model is rebuilt from it: no pretrained folder needed where it loads
            shutil.copytree(hf_dir, data_dir / HF_DIR)
            extra_requirements = [*extra_requirements, *HF_REQUIREMENTS]
        else:
            _stage_model_files(spec, data_dir / FILES_DIR)
        if exports_hf(spec.get("model")):
            extra_requirements = list(dict.fromkeys([*extra_requirements, *HF_REQUIREMENTS]))
        # Model.log puts the model in the active run's experiment: resume our run (the caller sets its
        # status afterwards).
        with mlflow.start_run(run_id=run_id, log_system_metrics=False):
            info = Model.log(
                artifact_path=None,
                name=name,
                flavor=_PYFUNC_FLAVOR,
                tags={WEIGHTS_TAG: weights_sha256},
                validate_serving_input=False,
                loader_module=__name__,
                data_path=str(data_dir),
                code_paths=code_paths,
                signature=signature,
                input_example=input_example(spec),
                pip_requirements=_requirements(extra_requirements),
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


def delete_unfinished_models(client, experiment_id: str, run_id: str) -> None:
    """Delete the logged models of ``run_id`` that never became READY: MLflow creates a model PENDING
    before it uploads the files, so a track that failed or was killed meanwhile leaves one behind."""
    models = client.search_logged_models([experiment_id], filter_string=f"source_run_id = '{run_id}'")
    for model in models:
        if not str(model.status).endswith("READY"):
            client.delete_logged_model(model.model_id)


@contextlib.contextmanager
def unfinished_models_deleted(client, experiment_id: str, run_id: str) -> Iterator[None]:
    """Log a model in the block; should it fail (or be interrupted), its PENDING model is deleted."""
    try:
        yield
    except BaseException:
        with contextlib.suppress(Exception):  # the failure, not this clean-up's, is the one to report
            delete_unfinished_models(client, experiment_id, run_id)
        raise
