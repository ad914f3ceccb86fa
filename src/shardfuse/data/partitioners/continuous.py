"""The continuous partitioner: skew along a numeric column (Flower Datasets' ``ContinuousPartitioner``,
whose semantics it keeps).

Each row's score is strictness x z + (1 - strictness) x e, with z the column standardised (mean and
population std of all rows) and e ~ N(0, 1) from numpy's ``default_rng(seed)`` in row order (one draw
per row, as Flower's single ``normal`` call); the rows sorted by score are cut into W runs of
np.array_split's sizes (the first N % W one row longer). strictness 0: iid; 1: sorted by the column.

Streamed without a sort: a pass for the moments (Chan's parallel update, batch by batch), then the
score at each cut is found exactly by a radix select over the scores' order-preserving 64-bit keys,
:data:`DIGIT_BITS` bits a pass (the scores are recomputed each pass: the noise is a function of the
row's position), so memory is the cuts' histograms, never the rows. Equal scores are ordered by
input position (a stable sort; Flower's argsort is not stable, so at strictness 1 with repeated values
the rows of a tied run may be cut differently).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import Cells, Deal, Layout, Param, Scan, ValueCounts
from shardfuse.data.partitioners.cells import one_per_rank
from shardfuse.data.partitioners.dealing import MIN_ROWS, array_split_sizes, is_number, require_min_rows
from shardfuse.io import UserError

DIGIT_BITS = 8  # a histogram of 256 counts per cut and pass: 8 passes give the whole 64-bit key
MIN_STD = 1e-6  # Flower refuses a column this flat (strictness > 0): nothing to sort by

PARAMS = {
    "column": Param(
        None, "the name of a numeric column of the data", lambda v: isinstance(v, str) and v != ""
    ),
    "strictness": Param(
        None,
        "a number from 0 (iid) to 1 (sorted by the column)",
        lambda v: is_number(v) and 0 <= v <= 1,
        float,
    ),
    "min_rows": MIN_ROWS,
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (params["column"],)


def counted(params: dict[str, Any]) -> tuple[str, ...]:
    return ()  # a float column's value counts would be as large as the data: moments instead (a scan)


def _values(column: str, shown: Mapping[str, np.ndarray]) -> np.ndarray:
    values = np.asarray(shown[column])
    if not np.issubdtype(values.dtype, np.number) or not np.isfinite(values).all():
        raise UserError(
            f"partitioner continuous: column {column!r} holds {values.dtype} values that are not all "
            "finite numbers (nulls, NaN or text); name a numeric column without gaps"
        )
    return values.astype(np.float64)


def moments(scan: Scan, column: str) -> tuple[float, float]:
    """Mean and population std of the column (Chan et al.'s pairwise update of count, mean, M2)."""
    count, mean, m2 = 0, 0.0, 0.0
    for shown in scan():
        values = _values(column, shown)
        if not len(values):
            continue
        n, batch_mean = len(values), float(values.mean())
        batch_m2 = float(np.square(values - batch_mean).sum())
        delta = batch_mean - mean
        total = count + n
        mean += delta * n / total
        m2 += batch_m2 + delta * delta * count * n / total
        count = total
    return mean, math.sqrt(m2 / count) if count else 0.0


class Scores:
    """Each row's score as an order-preserving uint64 key, pass after pass over the column."""

    def __init__(self, scan: Scan, layout: Layout, params: dict[str, Any]) -> None:
        self.scan, self.seed, self.column = scan, layout.seed, params["column"]
        self.strictness = params["strictness"]
        self.mean, self.std = moments(scan, self.column)
        if self.std < MIN_STD and self.strictness > 0:
            raise UserError(
                f"partitioner continuous: column {self.column!r} is nearly constant (std {self.std:.3g}), "
                "so there is nothing to sort by; name another column or set partition_strictness: 0"
            )

    def keys(self, shown: Mapping[str, np.ndarray], rng: np.random.Generator) -> np.ndarray:
        values = _values(self.column, shown)
        noise = rng.standard_normal(len(values))
        z = (values - self.mean) / self.std if self.std > 0 else np.zeros_like(values)
        scores = self.strictness * z + (1 - self.strictness) * noise + 0.0  # + 0.0: -0.0 becomes 0.0
        bits = scores.view(np.uint64)
        negative = bits >> np.uint64(63) == 1
        return np.where(negative, ~bits, bits | np.uint64(1 << 63))

    def passes(self) -> Iterator[np.ndarray]:
        rng = np.random.default_rng(self.seed)
        for shown in self.scan():
            yield self.keys(shown, rng)


def select(scores: Scores, cuts: list[int]) -> tuple[np.ndarray, np.ndarray]:
    """For each cut position c (0-based, in the stably sorted order), the key at c and the number of
    keys below it: a radix select, most significant digit first."""
    prefixes = np.zeros(len(cuts), dtype=np.uint64)
    below = np.zeros(len(cuts), dtype=np.int64)
    if not cuts:  # one rank: nothing to find
        return prefixes, below
    bins = 1 << DIGIT_BITS
    for shift in range(64 - DIGIT_BITS, -1, -DIGIT_BITS):
        active = np.unique(prefixes)
        histogram = np.zeros(len(active) * bins, dtype=np.int64)
        for keys in scores.passes():
            high = keys >> np.uint64(shift + DIGIT_BITS) if shift + DIGIT_BITS < 64 else np.zeros_like(keys)
            where = np.minimum(np.searchsorted(active, high), len(active) - 1)
            hit = active[where] == high
            digit = (keys[hit] >> np.uint64(shift)) & np.uint64(bins - 1)
            histogram += np.bincount(where[hit] * bins + digit.astype(np.int64), minlength=len(histogram))
        cumulative = histogram.reshape(len(active), bins).cumsum(axis=1)
        for k, cut in enumerate(cuts):
            row = cumulative[np.searchsorted(active, prefixes[k])]
            digit = int(np.searchsorted(row, cut - below[k], side="right"))
            below[k] += row[digit - 1] if digit else 0
            prefixes[k] = (prefixes[k] << np.uint64(DIGIT_BITS)) | np.uint64(digit)
    return prefixes, below


class _ContinuousDeal:
    """A row's rank: the cuts whose key is below its key, plus, for a key equal to a cut's, the cuts
    its stable position (keys below + earlier rows with that key) has reached."""

    def __init__(self, scores: Scores, cuts: list[int], keys: np.ndarray, below: np.ndarray) -> None:
        self.scores, self.rng = scores, np.random.default_rng(scores.seed)
        self.cut_keys, self.cuts, self.below = keys, np.array(cuts, dtype=np.int64), below
        self.seen: dict[int, int] = {}

    def __call__(self, num_rows: int, shown: Mapping[str, np.ndarray]) -> np.ndarray:
        keys = self.scores.keys(shown, self.rng)
        ranks = np.searchsorted(self.cut_keys, keys, side="left").astype(np.int64)
        tied = np.flatnonzero(np.searchsorted(self.cut_keys, keys, side="right") > ranks)
        # Rows whose score is exactly a cut's (repeated values at strictness 1): by input position.
        for key in np.unique(keys[tied]).tolist():
            rows = tied[keys[tied] == np.uint64(key)]
            same = np.flatnonzero(self.cut_keys == np.uint64(key))
            first = int(self.below[same[0]]) + self.seen.get(key, 0)
            self.seen[key] = self.seen.get(key, 0) + len(rows)
            positions = first + np.arange(len(rows))
            ranks[rows] += np.searchsorted(self.cuts[same], positions, side="right")
        return ranks


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    if layout.scan is None:
        raise ValueError("the continuous partitioner needs layout.scan (the partition stage gives it)")
    sizes = array_split_sizes(layout.num_rows, layout.world_size)
    require_min_rows("continuous", sizes, params["min_rows"], "use fewer ranks or lower partition_min_rows")
    scores = Scores(layout.scan, layout, params)
    cuts = np.cumsum(sizes)[:-1].tolist()
    keys, below = select(scores, cuts)
    return _ContinuousDeal(scores, cuts, keys, below)


def local(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    """Rank r's local test distribution: the test rows the same rule (params, seed) deals it, the test
    split scored and cut as the training split was. partition_min_rows is a training shard's floor, not
    part of the rule: a test split's runs need one row each."""
    return one_per_rank(layout.world_size, assign(layout, {}, {**params, "min_rows": 1}))
