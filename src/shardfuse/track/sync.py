"""Sync one run to MLflow: the parent run and one child per rank, created or completed as
:mod:`shardfuse.track.plan` decided (the track stage, :mod:`shardfuse.tracking`, calls :func:`track_run`).

Layout in MLflow: one parent run per shardfuse run (run_name NAME; the resolved config as params, the
merge settings as merge.json resolved them; headline metrics at step 0, so the chart view draws a bar
per run; tags for git commit/dirty, snakemake/torch versions, hosts, SLURM job id, config hash, the
training, Source (the Snakefile) and User; start/end times of the training; the dataset and its test
split as inputs; JSON results under ``results/``, plots under ``plots/`` and at the artifact root; the
merged model as an MLflow pyfunc model named NAME with its test metrics linked, optionally registered)
with one nested child per rank (``NAME/rank-{r}``: loss, throughput and lr by step with their original
timestamps; grad_norm and val_<score> at the steps that have a finite value; ``system/...`` samples of
CPU, memory and GPU; its shard as input; its test metrics, and published_step and best_val_score where
train.json has them). What the UI shows besides metrics is computed in :mod:`shardfuse.track.ui`.

Histories go in step order, whole rows per log_batch, and a push killed midway goes on where it
stopped, neither losing nor doubling a point (:mod:`shardfuse.track.push`); each sparse series
(grad_norm, val_<score>) the same way, vouched for by its own ``shardfuse.synced.<metric>`` tag.
The artifacts, the model and datasets as inputs are written by :mod:`shardfuse.track.parent`; what is
pushed (the files read and checked, params, headline metrics) comes from :mod:`shardfuse.track.inputs`,
the provenance tags and the fingerprint from :mod:`shardfuse.track.provenance`. No torch: the model
spec comes from the merged weights' JSON header, and the model is logged without loading it.
"""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path
from typing import Any, NamedTuple, TypedDict

from shardfuse.io import UserError
from shardfuse.track import model_logging
from shardfuse.track.client import (
    check_no_password,
    connect,
    redact_uri,
    tracking_errors,
    writer_lock,
)
from shardfuse.track.inputs import RankInputs, RunInputs, flatten_params, load_inputs
from shardfuse.track.parent import (
    MODEL_TAG,
    REGISTERED_TAG,
    SUMMARY_STEP,
    SyncOptions,
    log_datasets,
    merged_model_metrics,
    sync_parent_extras,
)
from shardfuse.track.plan import (
    COMPLETE_TAG,
    FINGERPRINT_TAG,
    LAYOUT_TAG,
    LOST_TAG,
    PARENT_TAG,
    RANK_TAG,
    RUN_TAG,
    TRAINING_TAG,
    TRIAL_TAG,
    Action,
    Plan,
    delete_finished_live_runs,
    delete_runs,
    plan_sync,
    quote_run_name,
)
from shardfuse.track.provenance import LAYOUT_VERSION, config_hash, fingerprint, provenance_tags
from shardfuse.track.push import (
    SYNCED_TAG,
    changed_metrics,
    history_rows,
    log_batches,
    search_all,
    series_synced,
    sync_history,
    sync_series,
    synced_rows,
    synced_tag_value,
)
from shardfuse.track.ui import (
    merge_params,
    param_text,
    partition_params,
    run_datasets,
    run_times,
    source_tags,
)


class Synced(NamedTuple):
    """The runs a sync left in MLflow and what it pushed."""

    parent_id: str
    child_ids: dict[int, str]  # rank -> run id
    model_id: str | None
    registered: str | None  # "NAME/VERSION" when registered
    num_points: int  # metric points written


class TrackResult(TypedDict):
    """What ``--out`` records (JSON)."""

    tracking_uri: str  # password redacted
    experiment_name: str
    experiment_id: str
    parent_run_id: str
    child_run_ids: dict[str, str]  # rank (as text, in rank order) -> run id
    model_uri: str | None
    registered_model: str | None
    fingerprint: str
    action: Action
    num_points_pushed: int


def _sync_rank(
    client, experiment_id: str, parent_id: str, inputs: RunInputs, rank: RankInputs, child, options
) -> tuple[str, int]:
    """Create or complete one rank's child run; return (its id, metric points pushed)."""
    from mlflow.entities import Param, RunTag

    run_name, train = options.run_name, inputs.train
    rows = history_rows(rank.history)
    times = run_times({rank.rank: rank.history}, None).ranks.get(rank.rank)
    if child is None:
        tags = {PARENT_TAG: parent_id, RUN_TAG: run_name, RANK_TAG: str(rank.rank), **options.source_tags}
        child = client.create_run(
            experiment_id,
            run_name=f"{run_name}/rank-{rank.rank}",
            tags=tags,
            start_time=times[0] if times else None,
        )
    child_id = child.info.run_id
    pushed = sync_history(client, child_id, rows, synced_rows(child, rows) or 0)
    for metric, points in rank.series.items():
        pushed += sync_series(client, child_id, metric, points, series_synced(child, metric, points) or 0)
    # After the histories, in one request: the tags that vouch for them, final metrics, params, host.
    final = changed_metrics(child.data.metrics, {**rank.test_metrics, **rank.train_metrics}, SUMMARY_STEP)
    params = {"rank": str(rank.rank), "shard_rows": str(rank.shard_rows)}
    tags = {f"{SYNCED_TAG}.{metric}": synced_tag_value(points) for metric, points in rank.series.items()}
    tags[SYNCED_TAG] = synced_tag_value(rows)
    tags[TRAINING_TAG] = str(train.run or "")
    if rank.host is not None:
        tags["shardfuse.host"] = rank.host
    if rank.lost:  # lost for good while training: its curves up to then, no model
        tags[LOST_TAG] = "true"
    params = [Param(k, v) for k, v in params.items() if child.data.params.get(k) != v]
    tags = [RunTag(k, v) for k, v in tags.items() if child.data.tags.get(k) != v]
    if final or params or tags:
        client.log_batch(child_id, metrics=final, params=params, tags=tags)
    shard = run_datasets(inputs.files.manifest, inputs.manifest, options.dataset_name).ranks.get(rank.rank)
    if shard is not None:
        log_datasets(client, child, [shard])
    status = "FAILED" if rank.lost else "FINISHED"
    if child.info.status != status or (times and child.info.end_time != times[1]):
        client.set_terminated(child_id, status, end_time=times[1] if times else None)
    return child_id, pushed + len(final)


def sync_trials(
    client, experiment_id: str, parent_id: str, run_name: str, search: dict, source_tags: dict[str, str]
) -> None:
    """merge_search: each trial a child run (its parameters, its validation score, its state), and the
    study's best and default validation scores on the parent. The trials of an earlier push were deleted
    with the runs not kept, so none is logged twice."""
    from mlflow.entities import Metric, Param, RunTag

    objective = str(search.get("objective", "val_score"))
    now = int(time.time() * 1000)
    for trial in search.get("trials", []):
        number, state = trial.get("number"), str(trial.get("state"))
        tags = {PARENT_TAG: parent_id, RUN_TAG: run_name, TRIAL_TAG: str(number), **source_tags}
        child = client.create_run(experiment_id, run_name=f"{run_name}/trial-{number}", tags=tags)
        params = [Param(f"merge_{k}", param_text(v)) for k, v in (trial.get("params") or {}).items()]
        params.append(Param("trial", str(number)))
        metrics = []
        if isinstance(trial.get("value"), (int, float)):
            metrics.append(Metric(objective, float(trial["value"]), now, 0))
        client.log_batch(
            child.info.run_id, metrics=metrics, params=params, tags=[RunTag("trial_state", state)]
        )
        client.set_terminated(child.info.run_id, "FINISHED" if state == "COMPLETE" else "FAILED")
    summary = [
        Metric(f"search_best_{objective}", float(search["best_value"]), now, SUMMARY_STEP),
        Metric(f"search_default_{objective}", float(search["default_value"]), now, SUMMARY_STEP),
    ]
    client.log_batch(parent_id, metrics=summary)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="shardfuse-search-") as folder:
        for path in search_figures(search, Path(folder)):
            client.log_artifact(parent_id, str(path), artifact_path="search")


def search_figures(search: dict, folder: Path) -> list[Path]:
    """Optuna's own matplotlib figures of the study (optimisation history; parameter importances once two
    trials are complete), drawn from its storage into ``folder`` as PNGs."""
    import warnings

    storage = Path(str(search.get("storage", "")))
    if not storage.is_file():
        return []
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import optuna
    from optuna.visualization import matplotlib as optuna_plots

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.load_study(study_name=str(search["study"]), storage=f"sqlite:///{storage}")
    drawn = [("optimization_history", optuna_plots.plot_optimization_history)]
    if len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.COMPLETE,))) >= 2:
        drawn.append(("param_importances", optuna_plots.plot_param_importances))
    paths = []
    for name, draw in drawn:
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", optuna.exceptions.ExperimentalWarning)
                axes = draw(study)
        except (ValueError, RuntimeError):  # e.g. importances of parameters that never varied
            continue
        figure = axes.figure if hasattr(axes, "figure") else axes.flat[0].figure
        figure.set_size_inches(8, 5)
        figure.tight_layout()
        figure.savefig(folder / f"{name}.png", dpi=100)
        plt.close(figure)
        paths.append(folder / f"{name}.png")
    return paths


def _sync(
    client,
    experiment_id: str,
    params: dict[str, str],
    inputs: RunInputs,
    plan: Plan,
    options: SyncOptions,
) -> Synced:
    """Create or complete the parent and its children; the complete tag goes on last."""
    from mlflow.entities import Param, RunTag

    parent, children, run_name = plan.parent, plan.children, options.run_name
    tags = {**provenance_tags(inputs, options.config_hash), **options.source_tags, COMPLETE_TAG: "false"}
    tags.update({LAYOUT_TAG: LAYOUT_VERSION, TRAINING_TAG: str(inputs.train.run or "")})
    times = run_times(
        {rank.rank: rank.history for rank in inputs.ranks}, _seconds(inputs.train.train_seconds)
    ).parent
    if parent is None:
        parent = client.create_run(
            experiment_id,
            run_name=run_name,
            tags={RUN_TAG: run_name, **tags},
            start_time=times[0] if times else None,
        )
    else:
        client.update_run(parent.info.run_id, status="RUNNING")
        log_batches(client, parent.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    parent_id = parent.info.run_id
    try:
        missing = [Param(k, v) for k, v in params.items() if k not in parent.data.params]
        log_batches(client, parent_id, params=missing)
        datasets = run_datasets(inputs.files.manifest, inputs.manifest, options.dataset_name)
        log_datasets(client, parent, datasets.parent)
        child_ids, pushed = {}, 0
        for rank in inputs.ranks:
            child_ids[rank.rank], count = _sync_rank(
                client, experiment_id, parent_id, inputs, rank, children.get(rank.rank), options
            )
            pushed += count
        if isinstance(inputs.merge.search, dict):
            sync_trials(client, experiment_id, parent_id, run_name, inputs.merge.search, options.source_tags)
        model_id, registered = sync_parent_extras(client, experiment_id, parent, inputs, options)
        model_metrics, headline = merged_model_metrics(client, model_id, parent, inputs, options)
        log_batches(client, parent_id, metrics=model_metrics + headline)
        pushed += len(model_metrics) + len(headline)
        final_tags = [RunTag(FINGERPRINT_TAG, options.fingerprint), RunTag(COMPLETE_TAG, "true")]
        client.log_batch(parent_id, tags=final_tags)
        client.set_terminated(parent_id, "FINISHED", end_time=times[1] if times else None)
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(parent_id, "FAILED")
        raise
    return Synced(parent_id, child_ids, model_id, registered, pushed)


def check_run_config(config: dict, run_name: str) -> None:
    """The parent run carries the run's config as params: a config without the run's keys (``{}``)
    would give a complete parent with nothing to compare it by."""
    missing = [key for key in ("run", "dataset") if key not in config]
    if missing:
        raise UserError(
            f"--config-json has no {' or '.join(map(repr, missing))} key, so it is not a run's resolved "
            'config; pass the run\'s config with its name, as the track rule does ({"run": NAME, '
            '"dataset": ..., ...})'
        )
    if config["run"] != run_name:
        raise UserError(
            f"--config-json is the config of run {config['run']!r}, not of --run {run_name!r}; pass this "
            "run's config"
        )


def _dataset_name(config: dict) -> str:
    """The config's dataset name (a run config names it; a nested spec carries it as "name")."""
    dataset = config.get("dataset")
    if isinstance(dataset, dict):
        dataset = dataset.get("name")
    return str(dataset) if dataset else "dataset"


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def track_run(
    run_name: str,
    run_dir: str | os.PathLike,
    manifest_path: str | os.PathLike,
    config: dict,
    tracking_uri: str,
    experiment: str,
    registered_model: str | None = None,
    plots_dir: str | os.PathLike | None = None,
    train_dir: str | os.PathLike | None = None,
    gather_path: str | os.PathLike | None = None,
    snakefile: str | os.PathLike | None = None,
    hf_dir: str | os.PathLike | None = None,
    ddp_baseline: str | os.PathLike | None = None,
    adapter_dir: str | os.PathLike | None = None,
) -> TrackResult:
    """Sync one run to MLflow (see the module docstring); return what ``--out`` records."""
    if not isinstance(config, dict):
        raise UserError("--config-json must be a JSON object (the run's resolved config)")
    check_run_config(config, run_name)
    check_no_password(tracking_uri)
    inputs = load_inputs(
        Path(run_dir),
        Path(manifest_path),
        plots_dir=Path(plots_dir) if plots_dir else None,
        train_dir=Path(train_dir) if train_dir else None,
        gather_path=Path(gather_path) if gather_path else None,
        ddp_baseline=Path(ddp_baseline) if ddp_baseline else None,
        adapter_dir=Path(adapter_dir) if adapter_dir else None,
        mergekit=Path(config["mergekit_config"]) if config.get("mergekit_config") else None,
    )
    options = SyncOptions(
        tracking_uri=tracking_uri,
        registered_model=registered_model,
        fingerprint=fingerprint(config, inputs.files, registered_model),
        config_hash=config_hash(config),
        run_name=run_name,
        dataset_name=_dataset_name(config),
        source_tags=source_tags(Path(snakefile) if snakefile else None),
        hf_dir=Path(hf_dir) if hf_dir else None,
    )
    # The config says it first: train.json's params only add what it has no key for; the merge
    # settings are those merge.json says were used.
    params = merge_params({**inputs.params, **flatten_params(config)}, inputs.merge)
    params = partition_params(params, inputs.manifest)  # the partitioner's own keys, as the shards were cut
    if inputs.files.mergekit is not None:  # the YAML's own settings, as mergekit.<field> params
        from shardfuse.fusion.methods.mergekit import read as read_mergekit

        params |= read_mergekit(inputs.files.mergekit).logged_params()
    with tracking_errors(tracking_uri), writer_lock(tracking_uri):
        client, experiment_id = connect(tracking_uri, experiment)
        runs = search_all(client, experiment_id, f"tags.`{RUN_TAG}` = {quote_run_name(run_name)}")
        plan = plan_sync(runs, options, inputs, params)
        parent, children = plan.parent, plan.children
        keep = {parent.info.run_id} | {c.info.run_id for c in children.values()} if parent else set()
        if plan.action == "unchanged":  # the trials' child runs too; otherwise they are logged afresh
            keep |= {
                r.info.run_id
                for r in runs
                if r.data.tags.get(PARENT_TAG) in keep and TRIAL_TAG in r.data.tags
            }
        delete_runs(client, experiment_id, [r for r in runs if r.info.run_id not in keep])
        if parent is not None:  # a model an earlier, killed track left PENDING
            model_logging.delete_unfinished_models(client, experiment_id, parent.info.run_id)
        if plan.action == "unchanged":
            tags, child_ids = parent.data.tags, {rank: c.info.run_id for rank, c in children.items()}
            synced = Synced(parent.info.run_id, child_ids, tags.get(MODEL_TAG), tags.get(REGISTERED_TAG), 0)
        else:
            synced = _sync(client, experiment_id, params, inputs, plan, options)
            trained_ms = int(inputs.files.train.stat().st_mtime * 1000)
            delete_finished_live_runs(client, experiment_id, run_name, trained_ms)
    return TrackResult(
        tracking_uri=redact_uri(tracking_uri),
        experiment_name=experiment,
        experiment_id=experiment_id,
        parent_run_id=synced.parent_id,
        child_run_ids={str(rank): run_id for rank, run_id in sorted(synced.child_ids.items())},
        model_uri=f"models:/{synced.model_id}" if synced.model_id else None,
        registered_model=synced.registered,
        fingerprint=options.fingerprint,
        action=plan.action,
        num_points_pushed=synced.num_points,
    )
