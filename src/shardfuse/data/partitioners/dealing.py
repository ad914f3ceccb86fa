"""What the partitioners that read a column share: their parameters' tests, the checks on the counts,
the minimum shard size, and one streamed deal by segments of each value's rows.

A value's rows are numbered in input order (its occurrences 0, 1, ...); a plan cuts each value's
occurrences into segments and gives each segment a rank. Every rule of this package that deals by a
column is such a plan: dirichlet and pathological cut each class into per-rank runs (Flower splits a
class's indices in dataset order too), shards cuts the label-sorted order into shards, column gives a
group's rows one rank. The deal then needs, per row, only its value and how many rows of that value came
before: memory is the plan (values x ranks), never the rows.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import Deal, Param, ValueCounts
from shardfuse.io import UserError


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


MIN_ROWS = Param(
    10, "an integer >= 1 (the fewest rows a shard may get)", lambda v: is_int(v) and v >= 1
)  # Flower's min_partition_size (DirichletPartitioner); here every partitioner but iid holds it


def require_min_rows(name: str, sizes: Sequence[int], min_rows: int, fix: str) -> None:
    """Every shard gets at least ``min_rows`` rows: else one line with the sizes and ``fix``."""
    if min(sizes) < min_rows:
        raise UserError(
            f"partitioner {name} would leave rank {int(np.argmin(sizes))} with {min(sizes)} rows, under "
            f"partition_min_rows {min_rows} (shards of {'/'.join(map(str, sizes))} rows); {fix}"
        )


def values_of(name: str, column: str, counts: ValueCounts) -> list[Any]:
    """The values of ``column`` in value order, refusing nulls (a row without a value has no rank)."""
    if None in counts:
        raise UserError(
            f"partitioner {name}: column {column!r} holds {counts[None]} null values; fill them in the "
            "data or pick another column"
        )
    return list(counts)


def array_split_sizes(num_rows: int, parts: int) -> list[int]:
    """np.array_split's part sizes: the first num_rows % parts parts get one row more."""
    base, extra = divmod(num_rows, parts)
    return [base + 1 if part < extra else base for part in range(parts)]


class SegmentPlan:
    """Each value's occurrences cut into segments, each with a rank (``world_size``: dropped)."""

    def __init__(self, column: str, values: Sequence[Any], world_size: int) -> None:
        self.column = column
        self.values = list(values)
        self.world_size = world_size
        self.starts: list[list[int]] = [[] for _ in self.values]
        self.ranks: list[list[int]] = [[] for _ in self.values]

    def add(self, value_index: int, start: int, rank: int) -> None:
        """From occurrence ``start`` on (until the next segment), rows of the value go to ``rank``."""
        self.starts[value_index].append(start)
        self.ranks[value_index].append(rank)

    def sizes(self, counts: ValueCounts) -> list[int]:
        """Rows per rank (the dropped ones left out)."""
        sizes = np.zeros(self.world_size + 1, dtype=np.int64)
        for value, starts, ranks in zip(self.values, self.starts, self.ranks, strict=True):
            ends = [*starts[1:], counts[value]]
            np.add.at(sizes, ranks, np.subtract(ends, starts))
        return sizes[: self.world_size].tolist()

    def deal(self) -> Deal:
        return _SegmentDeal(self)


class _SegmentDeal:
    """The plan as a deal. A batch's rows are ordered by value (a stable radix sort of the value
    indices, so each value's rows stay in input order) and each value's run is cut where its
    segments begin: a few slice assignments per value, no per-row lookup. Values of one segment
    (column's groups) need no order: their rank is the value's."""

    def __init__(self, plan: SegmentPlan) -> None:
        if any(not starts or starts[0] != 0 for starts in plan.starts):
            raise ValueError("a segment plan gives every value a segment from occurrence 0")
        self.column = plan.column
        self.values = ValueIndex(plan.values)
        self.starts, self.ranks = plan.starts, plan.ranks
        rank_dtype = np.min_scalar_type(plan.world_size)  # as iid's: grouping by rank compares less
        self.rank_dtype = rank_dtype
        self.only_rank = (
            np.array([ranks[0] for ranks in plan.ranks], dtype=rank_dtype)
            if all(len(starts) == 1 for starts in plan.starts)
            else None
        )
        self.seen = np.zeros(len(plan.values), dtype=np.int64)
        self.index_dtype = np.min_scalar_type(max(len(plan.values) - 1, 0))

    def __call__(self, num_rows: int, shown: Mapping[str, np.ndarray]) -> np.ndarray:
        rows_value = self.values.of(shown[self.column])
        if self.only_rank is not None:
            return self.only_rank[rows_value]
        order = np.argsort(rows_value.astype(self.index_dtype), kind="stable")
        per_value = np.bincount(rows_value, minlength=len(self.seen))
        ranks = np.empty(num_rows, dtype=self.rank_dtype)
        first = 0
        for value in np.flatnonzero(per_value).tolist():
            count = int(per_value[value])
            self._fill(ranks, order[first : first + count], value)
            first += count
        return ranks

    def _fill(self, ranks: np.ndarray, rows: np.ndarray, value: int) -> None:
        """Rows of ``value`` (in input order) get the ranks of the segments their occurrences fall in."""
        starts, seen = self.starts[value], int(self.seen[value])
        end = seen + len(rows)
        segment = bisect.bisect_right(starts, seen) - 1
        while segment < len(starts) and starts[segment] < end:
            stop = min(starts[segment + 1], end) if segment + 1 < len(starts) else end
            ranks[rows[max(starts[segment], seen) - seen : stop - seen]] = self.ranks[value][segment]
            segment += 1
        self.seen[value] = end


class ValueIndex:
    """Each row's value as its index in the plan's values: a lookup table for integers of a compact
    range (labels, ids), np.unique and a dict otherwise (strings)."""

    def __init__(self, values: list[Any]) -> None:
        self.index = {value: i for i, value in enumerate(values)}
        self.table = None
        if values and all(is_int(value) for value in values):
            low, high = min(values), max(values)
            if high - low < 4 * len(values) + (1 << 16):
                self.low = low
                self.table = np.full(high - low + 1, -1, dtype=np.int64)
                self.table[np.array(values) - low] = np.arange(len(values))

    def of(self, column: np.ndarray) -> np.ndarray:
        if self.table is not None and np.issubdtype(column.dtype, np.integer):
            return self.table[column - self.low]
        uniques, inverse = np.unique(column, return_inverse=True)
        return np.array([self.index[value] for value in uniques.tolist()], dtype=np.int64)[inverse]
