"""Exact order statistics of a task vector's magnitudes, streamed: the value at given positions of
|tau| sorted ascending, with how many entries lie below it and how many equal it, in two passes over
the blocks instead of one rank's whole |tau| in memory.

Pass 1 counts the magnitudes per bucket of their float64 bit pattern's top bits (non-negative floats
order as their bits do): sign (always 0), the 11 exponent bits and 4 mantissa bits, 2**16 buckets,
each spanning 1/16 of a power of two. The cumulative counts name the bucket each position falls in and
how many entries lie in the buckets below. Pass 2 keeps only the entries of those buckets, and the
position's value is found among them exactly (``np.partition``): the same value, and the same counts,
as partitioning the whole array. Memory: the counts (512 KiB) and the candidates, a few per cent of the
tensor for smooth magnitudes; at worst (every magnitude within one bucket) the whole rank, as before.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

KEY_SHIFT = 47  # int64 view >> 47: the sign bit (0), 11 exponent bits and the top 4 mantissa bits
NUM_BUCKETS = 1 << (64 - KEY_SHIFT)


class StreamedRanks:
    """The values at ``positions`` (0-based, ascending order) of non-negative float64 magnitudes fed
    by :meth:`add` in two passes of the same blocks in the same order, each pass closed by
    :meth:`end_pass`; after the second, ``results[i]`` is ``(value, below, equal)`` for
    ``positions[i]``: the value, the number of entries less than it and the number equal to it."""

    def __init__(self, positions: Sequence[int]) -> None:
        self.positions = [int(p) for p in positions]
        self.histogram: np.ndarray | None = np.zeros(NUM_BUCKETS, dtype=np.int64)
        self.buckets: list[tuple[int, int]] = []  # per position: (its bucket, entries in buckets below)
        self.candidates: dict[int, list[np.ndarray]] = {}
        self.results: list[tuple[float, int, int]] = []
        self.passes_done = 0

    def add(self, magnitudes: np.ndarray) -> None:
        keys = np.ascontiguousarray(magnitudes, dtype=np.float64).view(np.int64) >> KEY_SHIFT
        if self.passes_done == 0:
            self.histogram += np.bincount(keys, minlength=NUM_BUCKETS)
            return
        for bucket, parts in self.candidates.items():
            parts.append(magnitudes[keys == bucket])

    def end_pass(self) -> bool:
        """Close a pass; True once the results are known (after the second)."""
        if self.passes_done == 0:
            cumulative = np.cumsum(self.histogram)
            self.histogram = None
            total = int(cumulative[-1])
            for position in self.positions:
                if not 0 <= position < total:
                    raise ValueError(f"position {position} outside 0..{total - 1}")
                bucket = int(np.searchsorted(cumulative, position, side="right"))
                self.buckets.append((bucket, int(cumulative[bucket - 1]) if bucket else 0))
            self.candidates = {bucket: [] for bucket, _ in self.buckets}
            self.passes_done = 1
            return False
        merged = {bucket: np.concatenate(parts) for bucket, parts in self.candidates.items()}
        self.candidates = {}
        for position, (bucket, below_bucket) in zip(self.positions, self.buckets, strict=True):
            values = merged[bucket]
            offset = position - below_bucket
            value = float(np.partition(values, offset)[offset])
            below = below_bucket + int(np.count_nonzero(values < value))
            self.results.append((value, below, int(np.count_nonzero(values == value))))
        self.passes_done = 2
        return True
