"""A rank's curves as a push carries them: its step metrics file, the sparse series (grad_norm,
val_<score>) at the steps that have a value, its system metrics as MLflow's System metrics tab charts
them, and the parent's per-node peaks. Read by :func:`shardfuse.track.inputs.load_inputs` (and the plots
stage); pushed by :mod:`shardfuse.track.push`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from shardfuse.experiment.records import TrainRecord
from shardfuse.io import UserError
from shardfuse.metrics.steps import EVERY_STEP_METRICS, SOME_STEP_METRICS
from shardfuse.metrics.system import peak, read_system_metrics

STEP_METRICS = EVERY_STEP_METRICS  # every step: pushed as whole rows (mlflow_sync)
PARQUET_COLUMNS = ("step", *STEP_METRICS, "timestamp_ms")
OPTIONAL_COLUMNS = SOME_STEP_METRICS  # NaN on the steps without a value: pushed where finite, as series


def no_step_metrics() -> dict[str, np.ndarray]:
    """The columns of a rank that took no step (a run over checkpoints): each empty."""
    return {column: np.zeros(0) for column in PARQUET_COLUMNS}


def read_step_metrics(path: Path) -> dict[str, np.ndarray]:
    """Columns step, loss, samples_per_second, lr, timestamp_ms of one rank's metrics file, and those
    of :data:`OPTIONAL_COLUMNS` that it has."""
    import pyarrow.parquet as pq

    # ParquetFile, not read_table: read_table imports pyarrow.dataset, a cost paid by every track job.
    try:
        with pq.ParquetFile(path) as parquet:
            names = parquet.schema_arrow.names
            missing = [c for c in PARQUET_COLUMNS if c not in names]
            columns = [*PARQUET_COLUMNS, *(c for c in OPTIONAL_COLUMNS if c in names)]
            table = None if missing else parquet.read(columns=columns)
    except Exception as exc:
        raise UserError(f"{path} is not a readable Parquet file ({exc}); re-run the train stage") from None
    if missing:
        raise UserError(f"{path} lacks column(s) {', '.join(missing)}; re-run the train stage")
    return {c: table.column(c).to_numpy() for c in columns}


def validation_metric(train: TrainRecord, default_score: str) -> str:
    """The name the val_score column goes by: ``val_`` + train.json's validation score (else the task's)."""
    validation = train.validation
    score = validation.get("score") if isinstance(validation, dict) else None
    return f"val_{score if isinstance(score, str) and score else default_score}"


def step_series(history: dict[str, np.ndarray], val_metric: str) -> dict[str, np.ndarray]:
    """Metric name -> (step, timestamp_ms, value) float64 rows of the steps where it is finite, for each
    optional column with at least one such step (grad_norm, the val_score column as ``val_metric``)."""
    series = {}
    for column, name in (("grad_norm", "grad_norm"), ("val_score", val_metric)):
        if column not in history:
            continue
        values = history[column].astype(np.float64)
        finite = np.isfinite(values)
        if finite.any():
            columns = (history["step"][finite], history["timestamp_ms"][finite], values[finite])
            series[name] = np.ascontiguousarray(np.column_stack(columns).astype(np.float64))
    return series


def read_rank_system(path: Path) -> dict[str, np.ndarray]:
    try:
        return read_system_metrics(path)
    except (OSError, ValueError, KeyError) as exc:  # pyarrow's errors are ValueErrors or OSErrors
        raise UserError(f"cannot read {path} ({exc}); re-run the train stage (snakemake -R train)") from None


def system_series(samples: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """A rank's system metrics (:func:`shardfuse.metrics.system.read_system_metrics`) as series rows (step =
    the sample's index, timestamp, value): MLflow's System metrics tab charts ``system/...`` metrics,
    and MLflow's own sampler numbers its samples the same way."""
    return {
        name: np.ascontiguousarray(np.column_stack([np.arange(len(rows)), rows[:, 0], rows[:, 1]]))
        for name, rows in samples.items()
    }


def node_peaks(samples: dict[int, dict[str, np.ndarray]], hosts: dict[int, str]) -> dict[str, float]:
    """The parent's per-node peaks: ``system/<host>/peak_<metric>``, the largest sample of any rank on
    that host (ranks of an unknown host count as host ``rank<r>``)."""
    by_host: dict[str, list] = {}
    for rank, metrics in samples.items():
        by_host.setdefault(hosts.get(rank, f"rank{rank}"), []).append(metrics)
    return {
        f"system/{host}/peak_{name.removeprefix('system/')}": value
        for host, metrics in sorted(by_host.items())
        for name, value in peak(*metrics).items()
    }
