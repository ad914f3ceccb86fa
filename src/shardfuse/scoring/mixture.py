"""Scores on a weighted mixture of a split's cells, exact: each model is scored once per cell (the task's
running sums, :class:`shardfuse.models.task.Totals`), and a mixture's metrics are the task's ``finish`` of
the cells' sums rescaled so that each row of cell k weighs ``weights[k] / rows_k``.

That is exact, not resampled, because every task's ``finish`` is a function of its sums divided by the
rows (classification: loss and correct per row; regression: loss, squared and absolute errors per row,
and r2 from the targets' first two moments, all per row; causal_lm: loss per token): scaling a cell's
sums and its rows by one factor leaves its metrics as they were, and adding cells adds sums. A cell alone
(weight 1) gives its own sums back unchanged, so its metrics are bitwise those of its rows' outputs
alone. A task whose ``finish`` is not such a function (a median, a rank statistic) would need the rows.

A set is one vector of weights over the cells. A cell with weight but no rows in the split (a class a
rank trained on that the test split lacks) is dropped and the rest renormalised; the set records what
it dropped. Used by evaluate's local sets (shardfuse.scoring.local); no command line.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardfuse.io import UserError
from shardfuse.models.task import Totals


@dataclass(frozen=True)
class WeightedSet:
    """One mixture: its name in eval.json, its weights over the cells (summing to 1, none on a cell
    without rows), and what eval.json records of it beside its scores."""

    name: str
    weights: tuple[float, ...]
    record: dict[str, Any]


@dataclass(frozen=True)
class Weighting:
    """Sets that weigh the rows of the headline split: each row's cell (-1: in none), the sets."""

    of_row: np.ndarray
    num_cells: int
    sets: tuple[WeightedSet, ...]


def weighted_sets(
    names: Sequence[str], weights: np.ndarray, of_row: np.ndarray, sets: Sequence[str], fix: str
) -> list[WeightedSet]:
    """One set per row of ``weights`` (cells ``names``), cells without rows dropped and the rest
    renormalised. Each set's record: ``rows`` (the split's rows it weighs), ``weights`` ({cell: weight}
    of the cells it weighs) and, where it dropped any, ``dropped`` ({cell: the weight it had}). A set
    left without rows is a one-line error ending in ``fix``."""
    rows = np.bincount(of_row[of_row >= 0], minlength=len(names))
    found = []
    for name, row in zip(sets, weights, strict=True):
        held = np.where(rows > 0, row, 0.0)
        if held.sum() <= 0:
            raise UserError(f"evaluation set {name!r} weighs no row of the test split; {fix}")
        kept = held / held.sum()
        record: dict[str, Any] = {
            "rows": int(rows[kept > 0].sum()),
            "weights": {cell: float(w) for cell, w in zip(names, kept, strict=True) if w > 0},
        }
        dropped = {cell: float(w) for cell, w, n in zip(names, row, rows, strict=True) if w > 0 and n == 0}
        if dropped:
            record["dropped"] = dropped
        found.append(WeightedSet(name, tuple(kept.tolist()), record))
    return found


def mix(cells: Sequence[Totals], weights: Sequence[float]) -> Totals:
    """The sums of a mixture: cell k's sums times weights[k] * N / rows_k, with N = sum of weights[k] *
    rows_k over the cells it weighs (so one cell alone keeps its sums and rows exactly); rows N."""
    held = [(totals, w) for totals, w in zip(cells, weights, strict=True) if w > 0]
    if any(totals.rows == 0 for totals, _ in held):
        raise ValueError("a mixture weighs a cell that holds no rows")
    scale = sum(w * totals.rows for totals, w in held)
    mixed = Totals(rows=scale)
    for totals, w in held:
        factor = w * scale / totals.rows
        for name, value in totals.sums.items():
            mixed.add(name, value * factor)
    return mixed
