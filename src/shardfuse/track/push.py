"""What an idempotent push to MLflow is built from: paged search, batched writes, step histories.

A library, no command line, used by the track stage (:mod:`shardfuse.tracking`). A rank's history is
one float64 row per step (step, timestamp, then :data:`STEP_METRICS`), pushed in step order, whole rows
per log_batch (333 rows = 999 points, MLflow's limit is 1000). A finished history gets
``shardfuse.synced = ROWS:SHA256`` (rows pushed, hash of those rows); after a push killed midway, the
latest point of each key (which MLflow keeps with the run) says where to go on, so a re-run neither
loses nor doubles a point, and a rewritten history is told apart.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import time
from collections.abc import Iterator

import numpy as np

from shardfuse.track.client import MAX_METRICS_PER_BATCH, MAX_PARAMS_PER_BATCH
from shardfuse.track.series import STEP_METRICS

SYNCED_TAG = "shardfuse.synced"
ROWS_PER_BATCH = MAX_METRICS_PER_BATCH // len(STEP_METRICS)  # whole rows: 333 rows = 999 points
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def search_all(client, experiment_id: str, filter_string: str) -> list:
    """Every active run of the experiment that matches the filter, all pages."""
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


def changed_metrics(current: dict[str, float], wanted: dict[str, float], step: int) -> list:
    """Metric points (at ``step``, timestamped now) for the values of ``wanted`` not in ``current``."""
    from mlflow.entities import Metric

    now_ms = int(time.time() * 1000)
    return [Metric(k, v, now_ms, step) for k, v in wanted.items() if current.get(k) != v]


def history_rows(history: dict[str, np.ndarray]) -> np.ndarray:
    """One float64 row per step (step, timestamp, metrics): its prefix hash identifies what was pushed."""
    columns = ("step", "timestamp_ms", *STEP_METRICS)
    return np.ascontiguousarray(np.column_stack([history[c].astype(np.float64) for c in columns]))


def synced_tag_value(rows: np.ndarray) -> str:
    """The :data:`SYNCED_TAG` value that vouches for all of ``rows``."""
    return f"{len(rows)}:{hashlib.sha256(rows.tobytes()).hexdigest()}"


def _same(stored: float, value: float) -> bool:
    return stored == value or (np.isnan(stored) and np.isnan(value))


def synced_rows(child, rows: np.ndarray) -> int | None:
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


def series_synced(child, metric: str, rows: np.ndarray) -> int | None:
    """Points of a sparse series (rows of step, timestamp, value) already in the child run, or None if
    what it holds is not a prefix of them: :func:`~shardfuse.track.push.synced_rows` for one metric."""
    tag = child.data.tags.get(f"{SYNCED_TAG}.{metric}") or synced_tag_value(rows[:0])
    count = tag.partition(":")[0]
    if not count.isdigit() or int(count) > len(rows) or synced_tag_value(rows[: int(count)]) != tag:
        return None
    latest = next((m for m in getattr(child.data, "_metric_objs", []) if m.key == metric), None)
    if latest is None:
        return int(count)
    (matches,) = np.nonzero((rows[:, 0] == latest.step) & (rows[:, 1] == latest.timestamp))
    if not len(matches) or rows[matches[0], 2] != latest.value:
        return None
    return max(int(count), int(matches[0]) + 1)


def sync_series(client, child_id: str, metric: str, rows: np.ndarray, start: int) -> int:
    """Append rows[start:] of a sparse series in step order, MLflow's most points per log_batch."""
    from mlflow.entities import Metric

    steps, stamps, values = (rows[start:, i].tolist() for i in range(3))
    points = [Metric(metric, v, int(t), int(s)) for s, t, v in zip(steps, stamps, values, strict=True)]
    log_batches(client, child_id, metrics=points)
    return len(points)


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Each batch makes thousands of short-lived objects (Metric, ORM rows) and no cycles: the cyclic
    collector would only rescan them, a share of the push that grows with its size."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
