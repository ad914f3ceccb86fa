"""The iid partitioner: every rank gets a seeded uniformly random share of the rows, shard sizes
differing by at most one row (the first N % W ranks get the extra row), or exactly N // W each with
drop_remainder. It reads no column, so the stage makes no counting pass.

The assignment is drawn block by block from numpy's Generator(seed), in O(block) memory; these bytes
are the shard sets every run had before partitioners existed (its record adds nothing to their names).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import numpy as np

from shardfuse.data.partitioners.assignment import Deal, Layout, ValueCounts

# The assignment is drawn in blocks of this many rows. A constant, not a knob: it decides the random
# stream, so changing it changes which rank gets which row.
ASSIGNMENT_BLOCK_ROWS = 1 << 20


def shard_sizes(num_rows: int, world_size: int, drop_remainder: bool) -> list[int]:
    """Rows per rank: N // W each, plus one for the first N % W ranks unless the remainder is dropped."""
    base, remainder = divmod(num_rows, world_size)
    if drop_remainder:
        return [base] * world_size
    return [base + 1 if rank < remainder else base for rank in range(world_size)]


def iter_rank_assignment(
    num_rows: int, world_size: int, seed: int, drop_remainder: bool, block_rows: int = ASSIGNMENT_BLOCK_ROWS
) -> Iterator[np.ndarray]:
    """The rank of every input row (value ``world_size`` marks a dropped row), block by block, in the
    smallest integer dtype that fits: a seeded uniformly random arrangement of the shard sizes in
    O(block) memory (:func:`iter_sized_assignment`)."""
    sizes = shard_sizes(num_rows, world_size, drop_remainder)
    return iter_sized_assignment(sizes, num_rows, seed, block_rows)


def iter_sized_assignment(
    sizes: list[int], num_rows: int, seed: int, block_rows: int = ASSIGNMENT_BLOCK_ROWS
) -> Iterator[np.ndarray]:
    """A seeded uniformly random arrangement of ``sizes[r]`` rows of each rank r among ``num_rows``
    rows (the rest dropped: rank ``len(sizes)``), block by block. Each block's rank counts are a
    multivariate hypergeometric draw from the rows still unassigned, then the block is shuffled:
    together exactly a shuffle of the whole assignment."""
    world_size = len(sizes)
    remaining = np.array([*sizes, num_rows - sum(sizes)], dtype=np.int64)
    dtype = np.min_scalar_type(world_size)
    ranks = np.arange(world_size + 1, dtype=dtype)
    rng = np.random.default_rng(seed)
    for start in range(0, num_rows, block_rows):
        take = min(block_rows, num_rows - start)
        counts = (
            remaining
            if take == remaining.sum()
            else rng.multivariate_hypergeometric(remaining, take, method="marginals")
        )
        remaining = remaining - counts
        block = np.repeat(ranks, counts)
        rng.shuffle(block)
        yield block


def rank_assignment(
    num_rows: int, world_size: int, seed: int, drop_remainder: bool, block_rows: int = ASSIGNMENT_BLOCK_ROWS
) -> np.ndarray:
    """The whole assignment of :func:`iter_rank_assignment` as one array (for tests and small inputs)."""
    blocks = list(iter_rank_assignment(num_rows, world_size, seed, drop_remainder, block_rows))
    return np.concatenate(blocks) if blocks else np.empty(0, dtype=np.min_scalar_type(world_size))


class AssignmentReader:
    """Hands out the next ``n`` assignments, whatever the read batches and assignment blocks are."""

    def __init__(self, blocks: Iterator[np.ndarray]) -> None:
        self.blocks = blocks
        self.current = np.empty(0, dtype=np.uint8)
        self.position = 0

    def take(self, n: int) -> np.ndarray:
        parts = []
        while n:
            if self.position == len(self.current):
                self.current, self.position = next(self.blocks), 0
            part = self.current[self.position : self.position + n]
            self.position += len(part)
            n -= len(part)
            parts.append(part)
        if len(parts) == 1:
            return parts[0]
        return np.concatenate(parts) if parts else self.current[:0]


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    """The iid deal: the next rows' share of the seeded assignment (no column read)."""
    reader = AssignmentReader(
        iter_rank_assignment(layout.num_rows, layout.world_size, layout.seed, layout.drop_remainder)
    )
    return lambda num_rows, columns: reader.take(num_rows)
