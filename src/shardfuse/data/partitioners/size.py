"""The size partitioner: quantity skew, shards of unequal sizes with iid rows (Flower Datasets'
``SizePartitioner`` and ``Linear``/``Square``/``ExponentialPartitioner``).

``sizes``: one fraction per rank (>= 0, summing to 1); or ``law``: rank r (counted from 1) gets a share
proportional to r (``linear``), r^2 (``square``) or e^r (``exponential``). Each rank gets
floor(share x N) rows and the last rank the rows left over, as Flower's id-to-size partitioners do. Which
rows: a seeded uniformly random arrangement of those sizes (iid's draw, :func:`.iid.iter_sized_assignment`),
where Flower cuts contiguous ranges in dataset order (flower#7290) and takes absolute sizes.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.dealing import MIN_ROWS, is_number, require_min_rows
from shardfuse.data.partitioners.iid import AssignmentReader, iter_sized_assignment
from shardfuse.io import UserError

LAWS = {"linear": lambda ids: ids, "square": np.square, "exponential": np.exp}

PARAMS = {
    "sizes": Param(
        None,
        "null or a list of fractions >= 0, one per rank, summing to 1",
        lambda v: v is None or (isinstance(v, list) and all(is_number(x) and x >= 0 for x in v)),
        lambda v: v if v is None else [float(x) for x in v],
    ),
    "law": Param(None, f"null or one of {', '.join(LAWS)}", lambda v: v is None or v in LAWS),
    "min_rows": MIN_ROWS,
}


def check(name: str, params: dict[str, Any], world_size: int, num_classes: int | None) -> None:
    """Exactly one of sizes and law; sizes one per rank, summing to 1."""
    sizes, law = params["sizes"], params["law"]
    if (sizes is None) == (law is None):
        raise UserError(
            f"partitioner {name} takes partition_sizes (a fraction per rank) or partition_law "
            f"({' | '.join(LAWS)}), {'not both' if law else 'one of them'}; set one"
        )
    if sizes is not None and (len(sizes) != world_size or not math.isclose(sum(sizes), 1, abs_tol=1e-6)):
        raise UserError(
            f"partitioner {name}: partition_sizes {sizes} are {len(sizes)} fractions summing to "
            f"{sum(sizes):g}; give {world_size} fractions (one per rank) that sum to 1"
        )


def shard_sizes(layout: Layout, params: dict[str, Any]) -> list[int]:
    """Rows per rank: floor(share x N), the rows left over to the last rank."""
    if params["sizes"] is not None:
        shares = np.array(params["sizes"], dtype=np.float64)
    else:
        units = LAWS[params["law"]](np.linspace(1, layout.world_size, layout.world_size))
        shares = units / units.sum()
    sizes = np.array(shares * layout.num_rows, dtype=np.int64)
    sizes[-1] += layout.num_rows - sizes.sum()
    return sizes.tolist()


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    sizes = shard_sizes(layout, params)
    fix = "give the small ranks larger shares, use fewer ranks or lower partition_min_rows"
    require_min_rows("size", sizes, params["min_rows"], fix)
    reader = AssignmentReader(iter_sized_assignment(sizes, layout.num_rows, layout.seed))
    return lambda num_rows, columns: reader.take(num_rows)
