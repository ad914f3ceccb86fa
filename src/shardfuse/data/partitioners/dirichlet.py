"""The dirichlet partitioner: label skew by a Dirichlet draw per class (Hsu et al. 2019; Flower Datasets'
``DirichletPartitioner``, whose semantics it keeps).

For each class in label order, proportions p ~ Dir(alpha, ..., alpha) over the ranks; the class's rows,
in input order, are cut at floor(cumsum(p) * rows) into one run per rank. With ``self_balancing``, a rank
already holding more than N / W rows gets p = 0 for the classes still to come (the rest renormalised).
While a rank is left under ``min_rows``, every class is drawn again (the generator goes on), at most
:data:`MAX_DRAWS` times in all; then one line names alpha and the minimum. Small alpha: each rank
sees few classes; large alpha: close to iid.

The generator is numpy's ``default_rng(seed)`` drawing ``dirichlet`` per class in sorted label order, as
Flower's does, so the same seed gives the rows of each of Flower's partitions (bench/partition.py
checks it); Flower then shuffles each partition, where shards keep input order (training reshuffles).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.dealing import MIN_ROWS, SegmentPlan, is_number, values_of
from shardfuse.io import UserError

MAX_DRAWS = 11  # Flower: the first draw and 10 more, then a ValueError

PARAMS = {
    "alpha": Param(
        None, "a number > 0 (the Dirichlet concentration)", lambda v: is_number(v) and v > 0, float
    ),
    "min_rows": MIN_ROWS,
    "self_balancing": Param(False, "true or false", lambda v: isinstance(v, bool)),
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (LABEL_COLUMN,)


def draw(layout: Layout, class_rows: list[int], params: dict[str, Any]) -> list[np.ndarray]:
    """Each class's cut points (W - 1 occurrences), redrawn until every rank has min_rows rows."""
    world_size, min_rows = layout.world_size, params["min_rows"]
    rng = np.random.default_rng(layout.seed)
    alpha = np.full(world_size, params["alpha"])
    balance_at = layout.num_rows / world_size
    for _ in range(MAX_DRAWS):
        sizes = np.zeros(world_size, dtype=np.int64)
        cuts = []
        for rows in class_rows:
            proportions = rng.dirichlet(alpha)
            if params["self_balancing"]:
                kept = [0 if sizes[rank] > balance_at else p for rank, p in enumerate(proportions)]
                total = sum(kept)  # in rank order, as Flower sums them
                proportions = [p / total for p in kept]
            bounds = (np.cumsum(proportions) * rows).astype(int)[:-1]
            sizes += np.diff([0, *bounds, rows])
            cuts.append(bounds)
        if sizes.min() >= min_rows:
            return cuts
    raise UserError(
        f"partitioner dirichlet: {MAX_DRAWS} draws with partition_alpha {params['alpha']} each left a rank "
        f"under partition_min_rows {min_rows} (the last: shards of {'/'.join(map(str, sizes))} rows); raise "
        "partition_alpha, lower partition_min_rows or use fewer ranks"
    )


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    label_counts = counts[LABEL_COLUMN]
    classes = values_of("dirichlet", LABEL_COLUMN, label_counts)
    plan = SegmentPlan(LABEL_COLUMN, classes, layout.world_size)
    for index, bounds in enumerate(draw(layout, [label_counts[c] for c in classes], params)):
        for rank, start in enumerate([0, *bounds.tolist()]):
            plan.add(index, start, rank)
    return plan.deal()
