"""Push finished runs (config, per-rank step metrics, results, plots, merged model) to MLflow.

Run by hand (from the workflow's working directory)::

    python -m shardfuse.tracking --run NAME --run-dir results/runs/NAME \\
        [--train-dir results/trainings/T/ranks --gather results/trainings/T/gather.json] \\
        --manifest results/shards/D/w2-seed0/manifest.json --config-json '{"model": {...}, ...}' \\
        --tracking-uri sqlite:///mlflow.db --experiment shardfuse [--registered-model NAME] \\
        [--plots-dir results/runs/NAME/plots] --out results/runs/NAME/mlflow.json

The workflow's one ``track`` job pushes every run in one process (one import of MLflow, one store
connection; unchanged runs cost a search each): ``--runs-json '[{"run": NAME, "run_dir": ...,
"manifest": ..., "config": {...}, "out": ...}, ...]'`` instead of the single-run flags.

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

The files are the source of truth and this is the only writer, so the push is a sync:
- inputs unchanged (``shardfuse.fingerprint``, written last with ``shardfuse.complete=true``): nothing
  is written (``unchanged``);
- same config, histories that only grew (more steps, an interrupted push, a new evaluation): only the
  missing points are appended, changed headline metrics get a new (later) point at step 0, changed
  files are re-uploaded, changed weights logged as a new model (``updated``);
- another config or a rewritten history (re-trained): the old runs are soft-deleted and everything is
  pushed afresh (``replaced``).
Histories go in step order, whole rows per log_batch, and a push killed midway goes on where it
stopped, neither losing nor doubling a point (:mod:`shardfuse.track.push`); each sparse series
(grad_norm, val_<score>) the same way, vouched for by its own ``shardfuse.synced.<metric>`` tag.
Live runs (``shardfuse.track.live``) of the same run name that started before the pushed training finished
are soft-deleted once the push is complete.

This module is the MLflow side (run planning, parent and rank runs; the artifacts, the model and
datasets as inputs in :mod:`shardfuse.track.parent`), built from
the paged search, batched writes and history sync of :mod:`shardfuse.track.push`; the client, writer
lock and error gate it shares with the comparison stage and the live logger are in
:mod:`shardfuse.track.client`; what is pushed (the files read and checked, params, headline metrics,
provenance tags, the fingerprint) comes from :mod:`shardfuse.track.inputs`. The stage imports no
torch: the model spec comes from the merged weights' JSON header, and the model is logged without
loading it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from pathlib import Path
from typing import Any, Literal, NamedTuple, TypedDict

from shardfuse.io import (
    StageParser,
    UserError,
    error_line,
    parse_json_arg,
    read_json,
    run_cli,
    user_error_message,
    write_json,
    write_line,
)
from shardfuse.track import model as mlflow_model
from shardfuse.track.client import (
    EXPERIMENT_TAGS,
    LIVE_RUN_TAG,
    check_no_password,
    exit_now,
    redact_uri,
    tracking_client,
    tracking_errors,
    writer_lock,
)
from shardfuse.track.inputs import (
    CONFIG_HASH_TAG,
    LAYOUT_VERSION,
    RankInputs,
    RunInputs,
    config_hash,
    fingerprint,
    flatten_params,
    load_inputs,
    provenance_tags,
)
from shardfuse.track.parent import (
    MODEL_TAG,
    REGISTERED_TAG,
    SUMMARY_STEP,
    SyncOptions,
    log_datasets,
    merged_model_metrics,
    sync_parent_extras,
)
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
from shardfuse.track.ui import merge_params, run_datasets, run_times, source_tags

RUN_TAG = "shardfuse.run"
RANK_TAG = "shardfuse.rank"
FINGERPRINT_TAG = "shardfuse.fingerprint"
COMPLETE_TAG = "shardfuse.complete"
PARENT_TAG = "mlflow.parentRunId"
LAYOUT_TAG = "shardfuse.layout"  # LAYOUT_VERSION of the push that made the run: another one is replaced
TRAINING_TAG = "shardfuse.training"  # the training the run merged (runs that share one share it)

# What a sync does with the runs already in MLflow (also the ``action`` that ``--out`` records).
Action = Literal["created", "replaced", "updated", "unchanged"]


class Plan(NamedTuple):
    """What to do with the runs already in MLflow, and which of them to keep."""

    action: Action
    parent: Any  # mlflow Run, None for "created" and "replaced" (everything is pushed afresh)
    children: dict[int, Any]  # rank -> its mlflow Run (kept runs only)


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


def connect(tracking_uri: str, experiment: str):
    """Return (the process's client for the URI, experiment id), creating the experiment if missing."""
    client = tracking_client(tracking_uri)
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
    params = [Param(k, v) for k, v in params.items() if child.data.params.get(k) != v]
    tags = [RunTag(k, v) for k, v in tags.items() if child.data.tags.get(k) != v]
    if final or params or tags:
        client.log_batch(child_id, metrics=final, params=params, tags=tags)
    shard = run_datasets(inputs.files.manifest, inputs.manifest, options.dataset_name).ranks.get(rank.rank)
    if shard is not None:
        log_datasets(client, child, [shard])
    if child.info.status != "FINISHED" or (times and child.info.end_time != times[1]):
        client.set_terminated(child_id, "FINISHED", end_time=times[1] if times else None)
    return child_id, pushed + len(final)


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


def _plan(runs: list, options: SyncOptions, inputs: RunInputs, params: dict[str, str]) -> Plan:
    """Pick what to do with the runs already in MLflow."""
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    if len(parents) != 1:
        return Plan("replaced" if runs else "created", None, {})
    parent = parents[0]
    children: dict[int, Any] = {}
    for run in runs:
        rank = run.data.tags.get(RANK_TAG, "")
        if run.data.tags.get(PARENT_TAG) != parent.info.run_id or not rank.isdigit():
            continue
        known = inputs.ranks[int(rank)] if int(rank) < inputs.world_size else None
        rows = history_rows(known.history) if known is not None else None
        if rows is None or synced_rows(run, rows) is None:
            return Plan("replaced", None, {})  # a re-trained (rewritten) history or another world size
        if any(series_synced(run, metric, points) is None for metric, points in known.series.items()):
            return Plan("replaced", None, {})
        best = children.get(int(rank))  # a lost create_run response may leave two: keep the fuller one
        if best is None or synced_rows(run, rows) > synced_rows(best, rows):
            children[int(rank)] = run
    tags = parent.data.tags
    if tags.get(CONFIG_HASH_TAG) != options.config_hash or tags.get(LAYOUT_TAG) != LAYOUT_VERSION:
        return Plan("replaced", None, {})
    if any(parent.data.params.get(key, value) != value for key, value in params.items()):
        return Plan("replaced", None, {})  # params are immutable: train.json says otherwise now
    if (
        tags.get(FINGERPRINT_TAG) == options.fingerprint
        and tags.get(COMPLETE_TAG) == "true"
        and len(children) == inputs.world_size
    ):
        return Plan("unchanged", parent, children)
    return Plan("updated", parent, children)


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
    with tracking_errors(tracking_uri), writer_lock(tracking_uri):
        client, experiment_id = connect(tracking_uri, experiment)
        runs = search_all(client, experiment_id, f"tags.`{RUN_TAG}` = {_quote(run_name)}")
        plan = _plan(runs, options, inputs, params)
        parent, children = plan.parent, plan.children
        keep = {parent.info.run_id} | {c.info.run_id for c in children.values()} if parent else set()
        _delete_runs(client, experiment_id, [r for r in runs if r.info.run_id not in keep])
        if parent is not None:  # a model an earlier, killed track left PENDING
            mlflow_model.delete_unfinished_models(client, experiment_id, parent.info.run_id)
        if plan.action == "unchanged":
            tags, child_ids = parent.data.tags, {rank: c.info.run_id for rank, c in children.items()}
            synced = Synced(parent.info.run_id, child_ids, tags.get(MODEL_TAG), tags.get(REGISTERED_TAG), 0)
        else:
            synced = _sync(client, experiment_id, params, inputs, plan, options)
            trained_ms = int(inputs.files.train.stat().st_mtime * 1000)
            _delete_finished_live_runs(client, experiment_id, run_name, trained_ms)
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


# The per-run options of --runs-json (each entry): the single-run flags without their dashes.
RUN_FIELDS = (
    "run", "run_dir", "manifest", "config", "out", "train_dir", "gather", "plots_dir", "ddp_baseline",
    "hf_dir", "adapter_dir",
)  # fmt: skip
REQUIRED_RUN_FIELDS = ("run", "run_dir", "manifest", "config", "out")


def runs_from_json(text: str) -> list[dict[str, Any]]:
    """The runs of ``--runs-json``: a JSON list of objects with RUN_FIELDS (paths as text), inline or, as
    ``@PATH``, in a file (the workflow's: a command line holds at most 128 KiB, a sweep's configs more)."""
    if text.startswith("@"):
        entries = read_json(text[1:], "--runs-json file")
    else:
        entries = parse_json_arg(text, "--runs-json")
    if not isinstance(entries, list) or not entries:
        raise UserError('--runs-json must be a non-empty JSON list of runs, e.g. \'[{"run": "ddp", ...}]\'')
    names = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UserError(f"--runs-json entry {index} is not a JSON object; give one object per run")
        missing = [key for key in REQUIRED_RUN_FIELDS if not entry.get(key)]
        unknown = sorted(set(entry) - set(RUN_FIELDS))
        if missing or unknown:
            problem = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
            raise UserError(
                f"--runs-json entry {index} {problem}; each run needs {', '.join(REQUIRED_RUN_FIELDS)} "
                f"and may have {', '.join(RUN_FIELDS[len(REQUIRED_RUN_FIELDS) :])}"
            )
        names.append(entry["run"])
    if len(set(names)) != len(names):
        raise UserError(f"--runs-json names a run twice ({', '.join(names)}); give each run once")
    return entries


def track_and_record(entry: dict[str, Any], args) -> None:
    """Sync one run (an entry of RUN_FIELDS) and write its ``--out`` record; one line on stderr."""
    started = time.perf_counter()
    result = track_run(
        entry["run"], entry["run_dir"], entry["manifest"], entry["config"], args.tracking_uri,
        args.experiment, registered_model=args.registered_model, plots_dir=entry.get("plots_dir"),
        train_dir=entry.get("train_dir"), gather_path=entry.get("gather"), snakefile=args.snakefile,
        hf_dir=entry.get("hf_dir"), ddp_baseline=entry.get("ddp_baseline") or None,
        adapter_dir=entry.get("adapter_dir"),
    )  # fmt: skip
    write_json(entry["out"], result)
    print(
        f"shardfuse.tracking: {result['action']} parent run {result['parent_run_id']} of {entry['run']} "
        f"with {len(result['child_run_ids'])} rank runs in experiment '{args.experiment}' "
        f"({result['num_points_pushed']} metric points in {time.perf_counter() - started:.1f} s)",
        file=sys.stderr,
    )


def track_all(entries: list[dict[str, Any]], args) -> None:
    """Sync every run in one process (one import of MLflow, one store connection): a run that fails
    is one error line naming it, and the others are still pushed; then one error if any failed."""
    failed = []
    for entry in entries:
        try:
            track_and_record(entry, args)
        except Exception as exc:
            message = user_error_message(exc)  # a UserError, or a broken file or store (io.foreign_error)
            if message is None:
                raise  # a bug: its traceback
            failed.append(entry["run"])
            write_line(error_line("shardfuse.tracking", f"run {entry['run']}: {message}"))
    if failed:
        raise UserError(
            f"{len(failed)} of {len(entries)} runs were not tracked ({', '.join(failed)}; their errors are "
            "above); the others are in MLflow, and re-running pushes only what is missing"
        )


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="shardfuse.tracking", description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="run name (the {run} wildcard)")
    parser.add_argument("--run-dir", type=Path, help="results/runs/{run}")
    parser.add_argument("--train-dir", type=Path, help="train.json + metrics/ (default: RUN_DIR/train)")
    parser.add_argument(
        "--gather", type=Path, help="the training's gather.json (default: RUN_DIR/gather.json)"
    )
    parser.add_argument("--manifest", type=Path, help="the shards' manifest.json")
    parser.add_argument("--config-json", help="the run's resolved config as a JSON object")
    parser.add_argument(
        "--runs-json",
        help="several runs in one process instead of --run ... --out: a JSON list of objects with "
        f"the keys {', '.join(RUN_FIELDS)}, or @FILE holding it (the workflow's track job)",
    )
    parser.add_argument("--tracking-uri", required=True, help="e.g. sqlite:///mlflow.db or http://host:5000")
    parser.add_argument("--experiment", default="shardfuse", help="MLflow experiment (created if missing)")
    parser.add_argument("--registered-model", help="also register the merged model under this name")
    parser.add_argument("--plots-dir", type=Path, help="upload its *.png under plots/ (skipped if missing)")
    parser.add_argument(
        "--ddp-baseline", nargs="?", default="", help="eval.json of the ddp run trained alike, if any"
    )
    parser.add_argument(
        "--hf-dir", type=Path, help="model hf: the run's transformers export (shardfuse.export)"
    )
    parser.add_argument(
        "--adapter-dir", type=Path, help="merge_adapter: the run's PEFT adapter (shardfuse.export_adapter)"
    )
    parser.add_argument(
        "--snakefile", type=Path, help="the workflow's Snakefile, the runs' Source (default: ./Snakefile)"
    )
    parser.add_argument("--out", type=Path, help="where to write the run ids (JSON)")
    args = parser.parse_args(argv)
    single = {"--run": args.run, "--run-dir": args.run_dir, "--manifest": args.manifest}
    single |= {"--config-json": args.config_json, "--out": args.out}
    if args.runs_json is not None:
        given = [flag for flag, value in single.items() if value is not None]
        if given:
            raise UserError(
                f"--runs-json replaces {', '.join(given)}; give either --runs-json or one run's flags"
            )
        track_all(runs_from_json(args.runs_json), args)
        return
    missing = [flag for flag, value in single.items() if value is None]
    if missing:
        raise UserError(
            f"the following arguments are required: {', '.join(missing)} (or --runs-json for several "
            "runs); see shardfuse.tracking --help"
        )
    entry = {
        "run": args.run, "run_dir": args.run_dir, "manifest": args.manifest,
        "config": parse_json_arg(args.config_json, "--config-json"), "out": args.out,
        "train_dir": args.train_dir, "gather": args.gather, "plots_dir": args.plots_dir,
        "ddp_baseline": args.ddp_baseline, "hf_dir": args.hf_dir, "adapter_dir": args.adapter_dir,
    }  # fmt: skip
    track_and_record(entry, args)


if __name__ == "__main__":
    run_cli(main)
    exit_now()
