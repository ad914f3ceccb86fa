"""Per-rank step metrics, append-only on disk while training runs.

Each rank appends one fixed-size record per optimiser step to ``metrics/rank-{rank}.f64``: the
columns of :data:`SCHEMA` as little-endian float64 (steps, epochs and millisecond timestamps are exact
in float64 up to 2**53). Records are buffered in memory and written and flushed to the file every
``flush_seconds``, at every checkpoint and whenever ``max_rows`` are buffered, so a killed job keeps
everything up to its last flush. Appending a record is one ``array.extend`` and a flush is one
``write``, the cheapest step-time cost we found (a Parquet part file per flush, or text formatting of
every value, cost a step far more). bench/logging_overhead.py measures the cost against no logging;
figures in bench/RESULTS.md.

A kill can cut the file mid-record; readers keep only whole records, so what is read back is bitwise what
was logged. When training ends the rows are consolidated into ``metrics/rank-{rank}.parquet`` (the file
the tracker and the plots read) and the record file goes. Opening the log for a run resumed from step N
drops the records after N (and a fresh start drops them all), so the history has exactly one row per
step; a run killed after consolidating but before train.json resumes from the consolidated rows.
"""

from __future__ import annotations

import array
import math
import os
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from shardfuse.io import atomic_path

SCHEMA = pa.schema(
    [
        ("step", pa.int64()),
        ("epoch", pa.int64()),
        ("loss", pa.float64()),
        ("samples_per_second", pa.float64()),
        ("lr", pa.float64()),
        ("grad_norm", pa.float64()),  # the pre-clip gradient norm; NaN when grad_clip_norm is off
        ("val_score", pa.float64()),  # the task's validation score; NaN on steps that did not validate
        ("timestamp_ms", pa.int64()),
    ]
)
COLUMNS = tuple(SCHEMA.names)
# The metrics every step has (the tracker pushes them as whole rows), and those that are NaN on the steps
# without a value (pushed where finite, as series; older metrics files lack them).
EVERY_STEP_METRICS = ("loss", "samples_per_second", "lr")
SOME_STEP_METRICS = ("grad_norm", "val_score")
RECORD = np.dtype("<f8")
RECORD_BYTES = RECORD.itemsize * len(COLUMNS)


def read_records(path: Path) -> pa.Table:
    """The whole records of an append-only metrics file (a record cut by a kill is left out)."""
    data = path.read_bytes() if path.is_file() else b""
    values = np.frombuffer(data, dtype=RECORD, count=(len(data) // RECORD_BYTES) * len(COLUMNS))
    rows = values.reshape(-1, len(COLUMNS))
    return pa.table(
        {
            name: pa.array(
                rows[:, j].astype(np.int64) if SCHEMA.field(name).type == pa.int64() else rows[:, j]
            )
            for j, name in enumerate(COLUMNS)
        },
        schema=SCHEMA,
    )


class MetricsLog:
    """``append`` one row per optimiser step; ``flush`` at checkpoints; ``consolidate`` at the end."""

    def __init__(
        self,
        metrics_dir: Path,
        rank: int,
        resume_step: int = 0,
        flush_seconds: float = 2.0,
        max_rows: int = 10_000,
    ) -> None:
        metrics_dir.mkdir(parents=True, exist_ok=True)
        self.path = metrics_dir / f"rank-{rank}.f64"
        self.final_path = metrics_dir / f"rank-{rank}.parquet"
        self.flush_seconds, self.max_values = flush_seconds, max_rows * len(COLUMNS)
        self.buffer = array.array("d")
        kept = read_records(self.path)
        if resume_step and kept.num_rows == 0 and self.final_path.is_file():
            # A kill after consolidate (record file gone) but before train.json: the rows are in Parquet.
            kept = _consolidated(self.final_path)
        kept = kept.filter(pc.less_equal(kept["step"], resume_step)) if resume_step else kept.slice(0, 0)
        with atomic_path(self.path) as tmp:
            tmp.write_bytes(_to_records(kept))
        self._file = open(self.path, "ab")  # noqa: SIM115 - open for the whole run, closed by consolidate
        self._next_flush = time.monotonic() + flush_seconds
        # append() takes time.perf_counter() (cheaper than time.time() each step); flush turns it into
        # wall-clock milliseconds with this offset.
        self._wall_offset = time.time() - time.perf_counter()

    def append(
        self,
        step: int,
        epoch: int,
        loss: float,
        samples_per_second: float,
        lr: float,
        clock: float,
        grad_norm: float = math.nan,
        val_score: float = math.nan,
    ) -> None:
        """One step's row; ``clock`` is ``time.perf_counter()`` at the step's end (stored as wall ms)."""
        self.buffer.extend((step, epoch, loss, samples_per_second, lr, grad_norm, val_score, clock))
        if len(self.buffer) >= self.max_values or time.monotonic() >= self._next_flush:
            self.flush()

    def flush(self) -> None:
        """Write the buffered records to the file and hand them to the OS (they survive a kill)."""
        self._next_flush = time.monotonic() + self.flush_seconds
        if self.buffer:
            rows = np.frombuffer(self.buffer, dtype=np.float64).reshape(-1, len(COLUMNS)).copy()
            rows[:, -1] = np.floor((rows[:, -1] + self._wall_offset) * 1000.0)  # perf_counter -> wall ms
            self._file.write(rows.astype(RECORD, copy=False).tobytes())
            self.buffer = array.array("d")
        self._file.flush()

    def consolidate(self) -> Path:
        """One Parquet file with every row in step order; the record file goes."""
        self.flush()
        self._file.close()
        table = read_records(self.path).sort_by("step")
        with atomic_path(self.final_path) as tmp:
            pq.write_table(table, tmp)
        os.unlink(self.path)
        return self.final_path

    def close(self) -> None:
        if not self._file.closed:
            self.flush()
            self._file.close()


def _consolidated(path: Path) -> pa.Table:
    """The rows of a consolidated metrics file in :data:`SCHEMA` (none if it is unreadable or older)."""
    try:
        table = pq.read_table(path)
        return table.select(list(COLUMNS)).cast(SCHEMA)
    except (OSError, ValueError, KeyError, pa.ArrowException):
        return SCHEMA.empty_table()


def _to_records(table: pa.Table) -> bytes:
    columns = [table.column(name).to_numpy().astype(RECORD) for name in COLUMNS]
    return np.stack(columns, axis=1).astype(RECORD).tobytes() if table.num_rows else b""
