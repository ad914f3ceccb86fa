"""What a training leaves about itself: ``train.json``, written by rank 0 when every rank is done and read by
the summary and track stages, as one typed record (written and read here only).

train.json files written by older train stages lack the fields added since (mode, bytes all-reduced,
effective batch size, ...): those read as None, never as 0, and :meth:`TrainRecord.training_mode` derives
the mode from the strategy as the train stage now does. Fields this version does not know (a newer train
stage) are kept in ``extra`` and written back unchanged. By hand::

    python -c "from shardfuse.experiment.records import TrainRecord; \\
        print(TrainRecord.read('results/trainings/<training>/ranks/train.json').training_mode())"
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from shardfuse.io import UserError, read_json


def mode_of(strategy: str, sync_every: Any) -> str:
    """ddp, localsgd, independent (localsgd that never syncs) or diloco. ``sync_every`` may come from a
    runs table cell (a string) or be absent."""
    if strategy == "localsgd" and sync_every in (0, "0", "", None):
        return "independent"
    return strategy


@dataclass(frozen=True)
class TrainRecord:
    """train.json, field by field in the order the train stage writes them."""

    run: str | None = None
    world_size: int | None = None
    strategy: str | None = None
    mode: str | None = None
    sync_every: int | None = None
    num_steps: int | None = None
    epochs: int | None = None
    steps_per_epoch: int | None = None
    grad_accum_steps: int | None = None
    effective_batch_size: int | None = None
    lr_schedule: str | None = None
    warmup_steps: int | None = None
    grad_clip_norm: float | None = None
    bytes_all_reduced_per_rank: int | None = None
    num_syncs: int | None = None
    init: str | None = None
    keep: str | None = None
    validation: dict[str, Any] | None = None  # {"score", "every"} when the run validated while training
    stopped_early: bool | None = None
    train_seconds: float | None = None  # the slowest rank's loop
    backend: str | None = None
    device: str | None = None
    precision: str | None = None
    peak_gpu_memory_bytes: int | None = None
    step_metrics: bool | None = None
    hosts: list[str] | None = None
    slurm_job_id: str | None = None
    torch_version: str | None = None
    shard_dir: str | None = None
    dataset_dir: str | None = None
    task: str | None = None
    model: dict[str, Any] | None = None
    init_from: str | None = None
    ranks: list[dict[str, Any]] | None = None  # rank, rows, host, checkpoint, published_step, best_val_score
    git_commit: str | None = None  # older train stages only
    git_dirty: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def from_json(cls, data: Any, source: str | os.PathLike = "train.json") -> TrainRecord:
        if not isinstance(data, dict):
            raise UserError(f"{source} is not a JSON object; re-run the train stage")
        known = {f.name for f in fields(cls)} - {"extra"}
        return cls(
            **{key: value for key, value in data.items() if key in known},
            extra={key: value for key, value in data.items() if key not in known},
        )

    @classmethod
    def read(cls, path: str | os.PathLike, what: str = "training") -> TrainRecord:
        return cls.from_json(read_json(path, what), path)

    def to_json(self) -> dict[str, Any]:
        """The object train.json holds: the fields that are set, in order, then ``extra``."""
        data = asdict(self)
        extra = data.pop("extra")
        return {**{key: value for key, value in data.items() if value is not None or key in WRITTEN}, **extra}

    def training_mode(self, strategy: str | None = None, sync_every: Any = None) -> str:
        """The recorded mode, else what the recorded (or the given run config's) strategy and sync_every
        amount to; "" when neither says."""
        if self.mode:
            return str(self.mode)
        strategy = self.strategy if self.strategy is not None else strategy
        sync_every = self.sync_every if self.sync_every is not None else sync_every
        return "" if strategy is None else mode_of(str(strategy), sync_every)


# Written even when null (the train stage always writes them; a reader tells null from absent).
WRITTEN = frozenset(f.name for f in fields(TrainRecord)) - {"git_commit", "git_dirty", "extra"}
