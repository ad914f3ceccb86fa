"""The pathological partitioner: each rank sees ``classes_per_rank`` classes only (McMahan et al. 2017's
pathological non-IID; Flower Datasets' ``PathologicalPartitioner``, whose semantics it keeps).

Which classes a rank gets (classes in sorted order, C of them):
- ``deterministic``: rank r gets classes r, r + 1, ..., r + k - 1 (mod C): windows that overlap
  (2 ranks x 5 classes of digits: 0-4 and 1-5), as Flower's;
- ``first-deterministic``: class r mod C first, then classes drawn at random until it has k;
- ``random``: k classes drawn at random without replacement;
- ``blocks`` (ours, not Flower's): rank r gets the r-th block of k classes, r k ... r k + k - 1 (mod
  C): disjoint while W k <= C (2 ranks x 5 classes of digits: 0-4 and 5-9, Git Re-Basin's split).
Each class's rows, in input order, are then split evenly (np.array_split) among the ranks that have it,
in rank order; the rows of a class no rank has are dropped. Draws use numpy's ``default_rng(seed)`` as
Flower's do (``choice`` over the sorted classes), so the same seed picks the same classes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.dealing import (
    MIN_ROWS,
    SegmentPlan,
    array_split_sizes,
    is_int,
    require_min_rows,
    values_of,
)
from shardfuse.io import UserError

ASSIGNMENTS = ("random", "deterministic", "first-deterministic", "blocks")

PARAMS = {
    "classes_per_rank": Param(None, "an integer >= 1", lambda v: is_int(v) and v >= 1),
    "assignment": Param("random", f"one of {', '.join(ASSIGNMENTS)}", lambda v: v in ASSIGNMENTS),
    "min_rows": MIN_ROWS,
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (LABEL_COLUMN,)


def check(name: str, params: dict[str, Any], world_size: int, num_classes: int | None) -> None:
    """Not more classes per rank than the data has (where the config knows how many it has)."""
    if num_classes is not None:
        check_classes(num_classes, params)


def check_classes(num_classes: int, params: dict[str, Any]) -> None:
    if params["classes_per_rank"] > num_classes:
        raise UserError(
            f"partitioner pathological: partition_classes_per_rank {params['classes_per_rank']} is more "
            f"than the {num_classes} classes of the data; set it to at most {num_classes}"
        )


def rank_classes(classes: list[Any], layout: Layout, params: dict[str, Any]) -> list[list[Any]]:
    """The classes of each rank, by the assignment mode."""
    check_classes(len(classes), params)
    k, num_classes, mode = params["classes_per_rank"], len(classes), params["assignment"]
    rng = np.random.default_rng(layout.seed)
    choices = np.array(classes)
    chosen: list[list[Any]] = []
    for rank in range(layout.world_size):
        if mode in ("deterministic", "blocks"):
            first = rank * k if mode == "blocks" else rank
            chosen.append([classes[(first + i) % num_classes] for i in range(k)])
        elif mode == "random":
            chosen.append(rng.choice(choices, size=k, replace=False).tolist())
        else:
            mine = [classes[rank % num_classes]]
            while len(mine) < k:
                pick = rng.choice(choices, size=1)[0].item()
                if pick not in mine:
                    mine.append(pick)
            chosen.append(mine)
    return chosen


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    label_counts = counts[LABEL_COLUMN]
    classes = values_of("pathological", LABEL_COLUMN, label_counts)
    chosen = rank_classes(classes, layout, params)
    plan = SegmentPlan(LABEL_COLUMN, classes, layout.world_size)
    for index, value in enumerate(classes):
        holders = [rank for rank, mine in enumerate(chosen) if value in mine]
        if not holders:
            plan.add(index, 0, layout.world_size)
            continue
        start = 0
        for rank, rows in zip(holders, array_split_sizes(label_counts[value], len(holders)), strict=True):
            plan.add(index, start, rank)
            start += rows
    require_min_rows(
        "pathological",
        plan.sizes(label_counts),
        params["min_rows"],
        "raise partition_classes_per_rank, use fewer ranks or lower partition_min_rows",
    )
    return plan.deal()
