"""The column partitioner: natural groups. Each value of ``column`` (a user, a writer, a site, a domain) is
a group, and a group's rows all go to one rank.

Flower Datasets' ``NaturalIdPartitioner`` makes one partition per value; here the groups are dealt to the
W ranks, balanced by rows: largest group first, each to the rank with the fewest rows so far (ties: the
lower rank; groups of equal size in a seeded random order, so shard_seed still matters). Or
``groups`` names them: a list of W lists, rank r's values (the rows of values it does not name are
dropped). The column travels in the shards as data, never as a model input (only x..., x and tokens
are inputs: shardfuse.data.shard_format); integers or strings, not floats (the counting pass refuses
to count a float column; ``continuous`` splits by one), never the label (``pathological`` and
``dirichlet`` split by labels).
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Cells, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.cells import cells_of_values, one_per_rank
from shardfuse.data.partitioners.dealing import MIN_ROWS, SegmentPlan, require_min_rows, values_of
from shardfuse.io import UserError


def _is_group_list(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(values, list)
        and all(isinstance(v, (int, str)) and not isinstance(v, bool) for v in values)
        for values in value
    )


PARAMS = {
    "column": Param(None, "the name of a column of the data", lambda v: isinstance(v, str) and v != ""),
    "groups": Param(
        None, "null or a list of one list of column values per rank", lambda v: v is None or _is_group_list(v)
    ),
    "min_rows": MIN_ROWS,
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (params["column"],)


def check(name: str, params: dict[str, Any], world_size: int, num_classes: int | None) -> None:
    """The column is not the label; named groups: one non-empty list per rank, no value twice."""
    if params["column"] == LABEL_COLUMN:
        raise UserError(
            f"partitioner {name}: partition_column {LABEL_COLUMN!r} is the label; split by labels with "
            "partition: pathological or dirichlet, or name a group column"
        )
    groups = params["groups"]
    if groups is None:
        return
    if len(groups) != world_size or not all(groups):
        raise UserError(
            f"partitioner {name}: partition_groups lists {len(groups)} groups of values "
            f"({', '.join(str(len(values)) for values in groups)} values) for {world_size} ranks; give "
            "every rank a non-empty list"
        )
    flat = [value for values in groups for value in values]
    if len(set(flat)) != len(flat):
        twice = next(value for value in flat if flat.count(value) > 1)
        raise UserError(f"partitioner {name}: partition_groups names {twice!r} for two ranks; name it once")


def check_groups(name: str, params: dict[str, Any], world_size: int, num_groups: Mapping[str, int]) -> None:
    """Dealt balanced, every rank needs a group of its own (named groups say their own ranks):
    ``num_groups`` holds the groups of the columns known so far (the spec's, before any job; the
    counting pass's, at partition time)."""
    column = params["column"]
    found = num_groups.get(column)
    if params["groups"] is None and found is not None and found < world_size:
        raise UserError(
            f"partitioner {name}: column {column!r} holds {found} groups, fewer than the {world_size} "
            f"ranks; use at most {found} ranks or another column"
        )


def balanced(values: list[Any], counts: ValueCounts, layout: Layout) -> list[int]:
    """Each value's rank: largest group first to the rank with the fewest rows (ties: lower rank)."""
    tie_break = np.random.default_rng(layout.seed).permutation(len(values))
    order = sorted(range(len(values)), key=lambda i: (-counts[values[i]], tie_break[i]))
    loads = [(0, rank) for rank in range(layout.world_size)]
    ranks = [0] * len(values)
    for i in order:
        rows, rank = heapq.heappop(loads)
        ranks[i] = rank
        heapq.heappush(loads, (rows + counts[values[i]], rank))
    return ranks


def named(values: list[Any], groups: list[list[Any]], column: str, world_size: int) -> list[int]:
    """Each value's rank from ``groups`` (world_size: dropped); a named value the data lacks is refused."""
    rank_of = {value: rank for rank, values_of_rank in enumerate(groups) for value in values_of_rank}
    missing = sorted(set(rank_of) - set(values), key=str)
    if missing:
        raise UserError(
            f"partitioner column: partition_groups names {missing[0]!r}, which column {column!r} does not "
            f"hold (it holds {', '.join(map(repr, values[:10]))}{', ...' if len(values) > 10 else ''}); fix "
            "partition_groups"
        )
    return [rank_of.get(value, world_size) for value in values]


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    column = params["column"]
    column_counts = counts[column]
    values = values_of("column", column, column_counts)
    check_groups("column", params, layout.world_size, {column: len(values)})
    if params["groups"] is None:
        ranks = balanced(values, column_counts, layout)
    else:
        ranks = named(values, params["groups"], column, layout.world_size)
    plan = SegmentPlan(column, values, layout.world_size)
    for index, rank in enumerate(ranks):
        plan.add(index, 0, rank)
    require_min_rows(
        "column", plan.sizes(column_counts), params["min_rows"], "use fewer ranks or lower partition_min_rows"
    )
    return plan.deal()


def local(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    """Rank r's local test distribution: the test rows whose group its shard holds (the manifest's
    ``value_counts`` of the column); a group no shard holds (only in the test split) is in no cell."""
    column = params["column"]
    owner = {
        value: rank
        for rank, shard in enumerate(shards)
        for value in (shard.get("value_counts") or {}).get(column, {})
    }
    return one_per_rank(layout.world_size, lambda num_rows, shown: cells_of_values(shown[column], owner))
