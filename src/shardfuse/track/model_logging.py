"""The merged model logged to MLflow as a pyfunc model, without torch, and the models a run no longer
holds deleted: the track stage's writes of :mod:`shardfuse.track.model`, the model that loads it.

The logged model ships this package and the user's code under ``code/`` (:func:`_code_paths`), the weights
(and a model hf's export, or the files the model is built from) under ``data/``, pinned requirements, its
signature and input example; a version of a registered model points at it when asked
(:func:`register_model`). A track that fails or is killed while logging leaves no PENDING model behind
(:func:`unfinished_models_deleted`).
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

from shardfuse.io import UserError
from shardfuse.models.catalog import exports_hf
from shardfuse.models.usercode import stage_code
from shardfuse.track.model import (
    FILES_DIR,
    HF_DIR,
    LOADER_MODULE,
    WEIGHTS_FILE,
    input_example,
    model_signature,
)

MODEL_NAME = "model"
WEIGHTS_TAG = "shardfuse.weights_sha256"
REQUIREMENTS = ("torch", "safetensors", "numpy", "pandas")
HF_REQUIREMENTS = ("transformers", "tokenizers")
PACKAGE = Path(__file__).resolve().parents[1]  # the shardfuse package, shipped with the model


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


# MLflow refuses a logged model's name holding any of these; a run name may hold '.' (a0.5_ddp).
MODEL_NAME_REFUSES = "/:.%\"'"


def logged_model_name(run_name: str) -> str:
    """The name the run's merged model is logged under: the run's, each character MLflow refuses in a
    model name as '_' (a logged model is found by its run and weights digest, never by this name)."""
    return "".join("_" if char in MODEL_NAME_REFUSES else char for char in run_name)


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
            # without export's own marker (shardfuse.export.OUTPUT): the transformers folder only
            shutil.copytree(hf_dir, data_dir / HF_DIR, ignore=shutil.ignore_patterns(".shardfuse-*"))
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
                loader_module=LOADER_MODULE,
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
