"""The parent run's artifacts, its logged model and the model's metrics, and datasets as run inputs:
the MLflow writes of :mod:`shardfuse.track.sync` beyond params and curves, each skipped when MLflow already
holds it (a push of unchanged files writes nothing).

- artifacts: the JSON results under ``results/``, the plots under ``plots/`` and again at the artifact
  root (MLflow's Compare view lists top-level artifacts only); re-uploaded only when their hash changed;
- the merged model, logged once per weights (named after the run; MLflow copies the run's params to
  it, the merge method and training are added) and registered when asked;
- the merged model's test metrics (``test_*_merged``), logged linked to the model and to the test split
  (:func:`merged_model_metrics`), so the model's page lists them with their dataset;
- datasets (:class:`shardfuse.track.ui.DatasetRef`) a run does not list yet, as its inputs.
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass
from pathlib import Path

from shardfuse.io import sha256_file
from shardfuse.track import model_logging
from shardfuse.track.inputs import RunInputs
from shardfuse.track.push import changed_metrics
from shardfuse.track.ui import run_datasets

ARTIFACTS_TAG = "shardfuse.artifacts_sha256"
MODEL_TAG = "shardfuse.model_id"
REGISTERED_TAG = "shardfuse.registered_model"
SUMMARY_STEP = 0  # one value per run: the runs chart view draws a bar per run (curves keep their steps)


@dataclass(frozen=True)
class SyncOptions:
    """What a push is asked for besides the files, fixed for the whole sync."""

    tracking_uri: str
    registered_model: str | None
    fingerprint: str  # of the config, the registry name and every input file
    config_hash: str
    run_name: str
    dataset_name: str  # the config's dataset: the name of the datasets logged as run inputs
    source_tags: dict[str, str]  # mlflow.source.* and mlflow.user (tracking_ui.source_tags)
    hf_dir: Path | None = None  # model hf: the run's transformers export, shipped in the logged model


def log_datasets(client, run, refs) -> None:
    """Log the datasets the run does not list yet as its inputs (MLflow keeps one link per dataset)."""
    have = set()
    inputs = getattr(run, "inputs", None)
    for found in getattr(inputs, "dataset_inputs", None) or []:
        have.add((found.dataset.name, found.dataset.digest))
    missing = [ref.entity() for ref in refs if (ref.name, ref.digest) not in have]
    if missing:
        client.log_inputs(run.info.run_id, datasets=missing)


def sync_parent_extras(
    client, experiment_id: str, parent, inputs: RunInputs, options: SyncOptions
) -> tuple[str, str | None]:
    """Artifacts, the MLflow model and its registration: each skipped when already there.

    The run's plots go under ``plots/`` and also at the artifact root, where MLflow's Compare view
    finds them (it lists top-level artifacts only). Returns (the model id, "NAME/VERSION" if registered)."""
    parent_id, tags = parent.info.run_id, parent.data.tags
    files = inputs.files
    uploads = [(path, "results") for path in files.results()]
    uploads += [(path, "plots") for path in files.plots] + [(path, None) for path in files.plots]
    uploads += [(path, "adapter") for path in files.adapter]
    uploads += [(files.mergekit, "mergekit")] if files.mergekit is not None else []
    artifacts_sha = hashlib.sha256(
        "".join(f"{d or '.'}/{p.name}:{sha256_file(p)}\n" for p, d in uploads).encode()
    )
    if tags.get(ARTIFACTS_TAG) != artifacts_sha.hexdigest():
        for path, directory in uploads:
            client.log_artifact(parent_id, str(path), artifact_path=directory)
        client.set_tag(parent_id, ARTIFACTS_TAG, artifacts_sha.hexdigest())
    weights_sha = sha256_file(files.weights)
    model = model_logging.find_logged_model(client, experiment_id, parent_id, weights_sha)
    model_id = model.model_id if model is not None else None
    if model_id is None:
        with model_logging.unfinished_models_deleted(client, experiment_id, parent_id):
            model_id = model_logging.log_merged_model(
                options.tracking_uri, parent_id, files.weights, weights_sha, inputs.model_spec,
                name=model_logging.logged_model_name(options.run_name), hf_dir=options.hf_dir,
            )  # fmt: skip
        # MLflow copies the run's params to the model it logs; add what the model page should also say.
        described = {"training": str(inputs.train.run or ""), **_model_params(inputs)}
        have = client.get_logged_model(model_id).params or {}
        if missing := {k: v for k, v in described.items() if k not in have}:
            client.log_model_params(model_id, missing)
    if tags.get(MODEL_TAG) != model_id:
        model_logging.delete_unregistered_models(client, experiment_id, parent_id, keep=model_id)
        client.set_tag(parent_id, MODEL_TAG, model_id)
    registered = None
    if options.registered_model:
        version = model_logging.register_model(client, options.registered_model, parent_id, model_id)
        registered = f"{options.registered_model}/{version}"
        if tags.get(REGISTERED_TAG) != registered:
            client.set_tag(parent_id, REGISTERED_TAG, registered)
    return model_id, registered


def _model_params(inputs: RunInputs) -> dict[str, str]:
    """The merge that made the model, as the logged model's params (its page shows them)."""
    merge = inputs.merge
    params = {"merge_method": "" if merge.method is None else str(merge.method)}
    for name, value in (merge.params or {}).items():
        if value is not None:
            params[f"merge_{name}"] = str(value)
    return params


def merged_model_metrics(client, model_id: str, parent, inputs: RunInputs, options: SyncOptions) -> tuple:
    """Split the headline metrics: those of the merged model (test_*_merged) are logged linked to the
    logged model and the test split, so its page lists them; return (model metrics, the others), only
    those not already there."""
    from mlflow.entities import Metric

    headline = inputs.headline
    model_keys = {key for key in headline if key.startswith("test_") and key.endswith("_merged")}
    linked = {m.key: m.value for m in (client.get_logged_model(model_id).metrics or [])}
    evaluation = run_datasets(inputs.files.manifest, inputs.manifest, options.dataset_name).evaluation
    now = int(time.time() * 1000)
    linked_metrics = [
        Metric(
            key,
            float(headline[key]),
            now,
            SUMMARY_STEP,
            model_id=model_id,
            dataset_name=evaluation.name if evaluation else None,
            dataset_digest=evaluation.digest if evaluation else None,
        )
        for key in sorted(model_keys)
        if linked.get(key) != headline[key] or parent.data.metrics.get(key) != headline[key]
    ]
    others = {k: v for k, v in headline.items() if k not in model_keys}
    return linked_metrics, changed_metrics(parent.data.metrics, others, SUMMARY_STEP)
