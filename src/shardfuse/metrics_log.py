"""Per-rank step metrics, append-only on disk while training runs.

Rows are buffered and flushed every ``flush_every`` steps (and at every checkpoint) as small Parquet
part files, each written atomically, so a killed job keeps everything it flushed. When training ends
the parts are consolidated into ``metrics/rank-{rank}.parquet`` (the file the tracker reads). On
resume from step N, rows after N are dropped so the history has exactly one row per step.
"""

from __future__ import annotations

import shutil
from pathlib import Path

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
        ("timestamp_ms", pa.int64()),
    ]
)
COLUMNS = tuple(SCHEMA.names)


class MetricsLog:
    def __init__(self, metrics_dir: Path, rank: int, flush_every: int = 100) -> None:
        self.parts_dir = metrics_dir / f"rank-{rank}"
        self.final_path = metrics_dir / f"rank-{rank}.parquet"
        self.flush_every = flush_every
        self.rows: dict[str, list] = {name: [] for name in COLUMNS}
        self.parts_dir.mkdir(parents=True, exist_ok=True)

    def append(
        self, step: int, epoch: int, loss: float, samples_per_second: float, lr: float, timestamp_ms: int
    ) -> None:
        for name, value in zip(
            COLUMNS, (step, epoch, loss, samples_per_second, lr, timestamp_ms), strict=True
        ):
            self.rows[name].append(value)
        if len(self.rows["step"]) >= self.flush_every:
            self.flush()

    def flush(self) -> None:
        if not self.rows["step"]:
            return
        first = self.rows["step"][0]
        with atomic_path(self.parts_dir / f"part-{first:012d}.parquet") as tmp:
            pq.write_table(pa.table(self.rows, schema=SCHEMA), tmp)
        self.rows = {name: [] for name in COLUMNS}

    def truncate_after(self, step: int) -> None:
        """Forget rows after ``step`` (resuming from the checkpoint at ``step``)."""
        self.rows = {name: [] for name in COLUMNS}
        for part in sorted(self.parts_dir.glob("part-*.parquet")):
            table = pq.read_table(part)
            if table.num_rows and max(table.column("step").to_pylist()) <= step:
                continue
            kept = table.filter(pc.less_equal(table.column("step"), step))
            if kept.num_rows == 0:
                part.unlink()
            else:
                with atomic_path(part) as tmp:
                    pq.write_table(kept, tmp)

    def consolidate(self) -> Path:
        """One file with every row in step order; the part files go."""
        self.flush()
        parts = sorted(self.parts_dir.glob("part-*.parquet"))
        table = pa.concat_tables([pq.read_table(p) for p in parts]) if parts else SCHEMA.empty_table()
        table = table.sort_by("step")
        with atomic_path(self.final_path) as tmp:
            pq.write_table(table, tmp)
        shutil.rmtree(self.parts_dir)
        return self.final_path
