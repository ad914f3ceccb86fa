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

    def deal(self, counts: ValueCounts) -> Deal:
        return _SegmentDeal(self, counts)


class _SegmentDeal:
    """The plan as a deal: every (value, occurrence) is looked up in one sorted table of segment
    starts, the key value_index * stride + occurrence (stride: more than any value's rows). Values of
    one segment (column's groups) need no occurrence: their rank is the value's."""

    def __init__(self, plan: SegmentPlan, counts: ValueCounts) -> None:
        if any(not starts or starts[0] != 0 for starts in plan.starts):
            raise ValueError("a segment plan gives every value a segment from occurrence 0")
        self.column = plan.column
        self.values = ValueIndex(plan.values)
        self.stride = np.int64(1 + max(counts.values(), default=0))
        keys = [i * int(self.stride) + start for i, starts in enumerate(plan.starts) for start in starts]
        self.keys = np.array(keys, dtype=np.int64)
        rank_dtype = np.min_scalar_type(plan.world_size)  # as iid's: grouping by rank compares less
        self.ranks = np.array([rank for ranks in plan.ranks for rank in ranks], dtype=rank_dtype)
        self.one_segment = all(len(starts) == 1 for starts in plan.starts)
        self.seen = np.zeros(len(plan.values), dtype=np.int64)

    def __call__(self, num_rows: int, shown: Mapping[str, np.ndarray]) -> np.ndarray:
        rows_value = self.values.of(shown[self.column])
        if self.one_segment:
            return self.ranks[rows_value]
        occurrence = self._occurrences(rows_value)
        found = np.searchsorted(self.keys, rows_value * self.stride + occurrence, side="right") - 1
        return self.ranks[found]

    def _occurrences(self, rows_value: np.ndarray) -> np.ndarray:
        """Each row's occurrence: the rows of its value before it (earlier batches, then this one)."""
        per_value = np.bincount(rows_value, minlength=len(self.seen))
        occurrence = np.empty(len(rows_value), dtype=np.int64)
        present = np.flatnonzero(per_value)
        if len(present) <= SMALL_VALUE_COUNT:  # a few classes: a pass per value beats a sort
            for value in present.tolist():
                where = np.flatnonzero(rows_value == value)
                occurrence[where] = self.seen[value] + np.arange(len(where))
        else:
            order = np.argsort(rows_value, kind="stable")
            firsts = np.cumsum(per_value) - per_value
            occurrence[order] = np.arange(len(rows_value)) - np.repeat(firsts, per_value)
            occurrence += self.seen[rows_value]
        self.seen += per_value
        return occurrence


SMALL_VALUE_COUNT = 32


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
