"""What a partitioner is given and what it gives back: the contract between the partition stage and
every partitioner in :mod:`shardfuse.data.partitioners.registry`.

Rows are dealt in two streamed passes, so memory stays flat in the number of rows whatever the rule:

1. the counting pass (only for a partitioner that counts columns): for each column it counts
   (``Partitioner.counted(params)``, by default the columns it reads: the label, a group column), how
   many rows hold each value;
2. the deal: ``Partitioner.assign(layout, counts, params)`` returns a :data:`Deal`, which the stage
   calls on the rows in input order, one read batch at a time, with that batch's declared columns
   (``Partitioner.columns(params)``); it returns each row's rank (``world_size`` marks a dropped row).

A deal sees every row once and keeps none: what it must know about all rows it learns from the counts,
or, where value counts are not enough (quantiles of a float column: ``continuous``), from its own
passes over the declared columns through ``layout.scan``. Its output may depend on the layout, the
counts and the params, never on how rows were batched (the stage's --batch-size changes memory, not
bytes).

A partitioner with a local rule (``Partitioner.local``) also says what each rank's local test
distribution is (each rank scored on its own ground, issue 48): :class:`Cells`, disjoint cells of the
test split's rows, each rank's distribution a mixture of them. Evaluate scores every model once per cell
and mixes the sums (:mod:`shardfuse.scoring.mixture`), so a local score is exact, never resampled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

# A column's values and the rows holding each, in value order (a null last): the counting pass's result.
ValueCounts = dict[Any, int]

# (rows in this batch, the batch's declared columns as NumPy arrays) -> each row's rank, an integer array
# of that many entries in 0..world_size (world_size: the row is dropped).
Deal = Callable[[int, Mapping[str, np.ndarray]], np.ndarray]

# Reads the declared columns again from the first row, one batch at a time (each call a new pass).
Scan = Callable[[], Iterator[Mapping[str, np.ndarray]]]

# The column of class labels in a prepared split (shardfuse.data.shard_format.LABEL_COLUMN; a test
# holds them equal: this package stays pyarrow-free for the workflow, which imports the registry).
LABEL_COLUMN = "label"


@dataclass(frozen=True)
class Layout:
    """What every partitioner is told: the rows to deal, the ranks, the seed, and whether the N mod W
    leftover rows may be dropped so that shards have equal sizes."""

    num_rows: int
    world_size: int
    seed: int
    drop_remainder: bool = False
    scan: Scan | None = field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Param:
    """One parameter of a partitioner: its default, what it must be (for the one-line error), the
    test a value must pass, and the form it is kept in (so that 1 and 1.0 name one shard set)."""

    default: Any
    describe: str
    accept: Callable[[Any], bool] = lambda value: True
    normalize: Callable[[Any], Any] = lambda value: value


@dataclass(frozen=True)
class Cells:
    """Each rank's local test distribution: a mixture of disjoint cells of the test split's rows.

    ``cell_of`` is called like a :data:`Deal` on the test rows in order, one batch at a time, with the
    partitioner's declared columns, and returns each row's cell (0..len(names)-1; -1: in no cell).
    ``weights[r][k]`` is cell k's share of rank r's distribution (the rows of a cell weighing alike); a
    rank's weights sum to 1, and a cell it never saw weighs 0 for it."""

    names: tuple[str, ...]  # each cell's name in eval.json (a class, a rank's groups, "all")
    weights: tuple[tuple[float, ...], ...]  # one row per rank
    cell_of: Deal


# (the test split's layout: its rows, the shard set's world size and seed, a scan of the declared columns;
# the manifest's shard entries, by rank; the resolved params) -> each rank's local test distribution.
LocalRule = Callable[[Layout, Sequence[Mapping[str, Any]], dict[str, Any]], Cells]
