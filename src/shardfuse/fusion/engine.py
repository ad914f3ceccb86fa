"""The merge stage's streaming engine: rank checkpoints in, merged tensors out, block by block.

No command line; used by :mod:`shardfuse.fusion.fuse` (the merge paths: inputs, checks, greedy soup)
and by bench/merge.py. Each tensor is cut into blocks of at most ``BLOCK_BYTES`` of float64 summed over
all inputs; a method's plan (``shardfuse.fusion.methods``) may scan the whole tensor first (by blocks, or
rank by rank), then combines block by block into the sink. Worker threads read and hash a few blocks
ahead of the consumer (each file's digest fed in file order, whichever worker read the bytes), so peak
memory is a few blocks whatever the number of ranks or the model size. A plain mean (uniform, greedy
soup, running statistics) is also merged in the workers, straight from the raw bytes
(:func:`mean_block`): on a small machine the math is as much CPU as reading and hashing, and both cores
share it (bench/RESULTS.md, merge). :func:`merge_arrays` runs the same plans on whole in-memory arrays
(the tests' reference).

Per tensor, by the rules of ``shardfuse.fusion.methods.registry``: a non-float tensor (a counter such as
BatchNorm's ``num_batches_tracked``) is a ``copy`` job: never decoded to float, its bytes are compared
with rank 0's and rank 0's are written, so an unequal counter stops the merge naming the tensor. A
float tensor named ``*.running_mean``/``*.running_var`` (BatchNorm's running statistics, recognised by
name: the engine sees a state dict, never a model) gets the plain (weighted, for weighted) mean's plan
from ``make_plan`` whatever the method, except consolidate, which keeps rank 0's after its check.

Parameters given per layer or per tensor (a gradient or a filter list: ``fusion.methods.settings``) are
resolved for every float tensor from the names in rank 0's header when the engine is made, before any
tensor is read; each tensor's plan gets its own values (and, where merge_weights vary, its own
normalised rank weights), and its statistics say which (``layer``, ``params``). Where every parameter is
one value the plans get ``params`` and ``weights`` as given, as they always did.
"""

from __future__ import annotations

import contextlib
import math
import queue
import resource
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np

from shardfuse.checkpoints.stream import (
    DType,
    SafetensorsReader,
    TensorInfo,
    all_finite,
    decode_float,
    decode_narrow,
    encode_float,
    to_torch,
)
from shardfuse.fusion.methods.plan import Plan, TensorJob
from shardfuse.fusion.methods.registry import (
    default_weights,
    make_plan,
    tensor_params,
    tensor_weights,
    uses_base,
)
from shardfuse.io import UserError

BLOCK_BYTES = 4 << 20  # float64 working set of one block, summed over all inputs
WORKERS = 2
PREFETCH_DEPTH = 3


def peak_rss_mb() -> float:
    """This process's peak resident memory (VmHWM), in MiB."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


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


class NonFiniteMerge(UserError):
    """A merged tensor holds inf or NaN: nothing is published (the caller discards what it staged)."""


class FiniteSink:
    """Passes each merged block on to ``sink`` after checking its values are finite (issue 54: nothing
    non-finite is ever published, whatever the inputs or the parameters)."""

    def __init__(self, sink, tensors: dict[str, TensorInfo], what: str) -> None:
        self.sink, self.tensors, self.what = sink, tensors, what

    def write(self, name: str, data) -> None:
        raw = data if isinstance(data, np.ndarray) else np.frombuffer(memoryview(data).cast("B"), np.uint8)
        if not all_finite(raw.view(np.uint8), self.tensors[name].dtype):
            raise NonFiniteMerge(
                f"merged tensor {name} holds inf or NaN ({self.what}); nothing was written: check the "
                "merge parameters for values that overflow (merge_scale, merge_weights) and every input "
                "checkpoint for inf/NaN"
            )
        self.sink.write(name, data)


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
        # Parameters given per layer or per tensor, resolved for every float tensor from the names in
        # rank 0's header, before any tensor is read; None where each parameter is one value.
        floats = [name for name, info in readers[0].tensors.items() if info.dtype.is_float]
        self.table = tensor_params(method, params, floats, self.num_ranks)

    def tensor_params(self, name: str) -> tuple[dict[str, Any], list[float] | None]:
        """The parameters and rank weights of tensor ``name``'s plan."""
        if self.table is None:
            return self.params, self.weights
        values = self.table.by_tensor[name]
        if "weights" not in self.table.varying:
            return values, self.weights
        return values, tensor_weights(self.method, values, self.weights)

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
            params, weights = self.tensor_params(name)
            plan = make_plan(self.method, params, TensorJob(name, info.numel, self.rank_numbers, weights))
            if plan.scan_order == "blocks":
                for start, count, last in self._blocks(info.numel):
                    yield Job("scan", name, plan, start, count, with_base, end_scan=last)
            elif plan.scan_order == "ranks":
                reads_base = with_base[self.num_ranks :]
                for index in ranks:
                    for scan in range(plan.scan_passes):
                        final = index == ranks[-1] and scan == plan.scan_passes - 1
                        for start, count, last in self._blocks(info.numel):
                            reads = [index, *reads_base]
                            yield Job(
                                "scan_rank", name, plan, start, count, reads, index, last, last and final
                            )
            for start, count, last in self._blocks(info.numel):
                yield Job("combine", name, plan, start, count, with_base, end_tensor=last)

    def _load(
        self, job: Job, index: int, slot: Slot, turns: HashTurns, scratches: queue.SimpleQueue
    ) -> tuple[list[np.ndarray], tuple[np.ndarray, float] | None]:
        """In a worker: read ``job`` (the ``index``-th) into ``slot``, hash its bytes in turn, and merge
        them when its plan is a plain mean (with a scratch set from ``scratches``, one per worker).
        Returns the raw bytes of each input (in ``job.reads`` order) and, for a plain mean, the merged
        block's bytes (in ``slot.out``) and the spread between the ranks."""
        infos = [self.inputs[i].tensors[job.name] for i in job.reads]  # offsets differ between files
        views = [
            self.inputs[i].read_into(info, job.start, job.count, buffer, extend_hash=False)
            for i, info, buffer in zip(job.reads, infos, slot.raw, strict=False)
        ]
        with turns.turn(index):
            for i, info, view in zip(job.reads, infos, views, strict=True):
                self.inputs[i].extend_hash(info, job.start, view)
        if job.kind != "combine" or not job.plan.plain_mean:
            return views, None
        scratch = scratches.get()
        try:
            return views, mean_block(views[: self.num_ranks], infos[0].dtype, slot.out, scratch)
        finally:
            scratches.put(scratch)

    def _prepared(
        self, jobs: Iterator[Job]
    ) -> Iterator[tuple[Job, list[np.ndarray], tuple[np.ndarray, float] | None]]:
        """``jobs`` in order, each with what :meth:`_load` made of it in one of WORKERS threads, up to
        PREFETCH_DEPTH jobs ahead of the consumer.

        Job k uses slot k mod (depth + 1): when job k + depth is submitted the consumer has finished
        job k - 1, the last user of that slot. Closing the generator stops the workers (none is left
        waiting for a turn that will not come)."""
        slots = [Slot(len(self.inputs), self.block_elems) for _ in range(PREFETCH_DEPTH + 1)]
        scratches: queue.SimpleQueue = queue.SimpleQueue()
        for _ in range(WORKERS):
            scratches.put(MeanScratch(self.num_ranks, self.block_elems))
        turns = HashTurns()
        pending: deque = deque()
        submitted = 0
        with ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="shardfuse-merge") as pool:

            def submit() -> None:
                nonlocal submitted
                job = next(jobs, None)
                if job is not None:
                    slot = slots[submitted % len(slots)]
                    pending.append((job, pool.submit(self._load, job, submitted, slot, turns, scratches)))
                    submitted += 1

            try:
                for _ in range(PREFETCH_DEPTH):
                    submit()
                while pending:
                    job, future = pending.popleft()
                    yield job, *future.result()
                    submit()
            finally:
                turns.stop()
                for _, future in pending:
                    future.cancel()

    def run(
        self, names: list[str], sink, progress: Callable[[int], None] | None = None
    ) -> dict[str, dict[str, Any]]:
        """Merge ``names`` in this order into ``sink`` (anything with ``write(name, bytes)``); a block
        with inf or NaN stops the merge (:class:`NonFiniteMerge`). ``progress(n)``: n more elements
        written (shardfuse.console.progress)."""
        sink = FiniteSink(sink, self.inputs[0].tensors, f"method {self.method}, {_described(self.params)}")
        scratch = [np.empty(self.block_elems) for _ in self.inputs]  # plans other than a plain mean
        out = np.empty(self.block_elems * 8, dtype=np.uint8)
        stats: dict[str, dict[str, Any]] = {}
        with contextlib.closing(self._prepared(self.schedule(names))) as prepared:
            for job, views, merged in prepared:
                info = self.inputs[0].tensors[job.name]
                if job.kind == "copy":
                    for index, view in enumerate(views[1:], start=1):
                        if not np.array_equal(view, views[0]):
                            raise copy_rule_error(job.name, info.dtype.name, self.rank_numbers[index])
                    sink.write(job.name, views[0])
                    if progress is not None:
                        progress(job.count)
                    if job.end_tensor:
                        stats[job.name] = {"max_abs_diff": 0.0, "copied_from_rank": self.rank_numbers[0]}
                    continue
                plan = job.plan
                if merged is not None:
                    data, spread = merged
                    record_spread(plan, spread)
                    sink.write(job.name, data)
                else:
                    self._compute(job, info, views, scratch, out, sink)
                if progress is not None and job.kind == "combine":
                    progress(job.count)
                if job.end_scan:
                    plan.end_scan()
                if job.end_tensor:
                    stats[job.name] = tensor_stats(plan)
                    if self.table is not None:
                        stats[job.name].update(self.table.recorded(job.name))
        return stats

    def _compute(
        self, job: Job, info: TensorInfo, views: list[np.ndarray], scratch: list[np.ndarray], out, sink
    ) -> None:
        """A scan or combine step of any plan, in the consumer, on the inputs decoded to float64."""
        values = [decode_float(view, info.dtype, into) for view, into in zip(views, scratch, strict=False)]
        plan = job.plan
        if job.kind == "scan_rank":
            plan.scan_rank(job.rank_index, job.start, values[0], values[1] if len(values) > 1 else None)
            if job.end_rank:
                plan.end_rank(job.rank_index)
            return
        blocks = values[: self.num_ranks]
        base = values[self.num_ranks] if len(values) > self.num_ranks else None
        if job.kind == "scan":
            plan.scan_blocks(job.start, blocks, base)
        else:
            sink.write(job.name, encode_float(merge_block(plan, job.start, blocks, base), info.dtype, out))


class Slot:
    """The buffers of one job in flight: each input's raw bytes, and a plain mean's merged bytes."""

    def __init__(self, num_inputs: int, block_elems: int) -> None:
        nbytes = block_elems * 8  # of the widest dtype; the pages a block does not fill stay unallocated
        self.raw = [np.empty(nbytes, dtype=np.uint8) for _ in range(num_inputs)]
        self.out = np.empty(nbytes, dtype=np.uint8)


class MeanScratch:
    """One worker's scratch for :func:`mean_block`: float32 copies of F16/BF16 inputs, the running max
    and min over ranks, and the float64 sum (first the spread's differences)."""

    def __init__(self, num_ranks: int, block_elems: int) -> None:
        self.narrow = [np.empty(block_elems * 4, dtype=np.uint8) for _ in range(num_ranks)]
        self.high = np.empty(block_elems * 8, dtype=np.uint8)
        self.low = np.empty(block_elems * 8, dtype=np.uint8)
        self.total = np.empty(block_elems)


class HashTurns:
    """Makes the workers hash jobs in schedule order, whichever worker read which: job k hashes its
    bytes once job k - 1 has, so every file's digest is fed in file order, as with a single reader."""

    def __init__(self) -> None:
        self._hashed = 0  # jobs whose turn is over
        self._stopped = False
        self._changed = threading.Condition()

    @contextlib.contextmanager
    def turn(self, index: int) -> Iterator[None]:
        with self._changed:
            self._changed.wait_for(lambda: self._hashed == index or self._stopped)
            if self._stopped:
                raise RuntimeError("the merge stopped before this block's turn to hash")
        try:
            yield
        finally:
            with self._changed:
                self._hashed = index + 1
                self._changed.notify_all()

    def stop(self) -> None:
        """Release the workers still waiting (the consumer failed, or is done)."""
        with self._changed:
            self._stopped = True
            self._changed.notify_all()


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


def record_spread(plan: Plan, spread: float) -> None:
    """Fold one block's spread between the ranks into ``plan``'s statistics, and let the plan check it."""
    plan.max_abs_diff = max(plan.max_abs_diff, spread)
    plan.check(spread)


def merge_block(plan: Plan, start: int, blocks: list[np.ndarray], base: np.ndarray | None) -> np.ndarray:
    """One block of the merged tensor; records the spread between ranks before combine reuses blocks."""
    record_spread(plan, max_abs_diff(blocks))
    return plan.combine(start, blocks, base)


def mean_block(
    views: list[np.ndarray], dtype: DType, out: np.ndarray, scratch: MeanScratch
) -> tuple[np.ndarray, float]:
    """The plain mean of the rank blocks ``views`` (raw bytes of ``dtype``) encoded to ``dtype`` in the
    uint8 buffer ``out``, and the spread between them: bit for bit what decoding to float64,
    :func:`merge_block` and the uniform plan give, in fewer passes over half the bytes (F32).

    The sum runs in float64 in rank order, numpy widening each input as it adds it (decode_narrow); the
    spread comes from the elementwise max and min over ranks 1.., which round nothing, set against rank
    0 (:func:`spread_from_extremes`)."""
    values = [decode_narrow(view, dtype, into) for view, into in zip(views, scratch.narrow, strict=False)]
    spread = spread_from_extremes(values, scratch)
    total = scratch.total[: len(values[0])]
    if len(values) == 1:
        np.copyto(total, values[0])
    else:
        np.add(values[0], values[1], out=total, dtype=np.float64)
        for value in values[2:]:
            np.add(total, value, out=total)
    total /= len(values)
    return encode_float(total, dtype, out), spread


def spread_from_extremes(values: list[np.ndarray], scratch: MeanScratch) -> float:
    """:func:`max_abs_diff` of float32 or float64 ``values``, from their elementwise max and min.

    Rounding is monotone, so max_i fl(x_i - x_0) = fl(max_i x_i - x_0) and likewise for the min: two
    float64 subtractions (into ``scratch.total``) instead of one per rank. A NaN on the way (a NaN input,
    or inf - inf) sends the block to max_abs_diff itself, whose NaN rules this does not repeat."""
    first, others = values[0], values[1:]
    if not others or not len(first):
        return 0.0
    high = low = others[0]
    if len(others) > 1:
        nbytes = first.nbytes
        high = np.maximum(others[0], others[1], out=scratch.high[:nbytes].view(first.dtype))
        low = np.minimum(others[0], others[1], out=scratch.low[:nbytes].view(first.dtype))
        for value in others[2:]:
            np.maximum(high, value, out=high)
            np.minimum(low, value, out=low)
    diff = scratch.total[: len(first)]
    up = float(np.subtract(high, first, out=diff, dtype=np.float64).max())
    down = float(np.subtract(first, low, out=diff, dtype=np.float64).max())
    if math.isnan(up) or math.isnan(down):
        return max_abs_diff([value.astype(np.float64) for value in values])
    return max(0.0, up, down)


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

    ``params`` come from ``resolve_params``; ``weights`` the rank weights the method reads (``rank_weights``;
    default: equal)."""
    dtype, shape = arrays[0].dtype, arrays[0].shape
    if dtype.kind != "f":
        for rank, array in enumerate(arrays[1:], start=1):
            if not np.array_equal(array.view(np.uint8), arrays[0].view(np.uint8)):
                raise copy_rule_error(name, str(dtype), rank)
        return arrays[0].copy(), {"max_abs_diff": 0.0, "copied_from_rank": 0}
    if uses_base(method) and base is None:
        raise ValueError(f"{method} needs the base tensor")
    weights = default_weights(method, len(arrays), weights)
    job = TensorJob(name, int(arrays[0].size), list(range(len(arrays))), weights)
    plan = make_plan(method, params, job)
    base64 = None if base is None else np.asarray(base, dtype=np.float64).ravel()

    def fresh() -> list[np.ndarray]:
        return [np.asarray(a, dtype=np.float64).ravel().copy() for a in arrays]

    if plan.scan_order == "blocks":
        plan.scan_blocks(0, fresh(), base64)
    elif plan.scan_order == "ranks":
        for index in range(len(arrays)):
            for _ in range(plan.scan_passes):
                plan.scan_rank(index, 0, np.asarray(arrays[index], dtype=np.float64).ravel().copy(), base64)
                plan.end_rank(index)
    if plan.scan_order:
        plan.end_scan()
    merged = merge_block(plan, 0, fresh(), base64)
    return merged.astype(dtype).reshape(shape), tensor_stats(plan)


def _described(params: dict[str, Any]) -> str:
    """A merge's parameters in one short phrase for an error line."""
    shown = {k: v for k, v in params.items() if v is not None}
    text = ", ".join(f"{k}={v}" for k, v in shown.items()) or "no parameters"
    return text if len(text) <= 200 else text[:197] + "..."
