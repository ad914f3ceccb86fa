"""Push one finished run (config, per-rank step metrics, results, plots, merged model) to MLflow.

Run by hand (from the workflow's working directory)::

    python -m shardfuse.tracking --run NAME --run-dir results/runs/NAME \\
        [--train-dir results/trainings/T/ranks --gather results/trainings/T/gather.json] \\
        --manifest results/shards/D/w2-seed0/manifest.json --config-json '{"model": {...}, ...}' \\
        --tracking-uri sqlite:///mlflow.db --experiment shardfuse [--registered-model NAME] \\
        [--plots-dir results/runs/NAME/plots] --out results/runs/NAME/mlflow.json

Layout in MLflow: one parent run per shardfuse run (run_name NAME; the resolved config as params;
headline metrics; tags for git commit/dirty, snakemake/torch versions, hosts, SLURM job id, config hash;
JSON results under ``results/``, plots under ``plots/``; the merged model as an MLflow pyfunc model
``model``, optionally registered) with one nested child per rank (``NAME/rank-{r}``: loss, throughput and
lr by step with their original timestamps, plus its test metrics).

The files are the source of truth and this is the only writer, so the push is a sync:
- inputs unchanged (``shardfuse.fingerprint``, written last with ``shardfuse.complete=true``): nothing
  is written (``unchanged``);
- same config, histories that only grew (more steps, an interrupted push, a new evaluation): only the
  missing points are appended, changed headline metrics get a new point at step ``num_steps``, changed
  files are re-uploaded, changed weights logged as a new model (``updated``);
- another config or a rewritten history (re-trained): the old runs are soft-deleted and everything is
  pushed afresh (``replaced``).
Histories go in step order, whole rows per log_batch (333 rows = 999 points, MLflow's limit is 1000).
A finished history gets ``shardfuse.synced = ROWS:SHA256`` (rows pushed, hash of those rows); after a
push killed midway, the latest point of each key (which MLflow keeps with the run) says where to go on,
so a re-run neither loses nor doubles a point, and a rewritten history is told apart.
Live runs (``shardfuse.live``) of the same run name that started before the pushed training finished
are soft-deleted once the push is complete.

This module is the MLflow side (connection, writer lock, errors, batching, history sync, run planning);
what is pushed (the files read and checked, params, headline metrics, provenance tags, the fingerprint)
comes from :mod:`shardfuse.tracking_inputs`.
"""

from __future__ import annotations

import contextlib
import fcntl
import gc
import hashlib
import os
import re
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse import mlflow_model
from shardfuse.io import StageParser, UserError, parse_json_arg, run_cli, sha256_file, write_json
from shardfuse.tracking_inputs import (
    CONFIG_HASH_TAG,
    RESULT_FILES,
    STEP_METRICS,
    config_hash,
    fingerprint,
    flatten_params,
    load_inputs,
    provenance_tags,
)

RUN_TAG = "shardfuse.run"
RANK_TAG = "shardfuse.rank"
FINGERPRINT_TAG = "shardfuse.fingerprint"
COMPLETE_TAG = "shardfuse.complete"
SYNCED_TAG = "shardfuse.synced"
ARTIFACTS_TAG = "shardfuse.artifacts_sha256"
MODEL_TAG = "shardfuse.model_id"
REGISTERED_TAG = "shardfuse.registered_model"
LIVE_TAG = "shardfuse.live"
LIVE_RUN_TAG = "shardfuse.live_run"
PARENT_TAG = "mlflow.parentRunId"
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # the UI's "model training" kind
# MLflow's per-request limits (mlflow.utils.validation); a larger batch is rejected outright.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
ROWS_PER_BATCH = MAX_METRICS_PER_BATCH // len(STEP_METRICS)  # whole rows: 333 rows = 999 points
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()
# MLflow's defaults (7 retries, 120 s timeout) make an unreachable server hang for minutes.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
RERUN_HINT = "start the server or fix mlflow.tracking_uri, then re-run `snakemake -R track`"


def redact_uri(uri: str) -> str:
    """``scheme://user:secret@host`` -> ``scheme://***@host``: URIs end up in logs and mlflow.json."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/@]*@", r"\1***@", uri)


def check_no_password(tracking_uri: str) -> None:
    """Credentials come from the environment only: a URI ends up in logs, outputs and MLflow's messages."""
    if re.match(r"^[A-Za-z][\w+.-]*://[^/@]*:[^/@]*@", tracking_uri):
        raise UserError(
            f"tracking URI {redact_uri(tracking_uri)} has a password in it; remove it and set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or PGPASSFILE for a database) instead"
        )


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a sqlite:///PATH URI (relative or, with four slashes, absolute)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


@contextlib.contextmanager
def writer_lock(tracking_uri: str) -> Iterator[None]:
    """Serialise writers of one SQLite store: concurrent writers (and migrations) hit 'database is locked'."""
    db_path = _sqlite_path(tracking_uri)
    if db_path is None:
        yield
        return
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db_path}.lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def tracking_errors(tracking_uri: str) -> Iterator[None]:
    """A dead server or broken store is one line that says how to finish the job later."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, requests.RequestException, ConnectionError) as exc:
        text = str(getattr(exc, "message", exc)).strip() or type(exc).__name__
        reason = text.splitlines()[0][:300]
        raise UserError(
            f"cannot use tracking URI {redact_uri(tracking_uri)} ({reason}); {RERUN_HINT}: "
            "the local results are kept and only what is missing in MLflow is uploaded"
        ) from None


def connect(tracking_uri: str, experiment: str):
    """Return (client, experiment id), creating the experiment if missing."""
    from mlflow.tracking import MlflowClient

    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)
    client = MlflowClient(tracking_uri=tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return client, client.create_experiment(experiment, tags=EXPERIMENT_TAGS)
    if found.lifecycle_stage != "active":
        raise UserError(
            f"experiment '{experiment}' is deleted in {redact_uri(tracking_uri)}; restore it "
            "(mlflow experiments restore) or pass another --experiment"
        )
    return client, found.experiment_id


def _quote(value: str) -> str:
    quote = "'" if "'" not in value else '"'
    if quote in value:
        raise UserError(f"run name {value!r} contains both quote characters; rename the run")
    return f"{quote}{value}{quote}"


def search_all(client, experiment_id: str, filter_string: str) -> list:
    from mlflow.entities import ViewType

    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            filter_string,
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def log_batches(client, run_id: str, metrics=(), params=(), tags=()) -> None:
    """log_batch within MLflow's per-request limits."""
    metrics, params, tags = list(metrics), list(params), list(tags)
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])
    for start in range(0, len(params), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=params[start : start + MAX_PARAMS_PER_BATCH])
    for start in range(0, len(tags), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, tags=tags[start : start + MAX_PARAMS_PER_BATCH])


def _history_rows(steps: dict[str, np.ndarray]) -> np.ndarray:
    """One float64 row per step (step, timestamp, metrics): its prefix hash identifies what was pushed."""
    columns = ("step", "timestamp_ms", *STEP_METRICS)
    return np.ascontiguousarray(np.column_stack([steps[c].astype(np.float64) for c in columns]))


def _same(stored: float, value: float) -> bool:
    return stored == value or (np.isnan(stored) and np.isnan(value))


def _synced_rows(child, rows: np.ndarray) -> int | None:
    """Rows of ``rows`` already in the child run, or None if its history is not a prefix of them.

    The synced tag (set once a history is complete) vouches for a hashed prefix; a push killed midway
    left its last whole batch as the latest point of each key, which MLflow returns with the run.
    """
    count, _, digest = child.data.tags.get(SYNCED_TAG, f"0:{EMPTY_SHA256}").partition(":")
    if not count.isdigit() or int(count) > len(rows):
        return None
    if hashlib.sha256(rows[: int(count)].tobytes()).hexdigest() != digest:
        return None
    # RunData keeps the latest Metric objects (with step and timestamp) only privately.
    latest = {m.key: m for m in getattr(child.data, "_metric_objs", []) if m.key in STEP_METRICS}
    if len(latest) < len(STEP_METRICS):
        return int(count)
    step = min(m.step for m in latest.values())
    (matches,) = np.nonzero(rows[:, 0] == step)
    if not len(matches):
        return None
    row = rows[matches[0]]
    for k, key in enumerate(STEP_METRICS):
        point = latest[key]
        if point.step == step and (point.timestamp != row[1] or not _same(point.value, row[2 + k])):
            return None
    return max(int(count), int(matches[0]) + 1)


def _changed_metrics(current: dict[str, float], wanted: dict[str, float], step: int) -> list:
    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    return [Metric(k, v, now_ms, step) for k, v in wanted.items() if current.get(k) != v]


def sync_history(client, run_id: str, rows: np.ndarray, start: int) -> int:
    """Append rows[start:] as points, whole rows per log_batch, in step order. Returns points pushed."""
    from mlflow.entities import Metric

    steps = rows[:, 0].astype(np.int64).tolist()
    stamps = rows[:, 1].astype(np.int64).tolist()
    values = [rows[:, 2 + i].tolist() for i in range(len(STEP_METRICS))]
    pushed = 0
    with _gc_paused():
        for begin in range(start, len(rows), ROWS_PER_BATCH):
            batch = [
                Metric(key, values[k][i], stamps[i], steps[i])
                for i in range(begin, min(begin + ROWS_PER_BATCH, len(rows)))
                for k, key in enumerate(STEP_METRICS)
            ]
            client.log_batch(run_id, metrics=batch)
            pushed += len(batch)
    return pushed


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Each batch makes thousands of short-lived objects (Metric, ORM rows) and no cycles: the cyclic
    collector would only rescan them, costing 10-20% of the push."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _sync_rank(client, experiment_id: str, parent_id: str, run_name: str, rank: int, child, inputs) -> tuple:
    from mlflow.entities import Param, RunTag

    rows = _history_rows(inputs["steps"][rank])
    if child is None:
        tags = {PARENT_TAG: parent_id, RUN_TAG: run_name, RANK_TAG: str(rank)}
        child = client.create_run(experiment_id, run_name=f"{run_name}/rank-{rank}", tags=tags)
    child_id = child.info.run_id
    pushed = sync_history(client, child_id, rows, _synced_rows(child, rows) or 0)
    # After the history, in one request: the tag that vouches for it, test metrics, params, host.
    num_steps = int(inputs["train"].get("num_steps", len(rows)))
    final = _changed_metrics(child.data.metrics, inputs["rank_results"][rank], num_steps)
    params = {"rank": str(rank), "shard_rows": str(inputs["shard_rows"][rank])}
    tags = {SYNCED_TAG: f"{len(rows)}:{hashlib.sha256(rows.tobytes()).hexdigest()}"}
    if rank in inputs["hosts"]:
        tags["shardfuse.host"] = inputs["hosts"][rank]
    params = [Param(k, v) for k, v in params.items() if child.data.params.get(k) != v]
    tags = [RunTag(k, v) for k, v in tags.items() if child.data.tags.get(k) != v]
    if final or params or tags:
        client.log_batch(child_id, metrics=final, params=params, tags=tags)
    if child.info.status != "FINISHED":
        client.set_terminated(child_id, "FINISHED")
    return child_id, pushed + len(final)


def _sync_parent_extras(client, experiment_id: str, parent, inputs: dict, tracking_uri: str, options: dict):
    """Artifacts, the MLflow model and its registration: each skipped when already there."""
    parent_id, tags = parent.info.run_id, parent.data.tags
    files = inputs["files"]
    uploads = [(files[name], "results") for name in RESULT_FILES]
    uploads += [(path, "plots") for name, path in files.items() if name.startswith("plot-")]
    artifacts_sha = hashlib.sha256("".join(f"{d}/{p.name}:{sha256_file(p)}\n" for p, d in uploads).encode())
    if tags.get(ARTIFACTS_TAG) != artifacts_sha.hexdigest():
        for path, directory in uploads:
            client.log_artifact(parent_id, str(path), artifact_path=directory)
        client.set_tag(parent_id, ARTIFACTS_TAG, artifacts_sha.hexdigest())
    weights_sha = sha256_file(files["weights"])
    model = mlflow_model.find_logged_model(client, experiment_id, parent_id, weights_sha)
    model_id = model.model_id if model is not None else None
    if model_id is None:
        model_id = mlflow_model.log_merged_model(
            tracking_uri, parent_id, files["weights"], weights_sha, inputs["model_spec"]
        )
    if tags.get(MODEL_TAG) != model_id:
        mlflow_model.delete_unregistered_models(client, experiment_id, parent_id, keep=model_id)
        client.set_tag(parent_id, MODEL_TAG, model_id)
    registered = None
    if options.get("registered_model"):
        version = mlflow_model.register_model(client, options["registered_model"], parent_id, model_id)
        registered = f"{options['registered_model']}/{version}"
        if tags.get(REGISTERED_TAG) != registered:
            client.set_tag(parent_id, REGISTERED_TAG, registered)
    return model_id, registered


def _delete_runs(client, experiment_id: str, runs: list) -> None:
    for run in runs:
        if PARENT_TAG not in run.data.tags:
            mlflow_model.delete_unregistered_models(client, experiment_id, run.info.run_id)
        client.delete_run(run.info.run_id)


def _delete_finished_live_runs(client, experiment_id: str, run_name: str, trained_before_ms: int) -> None:
    """Live runs only mirror what the parent now holds; keep a live run of a training still going on."""
    for run in search_all(client, experiment_id, f"tags.`{LIVE_RUN_TAG}` = {_quote(run_name)}"):
        if run.info.start_time <= trained_before_ms:
            client.delete_run(run.info.run_id)


def _plan(runs: list, run_fingerprint: str, run_config_hash: str, inputs: dict):
    """Pick what to do with the runs already in MLflow: (action, parent or None, {rank: child})."""
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    if len(parents) != 1:
        return ("replaced" if runs else "created"), None, {}
    parent = parents[0]
    children: dict[int, Any] = {}
    for run in runs:
        rank = run.data.tags.get(RANK_TAG, "")
        if run.data.tags.get(PARENT_TAG) != parent.info.run_id or not rank.isdigit():
            continue
        rows = _history_rows(inputs["steps"][int(rank)]) if int(rank) in inputs["steps"] else None
        if rows is None or _synced_rows(run, rows) is None:
            return "replaced", None, {}  # a re-trained (rewritten) history or another world size
        best = children.get(int(rank))  # a lost create_run response may leave two: keep the fuller one
        if best is None or _synced_rows(run, rows) > _synced_rows(best, rows):
            children[int(rank)] = run
    tags = parent.data.tags
    if tags.get(CONFIG_HASH_TAG) != run_config_hash:
        return "replaced", None, {}
    if (
        tags.get(FINGERPRINT_TAG) == run_fingerprint
        and tags.get(COMPLETE_TAG) == "true"
        and len(children) == inputs["world_size"]
    ):
        return "unchanged", parent, children
    return "updated", parent, children


def _sync(client, experiment_id: str, run_name: str, config: dict, inputs: dict, plan: tuple, options: dict):
    """Create or complete the parent and its children; the complete tag goes on last."""
    from mlflow.entities import Param, RunTag

    _, parent, children = plan
    tags = {**provenance_tags(inputs, options["config_hash"]), COMPLETE_TAG: "false"}
    if parent is None:
        parent = client.create_run(experiment_id, run_name=run_name, tags={RUN_TAG: run_name, **tags})
    else:
        client.update_run(parent.info.run_id, status="RUNNING")
        log_batches(client, parent.info.run_id, tags=[RunTag(k, v) for k, v in tags.items()])
    parent_id = parent.info.run_id
    try:
        params = [Param(k, v) for k, v in flatten_params(config).items() if k not in parent.data.params]
        num_steps = int(inputs["train"].get("num_steps", 0))
        headline = _changed_metrics(parent.data.metrics, inputs["headline"], num_steps)
        log_batches(client, parent_id, metrics=headline, params=params)
        pushed = len(headline)
        child_ids = {}
        for rank in range(inputs["world_size"]):
            child_ids[str(rank)], count = _sync_rank(
                client, experiment_id, parent_id, run_name, rank, children.get(rank), inputs
            )
            pushed += count
        model_id, registered = _sync_parent_extras(
            client, experiment_id, parent, inputs, options["uri"], options
        )
        final_tags = [RunTag(FINGERPRINT_TAG, options["fingerprint"]), RunTag(COMPLETE_TAG, "true")]
        client.log_batch(parent_id, tags=final_tags)
        client.set_terminated(parent_id, "FINISHED")
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(parent_id, "FAILED")
        raise
    return parent_id, child_ids, model_id, registered, pushed


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
) -> dict:
    """Sync one run to MLflow (see the module docstring); return what ``--out`` records."""
    if not isinstance(config, dict):
        raise UserError("--config-json must be a JSON object (the run's resolved config)")
    check_no_password(tracking_uri)
    inputs = load_inputs(
        Path(run_dir),
        Path(manifest_path),
        plots_dir=Path(plots_dir) if plots_dir else None,
        train_dir=Path(train_dir) if train_dir else None,
        gather_path=Path(gather_path) if gather_path else None,
    )
    options = {
        "uri": tracking_uri,
        "registered_model": registered_model,
        "fingerprint": fingerprint(config, inputs["files"], registered_model),
        "config_hash": config_hash(config),
    }
    with writer_lock(tracking_uri), tracking_errors(tracking_uri):
        client, experiment_id = connect(tracking_uri, experiment)
        runs = search_all(client, experiment_id, f"tags.`{RUN_TAG}` = {_quote(run_name)}")
        plan = _plan(runs, options["fingerprint"], options["config_hash"], inputs)
        action, parent, children = plan
        keep = {parent.info.run_id} | {c.info.run_id for c in children.values()} if parent else set()
        _delete_runs(client, experiment_id, [r for r in runs if r.info.run_id not in keep])
        if action == "unchanged":
            parent_id, pushed = parent.info.run_id, 0
            child_ids = {str(rank): child.info.run_id for rank, child in children.items()}
            model_id, registered = parent.data.tags.get(MODEL_TAG), parent.data.tags.get(REGISTERED_TAG)
        else:
            parent_id, child_ids, model_id, registered, pushed = _sync(
                client, experiment_id, run_name, config, inputs, plan, options
            )
            trained_ms = int(inputs["files"]["train"].stat().st_mtime * 1000)
            _delete_finished_live_runs(client, experiment_id, run_name, trained_ms)
    return {
        "tracking_uri": redact_uri(tracking_uri),
        "experiment_name": experiment,
        "experiment_id": experiment_id,
        "parent_run_id": parent_id,
        "child_run_ids": dict(sorted(child_ids.items(), key=lambda kv: int(kv[0]))),
        "model_uri": f"models:/{model_id}" if model_id else None,
        "registered_model": registered,
        "fingerprint": options["fingerprint"],
        "action": action,
        "num_points_pushed": pushed,
    }


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="shardfuse.tracking", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run name (the {run} wildcard)")
    parser.add_argument("--run-dir", required=True, type=Path, help="results/runs/{run}")
    parser.add_argument("--train-dir", type=Path, help="train.json + metrics/ (default: RUN_DIR/train)")
    parser.add_argument(
        "--gather", type=Path, help="the training's gather.json (default: RUN_DIR/gather.json)"
    )
    parser.add_argument("--manifest", required=True, type=Path, help="the shards' manifest.json")
    parser.add_argument("--config-json", required=True, help="the run's resolved config as a JSON object")
    parser.add_argument("--tracking-uri", required=True, help="e.g. sqlite:///mlflow.db or http://host:5000")
    parser.add_argument("--experiment", default="shardfuse", help="MLflow experiment (created if missing)")
    parser.add_argument("--registered-model", help="also register the merged model under this name")
    parser.add_argument("--plots-dir", type=Path, help="upload its *.png under plots/ (skipped if missing)")
    parser.add_argument("--out", required=True, type=Path, help="where to write the run ids (JSON)")
    args = parser.parse_args(argv)
    config = parse_json_arg(args.config_json, "--config-json")
    started = time.perf_counter()
    result = track_run(
        args.run, args.run_dir, args.manifest, config, args.tracking_uri, args.experiment,
        registered_model=args.registered_model, plots_dir=args.plots_dir, train_dir=args.train_dir,
        gather_path=args.gather,
    )  # fmt: skip
    write_json(args.out, result)
    print(
        f"shardfuse.tracking: {result['action']} parent run {result['parent_run_id']} with "
        f"{len(result['child_run_ids'])} rank runs in experiment '{args.experiment}' "
        f"({result['num_points_pushed']} metric points in {time.perf_counter() - started:.1f} s)",
        file=sys.stderr,
    )


if __name__ == "__main__":
    run_cli(main)
