"""The shards partitioner: FedAvg's sort-and-deal (McMahan et al. 2017; Flower Datasets'
``ShardPartitioner`` with ``num_shards_per_partition``, whose semantics it keeps).

The rows sorted by label (stably: input order within a label) are cut into shards of
floor(N / (W * shards_per_rank)) rows; a seeded permutation of the whole shards (numpy's
``default_rng(seed).permutation``, as Flower's) gives each rank ``shards_per_rank`` of them; the rest
(the leftover rows past the last whole shard, and whole shards nobody got) are dropped. No sort is
made: a row's place in the sorted order is its label's offset plus the rows of that label before it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.dealing import MIN_ROWS, SegmentPlan, is_int, require_min_rows, values_of
from shardfuse.io import UserError

PARAMS = {
    "shards_per_rank": Param(2, "an integer >= 1 (FedAvg used 2)", lambda v: is_int(v) and v >= 1),
    "min_rows": MIN_ROWS,
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (LABEL_COLUMN,)


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    label_counts = counts[LABEL_COLUMN]
    classes = values_of("shards", LABEL_COLUMN, label_counts)
    num_used = layout.world_size * params["shards_per_rank"]
    shard_rows = layout.num_rows // num_used
    if shard_rows == 0:
        raise UserError(
            f"partitioner shards: {layout.world_size} ranks x partition_shards_per_rank "
            f"{params['shards_per_rank']} shards is more shards than the {layout.num_rows} rows; lower "
            "partition_shards_per_rank or use fewer ranks"
        )
    num_whole = layout.num_rows // shard_rows
    chosen = np.random.default_rng(layout.seed).permutation(num_whole)[:num_used]
    shard_rank = np.full(num_whole + 1, layout.world_size, dtype=np.int64)  # the last: past the whole shards
    shard_rank[chosen] = np.arange(num_used) // params["shards_per_rank"]
    plan = SegmentPlan(LABEL_COLUMN, classes, layout.world_size)
    offset = 0
    for index, value in enumerate(classes):
        rows = label_counts[value]
        # The shards this label's sorted rows fall in, each from the occurrence where it begins.
        for shard in range(offset // shard_rows, (offset + rows - 1) // shard_rows + 1):
            start = max(0, shard * shard_rows - offset)
            plan.add(index, start, int(shard_rank[min(shard, num_whole)]))
        offset += rows
    require_min_rows(
        "shards",
        plan.sizes(label_counts),
        params["min_rows"],
        "lower partition_shards_per_rank or partition_min_rows, or use fewer ranks",
    )
    return plan.deal()
