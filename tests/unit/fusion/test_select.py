"""The streamed order statistics behind TIES and breadcrumbs (fusion.methods.select) give exactly what
partitioning the whole array gives, from blocks of any size, while holding a few per cent of it."""

from __future__ import annotations

import numpy as np
import pytest

from shardfuse.fusion.methods.select import StreamedRanks


def streamed(values: np.ndarray, positions: list[int], block: int) -> StreamedRanks:
    ranks = StreamedRanks(positions)
    for _ in range(2):
        for start in range(0, len(values), block):
            ranks.add(values[start : start + block].copy())
        done = ranks.end_pass()
    assert done
    return ranks


def expected(values: np.ndarray, position: int) -> tuple[float, int, int]:
    value = float(np.sort(values)[position])
    return value, int(np.count_nonzero(values < value)), int(np.count_nonzero(values == value))


MAGNITUDES = {
    "normal": lambda rng, n: np.abs(rng.normal(size=n)),
    "float32 rounded, many equal": lambda rng, n: np.abs(rng.normal(size=n).astype(np.float16)).astype(
        np.float64
    ),
    "half zeros": lambda rng, n: np.abs(rng.normal(size=n)) * (rng.random(n) < 0.5),
    "all equal": lambda rng, n: np.full(n, 0.25),
    "wide exponents and subnormals": lambda rng, n: (
        np.abs(rng.normal(size=n)) * 10.0 ** rng.integers(-320, 300, n)
    ),
    "a few distinct": lambda rng, n: rng.integers(0, 4, n).astype(np.float64) / 3,
}


@pytest.mark.parametrize("kind", list(MAGNITUDES))
@pytest.mark.parametrize("block", [1, 7, 1000, 10**6])
def test_values_and_counts_equal_a_whole_array_partition(kind, block):
    rng = np.random.default_rng(len(kind) * 31 + block)
    values = MAGNITUDES[kind](rng, 5003)
    positions = [0, 1, 2500, 4999, 5002, int(rng.integers(0, 5003))]
    ranks = streamed(values, positions, block)
    assert ranks.results == [expected(values, p) for p in positions]


def test_candidates_are_a_small_part_of_smooth_magnitudes():
    values = np.abs(np.random.default_rng(0).normal(size=1 << 20))
    ranks = StreamedRanks([len(values) // 2])
    ranks.add(values)
    ranks.end_pass()
    ranks.add(values)
    held = sum(len(part) for parts in ranks.candidates.values() for part in parts)
    assert held < len(values) / 20, held  # against the whole rank the scan held before
    assert ranks.end_pass() and ranks.results == [expected(values, len(values) // 2)]


def test_a_position_outside_the_array_is_refused():
    ranks = StreamedRanks([10])
    ranks.add(np.ones(10))
    with pytest.raises(ValueError, match=r"outside 0\.\.9"):
        ranks.end_pass()
