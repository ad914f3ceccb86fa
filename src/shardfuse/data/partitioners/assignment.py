"""What a partitioner is given and what it gives back: the contract between the partition stage and
every partitioner in :mod:`shardfuse.data.partitioners.registry`.

Rows are dealt in two streamed passes, so memory stays flat in the number of rows whatever the rule:

1. the counting pass (only for a partitioner that declares columns): for each column it names
   (``Partitioner.columns(params)``: the label, a group column), how many rows hold each value;
2. the deal: ``Partitioner.assign(layout, counts, params)`` returns a :data:`Deal`, which the stage
   calls on the rows in input order, one read batch at a time, with that batch's declared columns; it
   returns each row's rank (``world_size`` marks a dropped row).

A deal sees every row once and keeps none: what it must know about all rows it learns from the counts.
Its output may depend on the layout, the counts and the params, never on how rows were batched (the
stage's --batch-size changes memory, not bytes).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

# A column's values and the rows holding each, in value order (a null last): the counting pass's result.
ValueCounts = dict[Any, int]

# (rows in this batch, the batch's declared columns as NumPy arrays) -> each row's rank, an integer array
# of that many entries in 0..world_size (world_size: the row is dropped).
Deal = Callable[[int, Mapping[str, np.ndarray]], np.ndarray]


@dataclass(frozen=True)
class Layout:
    """What every partitioner is told: the rows to deal, the ranks, the seed, and whether the N mod W
    leftover rows may be dropped so that shards have equal sizes."""

    num_rows: int
    world_size: int
    seed: int
    drop_remainder: bool = False


@dataclass(frozen=True)
class Param:
    """One parameter of a partitioner: its default, what it must be (for the one-line error), and the
    test a value must pass."""

    default: Any
    describe: str
    accept: Callable[[Any], bool] = lambda value: True
