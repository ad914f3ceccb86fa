"""What a push does with the runs MLflow already holds for a run name, and the tags it decides by.

The files are the source of truth and the track stage is the only writer, so the push is a sync
(:func:`plan_sync` picks the action, :mod:`shardfuse.track.sync` carries it out):
- inputs unchanged (``shardfuse.fingerprint``, written last with ``shardfuse.complete=true``): nothing
  is written (``unchanged``);
- same config, histories that only grew (more steps, an interrupted push, a new evaluation): only the
  missing points are appended, changed headline metrics get a new (later) point at step 0, changed
  files are re-uploaded, changed weights logged as a new model (``updated``);
- another config or a rewritten history (re-trained): the old runs are soft-deleted and everything is
  pushed afresh (``replaced``).
A failed run's FAILED parent (:mod:`shardfuse.track.failed`) is replaced by the run's first complete push.
Live runs (``shardfuse.track.live``) of the same run name that started before the pushed training finished
are soft-deleted once the push is complete (:func:`delete_finished_live_runs`).
"""

from __future__ import annotations

from typing import Any, Literal, NamedTuple

from shardfuse.io import UserError
from shardfuse.track import model_logging
from shardfuse.track.client import LIVE_RUN_TAG
from shardfuse.track.inputs import RunInputs
from shardfuse.track.parent import SyncOptions
from shardfuse.track.provenance import CONFIG_HASH_TAG, LAYOUT_VERSION
from shardfuse.track.push import history_rows, search_all, series_synced, synced_rows

RUN_TAG = "shardfuse.run"
RANK_TAG = "shardfuse.rank"
FINGERPRINT_TAG = "shardfuse.fingerprint"
COMPLETE_TAG = "shardfuse.complete"
PARENT_TAG = "mlflow.parentRunId"
LAYOUT_TAG = "shardfuse.layout"  # LAYOUT_VERSION of the push that made the run: another one is replaced
TRAINING_TAG = "shardfuse.training"  # the training the run merged (runs that share one share it)
TRIAL_TAG = "shardfuse.trial"  # a merge_search trial's child run (its number)
LOST_TAG = "shardfuse.lost"  # a rank's child run: the rank was lost for good while training
FAILED_TAG = (
    "shardfuse.error"  # a run that failed in the workflow: its one-line error (shardfuse.track.failed)
)

# What a sync does with the runs already in MLflow (also the ``action`` that ``--out`` records).
Action = Literal["created", "replaced", "updated", "unchanged"]


class Plan(NamedTuple):
    """What to do with the runs already in MLflow, and which of them to keep."""

    action: Action
    parent: Any  # mlflow Run, None for "created" and "replaced" (everything is pushed afresh)
    children: dict[int, Any]  # rank -> its mlflow Run (kept runs only)


def quote_run_name(value: str) -> str:
    quote = "'" if "'" not in value else '"'
    if quote in value:
        raise UserError(f"run name {value!r} contains both quote characters; rename the run")
    return f"{quote}{value}{quote}"


def delete_runs(client, experiment_id: str, runs: list) -> None:
    for run in runs:
        if PARENT_TAG not in run.data.tags:
            model_logging.delete_unregistered_models(client, experiment_id, run.info.run_id)
        client.delete_run(run.info.run_id)


def delete_finished_live_runs(client, experiment_id: str, run_name: str, trained_before_ms: int) -> None:
    """Live runs only mirror what the parent now holds; keep a live run of a training still going on."""
    for run in search_all(client, experiment_id, f"tags.`{LIVE_RUN_TAG}` = {quote_run_name(run_name)}"):
        if run.info.start_time <= trained_before_ms:
            client.delete_run(run.info.run_id)


def plan_sync(runs: list, options: SyncOptions, inputs: RunInputs, params: dict[str, str]) -> Plan:
    """Pick what to do with the runs already in MLflow."""
    parents = [r for r in runs if PARENT_TAG not in r.data.tags]
    if len(parents) != 1:
        return Plan("replaced" if runs else "created", None, {})
    parent = parents[0]
    if FAILED_TAG in parent.data.tags:  # a failed run's parent holds no results: the finished run replaces it
        return Plan("replaced", None, {})
    children: dict[int, Any] = {}
    for run in runs:
        rank = run.data.tags.get(RANK_TAG, "")
        if (
            run.data.tags.get(PARENT_TAG) != parent.info.run_id
            or not rank.isdigit()
            or TRIAL_TAG in run.data.tags
        ):
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
