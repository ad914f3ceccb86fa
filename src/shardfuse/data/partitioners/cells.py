"""Local rules the partitioners share (the contract: :class:`.assignment.Cells`): each rank's local test
distribution from the shard manifest and the test rows.

- :func:`by_label` (dirichlet, pathological, shards): one cell per class; rank r's weights are its
  training label proportions (the manifest's ``label_counts``), so its local scores are the
  class-conditional test scores weighted by what it was dealt.
- :func:`whole_split` (size): one cell, the whole split: every rank's rows are iid, its local
  distribution the global one.
- :func:`one_per_rank`: a cell per rank, each rank all of its own (column: the test rows of its groups;
  continuous: the test rows the rule deals it).

NumPy only (the registry that names these is imported by the workflow).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Cells, Deal, Layout
from shardfuse.io import UserError


def cells_of_values(values: Any, index: Mapping[str, int]) -> np.ndarray:
    """Each value's cell by its text (the manifest's keys are ``str(value)``), -1 where it has none."""
    return np.fromiter(
        (index.get(str(value), -1) for value in np.asarray(values).tolist()),
        dtype=np.int64,
        count=len(values),
    )


def one_per_rank(world_size: int, cell_of: Deal) -> Cells:
    """Cell r is rank r's, whole: rank r's weights are 1 on it, 0 elsewhere."""
    identity = np.eye(world_size)
    return Cells(
        tuple(f"rank {rank}" for rank in range(world_size)),
        tuple(tuple(row.tolist()) for row in identity),
        cell_of,
    )


def by_label(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    """A cell per class the shards hold; rank r's weights its shard's label proportions."""
    counts = [shard.get("label_counts") or {} for shard in shards]
    if not all(counts):
        raise UserError(
            "the shard manifest records no label counts for a rank, so its label mix is unknown; re-run "
            "the partition stage (snakemake -R partition)"
        )
    # In label order (the manifest's keys are the class codes' text: "10" after "9").
    return by_counts(counts, LABEL_COLUMN, _label_order)


def by_counts(
    counts: Sequence[Mapping[str, int]], column: str, order: Callable[[str], Any], prefix: str = ""
) -> Cells:
    """A cell per value of ``column`` the ranks' training counts hold (``order`` sorts their text),
    each rank's weights its own counts' proportions; ``prefix`` names the cells (``domain 0``)."""
    names = sorted({value for found in counts for value in found}, key=order)
    index = {name: cell for cell, name in enumerate(names)}
    weights = []
    for found in counts:
        total = sum(found.values())
        weights.append(tuple(found.get(name, 0) / total for name in names))
    return Cells(
        tuple(f"{prefix}{name}" for name in names),
        tuple(weights),
        lambda num_rows, shown: cells_of_values(shown[column], index),
    )


def whole_split(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    """One cell, every test row: each rank's local distribution is the global one."""
    return Cells(
        ("all",),
        ((1.0,),) * layout.world_size,
        lambda num_rows, shown: np.zeros(num_rows, dtype=np.int64),
    )


def _label_order(name: str) -> tuple[int, int | str]:
    text = name.lstrip("-")
    return (0, int(name)) if text.isdigit() else (1, name)
