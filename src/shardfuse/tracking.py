"""Push one finished run (config, per-rank step metrics, eval results, merged weights) to MLflow.

Run by hand (from the workflow's working directory):

    python -m shardfuse.tracking --run NAME --run-dir results/runs/NAME \\
        --manifest results/shards/D/w2-seed0/manifest.json --config-json '{"model": {...}, ...}' \\
        --tracking-uri sqlite:///mlflow.db --experiment shardfuse --out results/runs/NAME/mlflow.json

Layout in MLflow: one parent run per shardfuse run (run_name NAME; config as params, headline metrics,
JSON results under artifacts ``results/``, weights under ``model/``) with one nested child per rank
(run_name ``NAME/rank-{r}``; step histories of loss, samples_per_second and lr, plus its test metrics).

Idempotent: the parent carries ``shardfuse.fingerprint`` (config + every input file) and, written
last, ``shardfuse.complete=true``. A re-run with the same fingerprint touches nothing; anything else
(stale inputs, an interrupted push) soft-deletes the old runs and pushes afresh, so there is always
exactly one active parent per NAME and one point per step in each history.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shardfuse.io import StageParser, UserError, parse_json_arg, read_json, run_cli, sha256_file, write_json

RUN_TAG = "shardfuse.run"
RANK_TAG = "shardfuse.rank"
FINGERPRINT_TAG = "shardfuse.fingerprint"
COMPLETE_TAG = "shardfuse.complete"
PARENT_TAG = "mlflow.parentRunId"
STEP_METRICS = ("loss", "samples_per_second", "lr")
PARQUET_COLUMNS = ("step", *STEP_METRICS, "timestamp_ms")
# MLflow's per-request limits (mlflow.utils.validation); a larger batch is rejected outright.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
MAX_PARAM_VALUE_CHARS = 6000
# MLflow's defaults (7 retries, 120 s timeout) make an unreachable server hang for minutes.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}


def flatten_params(config: dict[str, Any], prefix: str = "") -> dict[str, str]:
    """Flatten a nested config into MLflow params: dotted keys, lists as JSON, None as "None"."""
    params: dict[str, str] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict) and value:
            params.update(flatten_params(value, prefix=f"{name}."))
            continue
        text = json.dumps(value, sort_keys=True) if isinstance(value, (list, tuple, dict)) else str(value)
        # MLflow rejects longer values; a truncated param beats a failed push.
        if len(text) > MAX_PARAM_VALUE_CHARS:
            text = text[: MAX_PARAM_VALUE_CHARS - 3] + "..."
        params[name] = text
    return params


def _require_file(path: Path, stage: str) -> Path:
    if not path.is_file():
        raise UserError(f"{path} does not exist; re-run the {stage} stage for this run first")
    return path


def _field(obj: dict, key: str, path: Path) -> Any:
    if not isinstance(obj, dict) or key not in obj:
        raise UserError(f"{path} has no '{key}' field; re-run the stage that produces it")
    return obj[key]


def _read_step_metrics(path: Path) -> dict[str, list]:
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as exc:
        raise UserError(f"{path} is not a readable Parquet file ({exc}); re-run the train stage") from None
    missing = [c for c in PARQUET_COLUMNS if c not in table.column_names]
    if missing:
        raise UserError(f"{path} lacks column(s) {', '.join(missing)}; re-run the train stage")
    return {c: table.column(c).to_pylist() for c in PARQUET_COLUMNS}


def load_inputs(run_dir: Path, manifest_path: Path) -> dict[str, Any]:
    """Read and check every file the push needs before MLflow is touched."""
    files = {
        "manifest": _require_file(manifest_path, "partition"),
        "train": _require_file(run_dir / "train" / "train.json", "train"),
        "gather": _require_file(run_dir / "gather.json", "gather"),
        "merge": _require_file(run_dir / "merge.json", "merge"),
        "weights": _require_file(run_dir / "merged.safetensors", "merge"),
        "eval": _require_file(run_dir / "eval.json", "evaluate"),
    }
    train, merge, evaluation = (read_json(files[k], k) for k in ("train", "merge", "eval"))
    read_json(files["gather"], "gather")  # only uploaded, but must be valid JSON
    try:
        world_size = int(_field(train, "world_size", files["train"]))
        shard_rows = {int(r["rank"]): int(r["rows"]) for r in _field(train, "ranks", files["train"])}
        eval_ranks = {int(r["rank"]): r for r in _field(evaluation, "ranks", files["eval"])}
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(
            f"malformed 'ranks' entry in {files['train']} or {files['eval']} ({exc!r}); "
            "re-run the train and evaluate stages"
        ) from None
    for rank in range(world_size):
        if rank not in shard_rows or rank not in eval_ranks:
            raise UserError(
                f"rank {rank} of world size {world_size} is missing from {files['train']} "
                f"or {files['eval']}; re-run the train and evaluate stages"
            )
        metrics_path = run_dir / "train" / "metrics" / f"rank-{rank}.parquet"
        files[f"metrics-{rank}"] = _require_file(metrics_path, "train")
    rank_results = {
        rank: {f"test_{k}": float(_field(eval_ranks[rank], k, files["eval"])) for k in ("accuracy", "loss")}
        for rank in range(world_size)
    }
    inputs = {
        "files": files,
        "train": train,
        "merge": merge,
        "eval": evaluation,
        "world_size": world_size,
        "shard_rows": shard_rows,
        "rank_results": rank_results,
        "steps": {rank: _read_step_metrics(files[f"metrics-{rank}"]) for rank in range(world_size)},
    }
    inputs["headline"] = headline_metrics(inputs)
    return inputs


def fingerprint(config: dict, files: dict[str, Path]) -> str:
    """sha256 over the config (sorted keys) and the sha256 of every file that goes into MLflow."""
    digest = hashlib.sha256(json.dumps(config, sort_keys=True).encode())
    for name in sorted(files):
        digest.update(f"\n{name}:{sha256_file(files[name])}".encode())
    return digest.hexdigest()


def headline_metrics(inputs: dict[str, Any]) -> dict[str, float]:
    evaluation, eval_path = inputs["eval"], inputs["files"]["eval"]
    merged = _field(evaluation, "merged", eval_path)
    best_rank = float(_field(evaluation, "best_rank_accuracy", eval_path))
    metrics = {
        "test_accuracy_merged": float(_field(merged, "accuracy", eval_path)),
        "test_loss_merged": float(_field(merged, "loss", eval_path)),
        "test_accuracy_best_rank": best_rank,
        "test_accuracy_mean_rank": float(_field(evaluation, "mean_rank_accuracy", eval_path)),
        "test_loss_mean_rank": float(_field(evaluation, "mean_rank_loss", eval_path)),
        "train_seconds": float(_field(inputs["train"], "train_seconds", inputs["files"]["train"])),
        "merge_seconds": float(_field(inputs["merge"], "seconds", inputs["files"]["merge"])),
    }
    metrics["fusion_gain"] = metrics["test_accuracy_merged"] - best_rank
    for rank, result in inputs["rank_results"].items():
        metrics[f"test_accuracy_rank_{rank}"] = result["test_accuracy"]
    return metrics


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


def _connect(tracking_uri: str, experiment: str):
    """Return (client, experiment id), creating the experiment if missing."""
    from mlflow.exceptions import MlflowException
    from mlflow.tracking import MlflowClient

    # The first calls are where a wrong URI or a dead server shows up: say so in one line.
    try:
        client = MlflowClient(tracking_uri=tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            return client, client.create_experiment(experiment)
    except MlflowException as exc:
        first_line = (str(exc.message).strip() or type(exc).__name__).splitlines()[0]
        raise UserError(
            f"cannot use tracking URI {tracking_uri} ({first_line}); check --tracking-uri "
            "and that the tracking server is running"
        ) from None
    if found.lifecycle_stage != "active":
        raise UserError(
            f"experiment '{experiment}' is deleted in {tracking_uri}; restore it "
            "(mlflow experiments restore) or pass another --experiment"
        )
    return client, found.experiment_id


def _runs_of(client, experiment_id: str, run_name: str) -> list:
    from mlflow.entities import ViewType

    quote = "'" if "'" not in run_name else '"'
    if quote in run_name:
        raise UserError(f"run name {run_name!r} contains both quote characters; rename the run")
    runs, token = [], None
    while True:
        page = client.search_runs(
            [experiment_id],
            f"tags.`{RUN_TAG}` = {quote}{run_name}{quote}",
            run_view_type=ViewType.ACTIVE_ONLY,
            max_results=1000,
            page_token=token,
        )
        runs.extend(page)
        token = page.token
        if not token:
            return runs


def _log_metrics(client, run_id: str, metrics: list) -> None:
    for start in range(0, len(metrics), MAX_METRICS_PER_BATCH):
        client.log_batch(run_id, metrics=metrics[start : start + MAX_METRICS_PER_BATCH])


def _log_params(client, run_id: str, params: dict[str, str]) -> None:
    from mlflow.entities import Param

    items = [Param(k, v) for k, v in params.items()]
    for start in range(0, len(items), MAX_PARAMS_PER_BATCH):
        client.log_batch(run_id, params=items[start : start + MAX_PARAMS_PER_BATCH])


def _push_rank(client, experiment_id: str, parent_id: str, run_name: str, rank: int, inputs: dict) -> str:
    from mlflow.entities import Metric

    child = client.create_run(
        experiment_id,
        run_name=f"{run_name}/rank-{rank}",
        tags={PARENT_TAG: parent_id, RUN_TAG: run_name, RANK_TAG: str(rank)},
    )
    child_id = child.info.run_id
    _log_params(client, child_id, {"rank": str(rank), "shard_rows": str(inputs["shard_rows"][rank])})
    steps = inputs["steps"][rank]
    history = [
        Metric(key, float(steps[key][i]), int(steps["timestamp_ms"][i]), int(steps["step"][i]))
        for key in STEP_METRICS
        for i in range(len(steps["step"]))
    ]
    now_ms = int(time.time() * 1000)
    history += [Metric(k, v, now_ms, 0) for k, v in inputs["rank_results"][rank].items()]
    _log_metrics(client, child_id, history)
    client.set_terminated(child_id, "FINISHED")
    return child_id


def _push(client, experiment_id: str, run_name: str, config: dict, inputs: dict, run_fingerprint: str):
    """Create the parent and its children; the complete tag goes on last so a crash leaves it off."""
    from mlflow.entities import Metric

    parent = client.create_run(
        experiment_id,
        run_name=run_name,
        tags={RUN_TAG: run_name, FINGERPRINT_TAG: run_fingerprint, COMPLETE_TAG: "false"},
    )
    parent_id = parent.info.run_id
    try:
        _log_params(client, parent_id, flatten_params(config))
        now_ms = int(time.time() * 1000)
        _log_metrics(client, parent_id, [Metric(k, v, now_ms, 0) for k, v in inputs["headline"].items()])
        child_ids = {
            str(rank): _push_rank(client, experiment_id, parent_id, run_name, rank, inputs)
            for rank in range(inputs["world_size"])
        }
        files = inputs["files"]
        for name in ("manifest", "train", "gather", "merge", "eval"):
            client.log_artifact(parent_id, str(files[name]), artifact_path="results")
        client.log_artifact(parent_id, str(files["weights"]), artifact_path="model")
        client.set_tag(parent_id, COMPLETE_TAG, "true")
        client.set_terminated(parent_id, "FINISHED")
    except BaseException:
        with contextlib.suppress(Exception):
            client.set_terminated(parent_id, "FAILED")
        raise
    return parent_id, child_ids


def track_run(
    run_name: str,
    run_dir: str | os.PathLike,
    manifest_path: str | os.PathLike,
    config: dict,
    tracking_uri: str,
    experiment: str,
) -> dict:
    """Push one run to MLflow idempotently; return what ``--out`` records."""
    if not isinstance(config, dict):
        raise UserError("--config-json must be a JSON object (the run's resolved config)")
    inputs = load_inputs(Path(run_dir), Path(manifest_path))
    run_fingerprint = fingerprint(config, inputs["files"])
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)

    with writer_lock(tracking_uri):
        client, experiment_id = _connect(tracking_uri, experiment)
        runs = _runs_of(client, experiment_id, run_name)
        parents = [r for r in runs if PARENT_TAG not in r.data.tags]
        keep = None
        if len(parents) == 1:
            tags = parents[0].data.tags
            children = [r for r in runs if r.data.tags.get(PARENT_TAG) == parents[0].info.run_id]
            if (
                tags.get(FINGERPRINT_TAG) == run_fingerprint
                and tags.get(COMPLETE_TAG) == "true"
                and len(children) == inputs["world_size"]
            ):
                keep = parents[0].info.run_id
        # Everything else with this run's tag is stale: other parents, their children, strays.
        stale = [r for r in runs if keep is None or keep not in (r.info.run_id, r.data.tags.get(PARENT_TAG))]
        for run in stale:
            client.delete_run(run.info.run_id)
        if keep is not None:
            parent_id, action = keep, "unchanged"
            child_ids = {
                r.data.tags[RANK_TAG]: r.info.run_id for r in runs if r.data.tags.get(PARENT_TAG) == keep
            }
        else:
            action = "replaced" if stale else "created"
            parent_id, child_ids = _push(client, experiment_id, run_name, config, inputs, run_fingerprint)
    return {
        "tracking_uri": tracking_uri,
        "experiment_name": experiment,
        "experiment_id": experiment_id,
        "parent_run_id": parent_id,
        "child_run_ids": dict(sorted(child_ids.items(), key=lambda kv: int(kv[0]))),
        "fingerprint": run_fingerprint,
        "action": action,
    }


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="shardfuse.tracking", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run name (the {run} wildcard)")
    parser.add_argument("--run-dir", required=True, type=Path, help="results/runs/{run}")
    parser.add_argument("--manifest", required=True, type=Path, help="the shards' manifest.json")
    parser.add_argument("--config-json", required=True, help="the run's resolved config as a JSON object")
    parser.add_argument("--tracking-uri", required=True, help="e.g. sqlite:///mlflow.db or http://host:5000")
    parser.add_argument("--experiment", default="shardfuse", help="MLflow experiment (created if missing)")
    parser.add_argument("--out", required=True, type=Path, help="where to write the run ids (JSON)")
    args = parser.parse_args(argv)
    config = parse_json_arg(args.config_json, "--config-json")
    result = track_run(args.run, args.run_dir, args.manifest, config, args.tracking_uri, args.experiment)
    write_json(args.out, result)
    print(
        f"shardfuse.tracking: {result['action']} parent run {result['parent_run_id']} with "
        f"{len(result['child_run_ids'])} rank runs in experiment '{args.experiment}'",
        file=sys.stderr,
    )


if __name__ == "__main__":
    run_cli(main)
