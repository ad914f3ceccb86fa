"""How ranks whose shards differ in size line up their epochs (the run key ``epoch_steps``): one record per
choice, and the plan of every shard's epoch it gives.

``batch_size`` is the rows of a step on every rank. An epoch of R rows is cut into ⌈R / batch_size⌉
micro-batches as ``torch.tensor_split`` cuts it (sizes differ by at most one row, none above
batch_size but for the one-row allowance below). What R is, per rank, is the record's choice:

- ``min`` (the default): the smallest shard's rows; a larger shard stops early, each epoch in a new
  seeded order, so it sees other rows the next epoch.
- ``max``: the largest shard's rows; a smaller shard cycles, each further pass in a new seeded order.
- ``mean``: the mean shard's rows (rounded down): smaller shards cycle, larger ones stop early.
- ``own``: each rank its own shard, in its own number of steps (FedAvg's local epochs). The ranks then
  take different step counts, so only ranks that never meet while training may (localsgd with
  sync_every 0, one replica each: :func:`alignment_problem`).

A shard one row over the target keeps that row: partition's iid split gives its N mod W leftover rows one
each to the first ranks, and so iid runs train exactly as they did before this key existed (the
smallest shard's step count, every rank spreading its own shard over it).

Torch-free: the config checks and the schema's enum read these records as the train stage does. By
hand::

    python -c "from shardfuse.data.epoch_steps import plan_epochs; \\
        print(plan_epochs([318, 256, 13, 672], 32, 'mean'))"
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from shardfuse.io import find_record

# (every shard's rows, this shard) -> the rows of this shard's epoch before the one-row allowance
Target = Callable[[Sequence[int], int], int]


@dataclass(frozen=True)
class EpochSteps:
    name: str
    target: Target
    describe: str  # what a rank's epoch is, for the docs and the warning
    aligned: bool = True  # every rank takes the same number of steps (what ranks that meet need)


RECORDS: tuple[EpochSteps, ...] = (
    EpochSteps("min", lambda rows, shard: min(rows), "the smallest shard's rows (larger shards stop early)"),
    EpochSteps("max", lambda rows, shard: max(rows), "the largest shard's rows (smaller shards cycle)"),
    EpochSteps(
        "mean",
        lambda rows, shard: sum(rows) // len(rows),
        "the mean shard's rows, rounded down (smaller shards cycle, larger ones stop early)",
    ),
    EpochSteps("own", lambda rows, shard: rows[shard], "its own shard's rows, in its own steps", False),
)

# The schema's default (tests/contracts hold them equal); at it the key stays out of training names.
DEFAULT = "min"

# Shards further apart than this, at the default, get the train stage's warning.
WARN_RATIO = 2


def names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS)


def find(name: str) -> EpochSteps:
    return find_record(RECORDS, name, "epoch_steps", "set the run key epoch_steps to one of them")


def split_sizes(num_rows: int, num_batches: int) -> list[int]:
    """Batch sizes of one epoch, as torch.tensor_split(range(num_rows), num_batches) cuts it."""
    base, extra = divmod(num_rows, num_batches)
    return [base + 1] * extra + [base] * (num_batches - extra)


def optimizer_steps(num_batches: int, grad_accum_steps: int) -> int:
    """Optimiser steps per epoch: the last one takes whatever micro-batches are left over."""
    return math.ceil(num_batches / grad_accum_steps)


@dataclass(frozen=True)
class ShardEpoch:
    """One shard's epoch: ``rows`` rows (its shard's ``shard_rows``, fewer: it stops early, more: it
    cycles) in ``num_batches`` micro-batches."""

    shard_rows: int
    rows: int
    num_batches: int

    def rows_through(self, batches: int) -> int:
        """Rows of the epoch's first ``batches`` micro-batches (all of them past its last)."""
        batches = min(batches, self.num_batches)
        base, extra = divmod(self.rows, self.num_batches)
        return batches * base + min(batches, extra)


@dataclass(frozen=True)
class EpochPlan:
    """Every shard's epoch under one ``epoch_steps`` choice. The ranks share a clock of
    :attr:`num_batches` micro-batch slots per epoch: a rank whose epoch has fewer (``own`` only) waits
    out the rest of the epoch's slots, so that checkpoints, stop requests and validations, which every
    rank joins, still fall on the same slot everywhere."""

    mode: str
    batch_size: int
    shards: tuple[ShardEpoch, ...]

    @property
    def num_batches(self) -> int:
        """Micro-batch slots per epoch, the same on every rank: the longest epoch's micro-batches."""
        return max(shard.num_batches for shard in self.shards)

    @property
    def aligned(self) -> bool:
        return find(self.mode).aligned

    def rows_seen(self, shard: int, epoch: int, next_batch: int) -> int:
        """Rows shard ``shard``'s rank has trained on at clock position (``epoch``, ``next_batch``)."""
        own = self.shards[shard]
        return epoch * own.rows + own.rows_through(next_batch)

    def steps_taken(self, shard: int, epoch: int, next_batch: int, grad_accum_steps: int) -> int:
        """Optimiser steps shard ``shard``'s rank has taken at clock position (``epoch``, ``next_batch``)."""
        own = self.shards[shard].num_batches
        done = min(next_batch, own)
        return epoch * optimizer_steps(own, grad_accum_steps) + math.ceil(done / grad_accum_steps)

    def warning(self) -> str | None:
        """The train stage's one line when shards are more than WARN_RATIO apart at the default."""
        rows = [shard.shard_rows for shard in self.shards]
        if self.mode != DEFAULT or max(rows) <= WARN_RATIO * min(rows):
            return None
        others = ", ".join(name for name in names() if name != DEFAULT)
        return (
            f"warning: shards of {min(rows)} to {max(rows)} rows (more than {WARN_RATIO}x apart): "
            f"epoch_steps {DEFAULT} (the default) gives every rank's epoch {find(DEFAULT).describe}; "
            f"set epoch_steps ({others}) to choose (config/README.md)"
        )


def plan_epochs(shard_rows: Sequence[int], batch_size: int, mode: str) -> EpochPlan:
    """The epochs of shards of ``shard_rows`` rows under ``mode``, ``batch_size`` rows per micro-batch."""
    record = find(mode)
    shards = []
    for shard, rows in enumerate(shard_rows):
        target = record.target(shard_rows, shard)
        # One row over: iid's leftover row, kept (an iid run's batches are what they always were).
        epoch_rows = rows if target <= rows <= target + 1 else target
        shards.append(ShardEpoch(rows, epoch_rows, max(1, math.ceil(target / batch_size))))
    return EpochPlan(mode, batch_size, tuple(shards))


def unaligned(mode: str) -> str | None:
    """``mode`` when it gives the ranks different micro-batches per epoch (own), None when it keeps them
    in step: what dealing a lost rank's rows (orphans: reshard) cannot follow."""
    return None if find(mode).aligned else mode


def alignment_problem(mode: str, strategy: Any, sync_every: int, fsdp: int, apart: str) -> str | None:
    """``epoch_steps: ...`` when ``mode`` lets the ranks take their own step counts but they meet while
    training, else None. ``strategy`` is the run's strategy record (asked whether its ranks run apart
    at ``sync_every``, :meth:`shardfuse.strategies.registry.Strategy.runs_apart`); ``apart`` names the
    choices that do, for the fix."""
    if find(mode).aligned:
        return None
    *others, last = [record.name for record in RECORDS if record.aligned]
    aligned = f"{', '.join(others)} or {last}" if others else last
    if not strategy.runs_apart(sync_every):
        syncing = f" with sync_every {sync_every}" if sync_every else ""
        return (
            f"epoch_steps: {mode} lets each rank take its own number of steps, but strategy "
            f"{strategy.name}{syncing} keeps the ranks in step; set strategy {apart}, or epoch_steps "
            f"{aligned}"
        )
    if fsdp > 1:
        return (
            f"epoch_steps: {mode} lets each rank take its own number of steps, but with fsdp {fsdp} the "
            f"ranks of a replica share one model; set fsdp: 1, or epoch_steps {aligned}"
        )
    return None
