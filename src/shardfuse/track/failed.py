"""A run that failed in the workflow, in MLflow: a parent run with status FAILED, the run's config as
params and the console's one-line error as a tag and as its description (the run page shows it first),
so the experiment lists every run the config asked for, finished or not
(:mod:`shardfuse.experiment.outcome`).

One such parent per run name: a later failure updates its error. It holds no results, so the next push
of the finished run replaces it (:func:`shardfuse.track.plan.plan_sync`); a parent the run had from an
earlier, successful push is left as it was.
"""

from __future__ import annotations

from typing import NamedTuple

from shardfuse.track.client import check_no_password, connect, tracking_errors, writer_lock
from shardfuse.track.inputs import flatten_params
from shardfuse.track.plan import COMPLETE_TAG, FAILED_TAG, LAYOUT_TAG, RUN_TAG, quote_run_name
from shardfuse.track.provenance import CONFIG_HASH_TAG, LAYOUT_VERSION, config_hash
from shardfuse.track.push import log_batches, search_all

NOTE_TAG = "mlflow.note.content"  # a run's description, shown at the top of its page
MAX_TAG_CHARS = 5000  # MLflow's tag value limit is 8000 characters; an error line stays well under it


class FailedRun(NamedTuple):
    parent_run_id: str
    action: str  # "created" or "updated"


def _failure_note(error: str) -> str:
    return (
        f"**This run failed** in the workflow:\n\n```\n{error}\n```\n\nFix it and run snakemake again; "
        "the finished run then replaces this one."
    )


def record_failed_run(
    tracking_uri: str, experiment: str, run_name: str, config: dict, error: str, source: dict[str, str]
) -> FailedRun:
    """Create the run's FAILED parent, or update the one an earlier failure left (its error)."""
    from mlflow.entities import Param, RunTag

    check_no_password(tracking_uri)
    error = error[:MAX_TAG_CHARS]
    tags = {
        RUN_TAG: run_name,
        FAILED_TAG: error,
        COMPLETE_TAG: "false",
        NOTE_TAG: _failure_note(error),
        CONFIG_HASH_TAG: config_hash(config),
        LAYOUT_TAG: LAYOUT_VERSION,
        **source,
    }
    with tracking_errors(tracking_uri), writer_lock(tracking_uri):
        client, experiment_id = connect(tracking_uri, experiment)
        runs = search_all(client, experiment_id, f"tags.`{RUN_TAG}` = {quote_run_name(run_name)}")
        markers = [run for run in runs if FAILED_TAG in run.data.tags]
        for stale in markers[1:]:
            client.delete_run(stale.info.run_id)
        if markers and markers[0].data.tags.get(CONFIG_HASH_TAG) == tags[CONFIG_HASH_TAG]:
            run_id, action = markers[0].info.run_id, "updated"
            log_batches(client, run_id, tags=[RunTag(key, value) for key, value in tags.items()])
        else:  # none yet, or one of another config (its params are immutable): a new one
            if markers:
                client.delete_run(markers[0].info.run_id)
            run_id = client.create_run(experiment_id, run_name=run_name, tags=tags).info.run_id
            action = "created"
            params = flatten_params(config)
            log_batches(client, run_id, params=[Param(key, value) for key, value in sorted(params.items())])
        client.set_terminated(run_id, "FAILED")
    return FailedRun(run_id, action)
