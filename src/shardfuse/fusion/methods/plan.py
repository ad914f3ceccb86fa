"""What every merge method is made of: its parameters (``Param``) and its per-tensor ``Plan``.

The methods themselves are in the family modules beside this one (linear, sparse, spherical) and
are listed, with their parameters, in :mod:`shardfuse.fusion.methods.registry`.

theta_i is rank i's tensor (i = 0..N-1), base the run's shared initial weights (train's
base.safetensors, saved before the first step), tau_i = theta_i - base its task vector, n = numel.

Where a method is mergekit's: every method works on the flattened tensor (the engine sees no shape):
where mergekit works row by row (della's ranking, nuslerp by default) we match its whole-tensor case
(a 1-D tensor; nuslerp_flatten: true). Defaults are mergekit 0.1.5's, so density 1 means no
sparsification (mergekit returns the task vector unchanged there, ignoring gamma/epsilon). Our mean
convention (task_arithmetic's): base + scale * mean; mergekit's unnormalised sum with weight w per model
is scale = w * N.

Dtype rule: float tensors (F16, BF16, F32, F64) are merged in float64 and cast back to their own dtype.
Integer/bool tensors (and any dtype without arithmetic here: 8-bit floats, complex) never see float
math: they are copied from rank 0 bit for bit and must be identical across ranks, else error: a counter
(BatchNorm's num_batches_tracked) or an index has no meaningful mean.
Running statistics rule: a float tensor whose name ends in ``running_mean`` or ``running_var``
(``is_running_statistic``: BatchNorm's buffers, found by name since merging builds no model) is a
statistic of activations, not a weight. Every method fuses it by the plain mean of the ranks (weighted:
the weighted mean; greedy_soup: the mean of the selected ranks), never trimmed, dropped, scaled,
pulled to the base or slerped; consolidate keeps rank 0's after its tolerance check, as for weights.
The mean of the variances is not the pooled variance (it leaves out the spread of the ranks' means);
re-estimating the statistics on data is the exact fix, and beyond a merge.
Tied weights: the built-in transformer stores its tied embedding/read-out matrix once, so every method
sees it once. Optimiser state is never merged: a rank checkpoint holds the model's state_dict only.

Each method is a per-tensor plan: an optional scan of the whole tensor (TIES thresholds, the slerp
angle, model_stock cosines), then ``combine``, which maps one block of each rank to one block of the
merged tensor. The engine streams blocks; ``merge_arrays`` runs the same plan on whole arrays.

Streaming: every spherical method is a linear combination of the ranks whose coefficients follow from
the Gram matrix <theta_i, theta_j>, summed in one scan by blocks (O(N^2) memory). breadcrumbs keeps
two thresholds per rank and TIES one (a scan rank by rank, two passes: fusion.methods.select finds the
exact thresholds from per-bucket counts and the entries of one bucket, not one rank's whole |tau|).
della needs each entry's rank: it holds an int32/int64 rank per entry of every rank for the tensor
being merged. sce with topk < 1 holds the variance and every rank's squared task vector of that tensor
(the weights are means over the selected entries, known only after the whole scan).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

SLERP_PARALLEL_COS = 0.9995  # above this |cos| slerp falls back to lerp (sin(theta) is too small)
RUNNING_STATISTICS = ("running_mean", "running_var")  # name suffixes; see is_running_statistic


@dataclass(frozen=True)
class Param:
    default: Any
    kind: str  # number | integer | boolean | weights
    describe: str
    accept: Callable[[Any], bool] = lambda value: True


SCALE = Param(1.0, "number", "a number > 0", lambda v: v > 0)
UNIT_DENSITY = Param(1.0, "number", "a number in (0, 1]", lambda v: 0 < v <= 1)
WEIGHTS = Param(None, "weights", "a list of positive numbers, one per rank, or null")


@dataclass
class TensorJob:
    """What a plan knows about the tensor it merges."""

    name: str
    numel: int
    ranks: list[int]  # rank numbers of the inputs, in input order (DARE seeds its streams by them)
    weights: list[float] | None = None


@dataclass
class Plan:
    job: TensorJob
    params: dict[str, Any]
    scan_order: str | None = None  # None, "blocks" (all ranks per block) or "ranks" (rank by rank)
    max_abs_diff: float = 0.0
    stats: dict[str, Any] = field(default_factory=dict)
    # True for a plan whose combine is the plain mean of the rank blocks and nothing else: the engine
    # then merges its blocks in its worker threads, from the raw bytes (merge_engine.mean_block), bit for
    # bit as combine would.
    plain_mean: ClassVar[bool] = False
    # How many times a "ranks" scan sees each rank's blocks, in the same order; end_rank closes each pass.
    scan_passes: ClassVar[int] = 1

    def __post_init__(self) -> None:
        pass

    def scan_blocks(self, start: int, blocks: list[np.ndarray], base: np.ndarray | None) -> None:
        raise NotImplementedError

    def scan_rank(self, index: int, start: int, block: np.ndarray, base: np.ndarray | None) -> None:
        raise NotImplementedError

    def end_rank(self, index: int) -> None:
        pass

    def end_scan(self) -> None:
        pass

    def check(self, spread: float) -> None:
        pass

    def combine(self, start: int, blocks: list[np.ndarray], base: np.ndarray | None) -> np.ndarray:
        """The merged block. ``blocks`` are float64 scratch arrays the plan may overwrite."""
        raise NotImplementedError


def _mean(blocks: list[np.ndarray]) -> np.ndarray:
    total = blocks[0]
    for block in blocks[1:]:
        total += block
    total /= len(blocks)
    return total


def _elect_disjoint_mean(taus: list[np.ndarray]) -> np.ndarray:
    """TIES: sign of the sum per entry, then the mean of the values that have that sign (else 0)."""
    total = taus[0].copy()
    for tau in taus[1:]:
        total += tau
    sign = np.sign(total)
    agreeing_sum = np.zeros_like(total)
    agreeing = np.zeros(total.shape, dtype=np.int64)
    for tau in taus:
        agree = tau * sign > 0
        agreeing_sum += np.where(agree, tau, 0.0)
        agreeing += agree
    return agreeing_sum / np.maximum(agreeing, 1)


def _add_to_base(result: np.ndarray, base: np.ndarray, scale: float) -> np.ndarray:
    result *= scale
    result += base
    return result


def stream_seed(seed: int, rank: int, name: str) -> np.random.Generator:
    """DARE's random stream for one (seed, rank, tensor): independent of every other tensor and rank."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, rank, name_key])))


def is_running_statistic(name: str) -> bool:
    """Whether tensor ``name`` is a running statistic (BatchNorm's ``running_mean``/``running_var``).

    By name, because merging is state-dict generic (no model is built): the last component of the
    name, as PyTorch's norm layers spell it, e.g. ``features.1.running_var``."""
    return name.rsplit(".", 1)[-1] in RUNNING_STATISTICS


def normalised(weights: Any) -> np.ndarray:
    """Positive finite ``weights`` scaled to sum 1. Where their sum overflows (weights near 1e308) they
    are divided by the largest first, so no weight becomes 0 or NaN; otherwise divided by the sum as
    ever (bit for bit the weights of earlier merges)."""
    weights = np.asarray(weights, dtype=np.float64)
    with np.errstate(over="ignore"):
        total = weights.sum()
    if not np.isfinite(total):
        weights = weights / weights.max()
        total = weights.sum()
    return weights / total


def normalised_list(weights: list) -> list[float]:
    """:func:`normalised` for a list, summed in Python's order (bit for bit the rank weights of earlier
    merges where the sum does not overflow)."""
    total = float(sum(weights))
    if not math.isfinite(total):
        top = float(max(weights))
        weights = [w / top for w in weights]
        total = float(sum(weights))
    return [w / total for w in weights]


def _weights(params: dict[str, Any], num_ranks: int) -> np.ndarray:
    """merge_weights normalised to sum 1 (null: equal)."""
    return normalised(params["weights"] or [1.0] * num_ranks)
