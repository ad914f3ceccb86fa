"""The MLflow UI URL that lands on an experiment's leaderboard: the model-training view of its runs
table, the shardfuse parents only (``shardfuse.complete``: no rank children, live views or comparison
run), sorted by the merged score, best first, with the merged, best-rank, ensemble, ddp-baseline and
fusion-gain columns in view.

MLflow 3.x keeps the search in the URL (``searchFilter``, ``orderByKey``, ``orderByAsc``) but the
visible columns in the browser's storage; a shared view (its Share button) keeps both in an experiment
tag ``mlflow.sharedViewState.<key>`` that the URL names (``viewStateShareKey``). This module writes
that tag (:data:`SHARE_KEY`; again only when it would change); the stage :mod:`shardfuse.leaderboard`
prints the URL, and ``make ui`` runs it before it starts the UI::

    python -m shardfuse.leaderboard --tracking-uri sqlite:///mlflow.db --experiment shardfuse \\
        --ui http://127.0.0.1:5000
    # http://127.0.0.1:5000/#/experiments/1/runs?workflowType=machine_learning&searchFilter=...
"""

from __future__ import annotations

import json
import urllib.parse

from shardfuse.io import UserError
from shardfuse.track.client import tracking_client, tracking_errors, writer_lock
from shardfuse.track.plan import COMPLETE_TAG

PARENTS_ONLY = f"tags.`{COMPLETE_TAG}` = 'true'"
ML_VIEW = "machine_learning"  # the UI's model-training view (an experiment opens in the GenAI one)
# The merged score to sort by, the first a parent has: (metric, best first is descending).
SCORES = (
    ("test_accuracy_merged", False),
    ("test_r2_merged", False),
    ("test_perplexity_merged", True),
    ("test_loss_merged", True),
    ("test_mse_merged", True),
)


SHARE_KEY = "shardfuse-leaderboard"  # the shared view's key: tag mlflow.sharedViewState.<key>
SHARED_VIEW_TAG = f"mlflow.sharedViewState.{SHARE_KEY}"
# The columns in view after the run's name: the parents' datasets, then the fusion's scores.
COLUMN_SUFFIXES = ("merged", "best_rank", "ensemble", "ddp_baseline")


def view_state(metric: str, ascending: bool) -> dict:
    """The shared view: the search (parents only, by ``metric``) and the columns (``<score>_merged``,
    ``_best_rank``, ``_ensemble``, ``_ddp_baseline`` and ``fusion_gain``), in MLflow's column keys."""
    score = metric.removesuffix("_merged")
    columns = ["attributes.`Dataset`", *(f"metrics.`{score}_{suffix}`" for suffix in COLUMN_SUFFIXES)]
    return {
        "searchFilter": PARENTS_ONLY,
        "orderByKey": f"metrics.`{metric}`",
        "orderByAsc": ascending,
        "startTime": "ALL",
        "lifecycleFilter": "Active",
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        "selectedColumns": [*columns, "metrics.`fusion_gain`"],
        "runsExpanded": {},
        "runsPinned": [],
        "runsHidden": [],
        "viewMaximized": False,
        "runListHidden": False,
    }


def leaderboard_url(ui: str, experiment_id: str, metric: str, ascending: bool) -> str:
    """The runs table of ``experiment_id`` at ``ui`` (e.g. ``http://127.0.0.1:5000``), parents only,
    sorted by ``metric``."""
    query = urllib.parse.urlencode(
        {"workflowType": ML_VIEW, "viewStateShareKey": SHARE_KEY}, quote_via=urllib.parse.quote
    )
    return f"{ui.rstrip('/')}/#/experiments/{experiment_id}/runs?{query}"


def score_of(metric_keys: set[str]) -> tuple[str, bool]:
    """The merged score among a parent's metrics (the task's: accuracy, r2, perplexity, loss)."""
    for metric, ascending in SCORES:
        if metric in metric_keys:
            return metric, ascending
    return SCORES[0]


def experiment_leaderboard(tracking_uri: str, experiment: str, ui: str) -> str:
    """The leaderboard URL of ``experiment`` in the store at ``tracking_uri``, served at ``ui``."""
    with tracking_errors(tracking_uri), writer_lock(tracking_uri):  # it writes a tag, as track does
        client = tracking_client(tracking_uri)
        found = client.get_experiment_by_name(experiment)
        if found is None:
            raise UserError(
                f"experiment {experiment!r} is not in {tracking_uri}; run the workflow first (snakemake "
                "--cores all), or pass the config's mlflow.experiment"
            )
        parents = client.search_runs([found.experiment_id], PARENTS_ONLY, max_results=1)
        metric, ascending = score_of(set(parents[0].data.metrics) if parents else set())
        state = json.dumps(view_state(metric, ascending), sort_keys=True)
        if found.tags.get(SHARED_VIEW_TAG) != state:
            client.set_experiment_tag(found.experiment_id, SHARED_VIEW_TAG, state)
    return leaderboard_url(ui, found.experiment_id, metric, ascending)
