"""The merge stage's streaming engine: rank checkpoints in, merged tensors out, block by block.

No command line; used by :mod:`shardfuse.merge` (the stage: inputs, checks, greedy soup, merge.json)
and by bench/merge.py. Each tensor is cut into blocks of at most ``BLOCK_BYTES`` of float64 summed over
all inputs; a method's plan (``shardfuse.merge_methods``) may scan the whole tensor first (by blocks, or
rank by rank), then combines block by block into the sink. Reader threads read (and hash) a few blocks
ahead of the math, so peak memory is a few blocks whatever the number of ranks or the model size.
:func:`merge_arrays` runs the same plans on whole in-memory arrays (the tests' reference).

Per tensor, by the rules of ``shardfuse.merge_methods``: a non-float tensor (a counter such as
BatchNorm's ``num_batches_tracked``) is a ``copy`` job: never decoded to float, its bytes are compared
with rank 0's and rank 0's are written, so an unequal counter stops the merge naming the tensor. A
float tensor named ``*.running_mean``/``*.running_var`` (BatchNorm's running statistics, recognised by
name: the engine sees a state dict, never a model) gets the plain (weighted, for weighted) mean's plan
from ``make_plan`` whatever the method, except consolidate, which keeps rank 0's after its check.
"""

from __future__ import annotations

import contextlib
import math
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardfuse.io import UserError
from shardfuse.merge_methods import USES_BASE, Plan, TensorJob, make_plan
from shardfuse.safetensors_stream import SafetensorsReader, TensorInfo, decode_float, encode_float, to_torch

BLOCK_BYTES = 4 << 20  # float64 working set of one block, summed over all inputs
PREFETCH_DEPTH = 2  # blocks read ahead by the worker threads
READ_LANES = 2  # reader threads: hashing the inputs costs about as much CPU as the math (bench/merge.py)


@dataclass
class Job:
    kind: str  # copy | scan | scan_rank | combine
    name: str
    plan: Plan | None
    start: int
    count: int
    reads: list[int]  # indices into Engine.inputs
    rank_index: int = 0
    end_rank: bool = False
    end_scan: bool = False
    end_tensor: bool = False


class MemorySink:
    """Collects the merged bytes in memory (greedy soup scores candidates without writing them)."""

    def __init__(self, tensors: dict[str, TensorInfo]) -> None:
        self.tensors = tensors
        self.buffers = {name: np.empty(info.nbytes, dtype=np.uint8) for name, info in tensors.items()}
        self.filled = dict.fromkeys(tensors, 0)

    def write(self, name: str, data: np.ndarray) -> None:
        start = self.filled[name]
        self.buffers[name][start : start + len(data)] = data
        self.filled[name] = start + len(data)

    def tensors_for_torch(self) -> dict[str, Any]:
        return {
            name: to_torch(self.buffers[name].view(info.dtype.holder).reshape(info.shape), info.dtype)
            for name, info in self.tensors.items()
        }


class Engine:
    """Merge ``readers`` (one per rank, in rank order) tensor by tensor, block by block."""

    def __init__(
        self,
        readers: list[SafetensorsReader],
        base: SafetensorsReader | None,
        method: str,
        params: dict[str, Any],
        rank_numbers: list[int],
        weights: list[float] | None = None,
        block_bytes: int = BLOCK_BYTES,
    ) -> None:
        self.inputs = readers + ([base] if base is not None else [])
        self.num_ranks = len(readers)
        self.method, self.params, self.weights = method, params, weights
        self.rank_numbers = rank_numbers
        self.block_elems = max(1, block_bytes // (8 * len(self.inputs)))

    def _blocks(self, numel: int) -> Iterator[tuple[int, int, bool]]:
        if numel == 0:
            yield 0, 0, True
        for start in range(0, numel, self.block_elems):
            count = min(self.block_elems, numel - start)
            yield start, count, start + count == numel

    def schedule(self, names: list[str]) -> Iterator[Job]:
        ranks = list(range(self.num_ranks))
        with_base = ranks + ([self.num_ranks] if len(self.inputs) > self.num_ranks else [])
        for name in names:
            info = self.inputs[0].tensors[name]
            if not info.dtype.is_float:
                for start, count, last in self._blocks(info.numel):
                    yield Job("copy", name, None, start, count, ranks, end_tensor=last)
                continue
            job = TensorJob(name, info.numel, self.rank_numbers, self.weights)
            plan = make_plan(self.method, self.params, job)
            if plan.scan_order == "blocks":
                for start, count, last in self._blocks(info.numel):
                    yield Job("scan", name, plan, start, count, with_base, end_scan=last)
            elif plan.scan_order == "ranks":
                for index in ranks:
                    for start, count, last in self._blocks(info.numel):
                        reads = [index, *with_base[self.num_ranks :]]
                        end_scan = last and index == ranks[-1]
                        yield Job("scan_rank", name, plan, start, count, reads, index, last, end_scan)
            for start, count, last in self._blocks(info.numel):
                yield Job("combine", name, plan, start, count, with_base, end_tensor=last)

    def _read(self, job: Job, lane: int, buffers: list[np.ndarray]) -> list[tuple[int, np.ndarray]]:
        """Read the inputs of ``job`` that belong to ``lane``; (position in job.reads, bytes) pairs."""
        return [
            (
                position,
                self.inputs[index].read_into(
                    self.inputs[index].tensors[job.name], job.start, job.count, buffers[position]
                ),
            )
            for position, index in enumerate(job.reads)
            if index % READ_LANES == lane
        ]

    def _prefetched(self, jobs: Iterator[Job]) -> Iterator[tuple[Job, list[np.ndarray]]]:
        """Jobs with their raw bytes, read (and hashed) by READ_LANES worker threads, up to PREFETCH_DEPTH
        jobs ahead of the math.

        Input i always goes to lane i mod READ_LANES, a single thread, so each file is read in order:
        that is what lets the readers hash as they go. Job k reads into buffer set k mod (depth + 1):
        when job k + depth is submitted the consumer has finished job k - 1, the last user of that set."""
        slots = [
            [np.empty(self.block_elems * 8, dtype=np.uint8) for _ in self.inputs]
            for _ in range(PREFETCH_DEPTH + 1)
        ]
        pending: deque = deque()
        submitted = 0
        with contextlib.ExitStack() as stack:
            lanes = [
                stack.enter_context(
                    ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"shardfuse-read{i}")
                )
                for i in range(READ_LANES)
            ]

            def submit() -> None:
                nonlocal submitted
                job = next(jobs, None)
                if job is not None:
                    slot = slots[submitted % len(slots)]
                    pending.append(
                        (job, [lane.submit(self._read, job, i, slot) for i, lane in enumerate(lanes)])
                    )
                    submitted += 1

            try:
                for _ in range(PREFETCH_DEPTH):
                    submit()
                while pending:
                    job, futures = pending.popleft()
                    views: list[np.ndarray] = [None] * len(job.reads)  # type: ignore[list-item]
                    for future in futures:
                        for position, view in future.result():
                            views[position] = view
                    yield job, views
                    submit()
            finally:
                for _, futures in pending:
                    for future in futures:
                        future.cancel()

    def run(self, names: list[str], sink) -> dict[str, dict[str, Any]]:
        """Merge ``names`` in this order into ``sink`` (anything with ``write(name, bytes)``)."""
        scratch = [np.empty(self.block_elems) for _ in self.inputs]
        out = np.empty(self.block_elems * 8, dtype=np.uint8)
        stats: dict[str, dict[str, Any]] = {}
        for job, views in self._prefetched(self.schedule(names)):
            info = self.inputs[0].tensors[job.name]
            if job.kind == "copy":
                for index, view in enumerate(views[1:], start=1):
                    if not np.array_equal(view, views[0]):
                        raise copy_rule_error(job.name, info.dtype.name, self.rank_numbers[index])
                sink.write(job.name, views[0])
                if job.end_tensor:
                    stats[job.name] = {"max_abs_diff": 0.0, "copied_from_rank": self.rank_numbers[0]}
                continue
            values = [
                decode_float(view, info.dtype, buffer) for view, buffer in zip(views, scratch, strict=False)
            ]
            plan = job.plan
            if job.kind == "scan_rank":
                plan.scan_rank(job.rank_index, job.start, values[0], values[1] if len(values) > 1 else None)
                if job.end_rank:
                    plan.end_rank(job.rank_index)
            else:
                blocks, base = (
                    values[: self.num_ranks],
                    (values[self.num_ranks] if len(values) > self.num_ranks else None),
                )
                if job.kind == "scan":
                    plan.scan_blocks(job.start, blocks, base)
                else:
                    sink.write(
                        job.name, encode_float(merge_block(plan, job.start, blocks, base), info.dtype, out)
                    )
            if job.end_scan:
                plan.end_scan()
            if job.end_tensor:
                stats[job.name] = tensor_stats(plan)
        return stats


# ---------------------------------------------------------------- running a plan


def max_abs_diff(blocks: list[np.ndarray]) -> float:
    """max |block_i - block_0| over all i; NaN == NaN, a NaN against a number counts as inf."""
    worst = 0.0
    if len(blocks) < 2 or not len(blocks[0]):
        return worst
    first, diff = blocks[0], np.empty_like(blocks[0])
    for other in blocks[1:]:
        np.subtract(other, first, out=diff)
        spread = max(float(diff.max()), -float(diff.min()))
        if math.isnan(spread):
            if np.any(np.isnan(other) != np.isnan(first)):
                return math.inf
            spread = float(np.fmax.reduce(np.abs(diff)))  # fmax skips the NaN - NaN entries
            spread = 0.0 if math.isnan(spread) else spread
        worst = max(worst, spread)
    return worst


def merge_block(plan: Plan, start: int, blocks: list[np.ndarray], base: np.ndarray | None) -> np.ndarray:
    """One block of the merged tensor; records the spread between ranks before combine reuses blocks."""
    spread = max_abs_diff(blocks)
    plan.max_abs_diff = max(plan.max_abs_diff, spread)
    plan.check(spread)
    return plan.combine(start, blocks, base)


def tensor_stats(plan: Plan) -> dict[str, Any]:
    return {"max_abs_diff": plan.max_abs_diff, **plan.stats}


def copy_rule_error(name: str, dtype: str, rank: int) -> UserError:
    return UserError(
        f"tensor {name!r} ({dtype}) differs between rank 0 and rank {rank}; integer/bool tensors "
        "(counters such as BatchNorm's num_batches_tracked, masks, indices) have no meaningful mean, so "
        "they are copied from rank 0 and must be identical across ranks — make them equal before merging"
    )


def merge_arrays(
    method: str,
    params: dict[str, Any],
    arrays: list[np.ndarray],
    base: np.ndarray | None = None,
    name: str = "tensor",
    weights: list[float] | None = None,
) -> tuple[np.ndarray, dict[str, Any]]:
    """Merge one tensor held in memory (numpy float16/32/64 merged in float64; other dtypes copied).

    ``params`` come from ``resolve_params``; ``weights`` are weighted's (default: equal)."""
    dtype, shape = arrays[0].dtype, arrays[0].shape
    if dtype.kind != "f":
        for rank, array in enumerate(arrays[1:], start=1):
            if not np.array_equal(array.view(np.uint8), arrays[0].view(np.uint8)):
                raise copy_rule_error(name, str(dtype), rank)
        return arrays[0].copy(), {"max_abs_diff": 0.0, "copied_from_rank": 0}
    if method in USES_BASE and base is None:
        raise ValueError(f"{method} needs the base tensor")
    if method == "weighted" and weights is None:
        weights = [1.0 / len(arrays)] * len(arrays)
    job = TensorJob(name, int(arrays[0].size), list(range(len(arrays))), weights)
    plan = make_plan(method, params, job)
    base64 = None if base is None else np.asarray(base, dtype=np.float64).ravel()

    def fresh() -> list[np.ndarray]:
        return [np.asarray(a, dtype=np.float64).ravel().copy() for a in arrays]

    if plan.scan_order == "blocks":
        plan.scan_blocks(0, fresh(), base64)
    elif plan.scan_order == "ranks":
        for index, block in enumerate(fresh()):
            plan.scan_rank(index, 0, block, base64)
            plan.end_rank(index)
    if plan.scan_order:
        plan.end_scan()
    merged = merge_block(plan, 0, fresh(), base64)
    return merged.astype(dtype).reshape(shape), tensor_stats(plan)
