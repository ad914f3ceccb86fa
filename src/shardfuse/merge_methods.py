"""Fusion methods as pure float64 array math on the N ranks' versions of one tensor.

No command line; ``shardfuse.merge`` streams checkpoints through these plans block by block with
``shardfuse.merge_engine``, whose ``merge_arrays`` runs one plan on whole arrays. By hand:

    python -c "import numpy as np, shardfuse.merge_methods as m, shardfuse.merge_engine as e; \\
        p = m.resolve_params('ties', {'density': 0.5}, [10, 10]); \\
        print(e.merge_arrays('ties', p, [np.ones(4), -np.ones(4)], base=np.zeros(4))[0])"

theta_i is rank i's tensor (i = 0..N-1), base the run's shared initial weights (train's
base.safetensors, saved before the first step), tau_i = theta_i - base its task vector.

  consolidate      theta_0, after checking max |theta_i - theta_0| <= tolerance (synchronous runs)
  uniform          mean_i theta_i (model soup)
  weighted         sum_i w_i theta_i with w normalised; w_i = shard rows unless given (FedAvg)
  greedy_soup      uniform over the ranks that greedy selection on the validation split keeps
                   (Wortsman et al. 2022; the selection lives in shardfuse.merge)
  task_arithmetic  base + scale * mean_i tau_i. Ilharco et al. (2023) write base + lambda * sum_i tau_i,
                   i.e. scale = lambda * N here. A mean, so that scale 1 is the uniform soup and a scale
                   means the same for any N and for ties and dare, which average too.
  ties             Yadav et al. (2023): keep the k = max(1, round(density * numel)) entries of largest
                   magnitude of each tau_i (equal magnitudes: lower flat index first), elect per entry
                   the sign of the sum of the kept values, average the kept values of that sign
                   (disjoint mean); base + scale * that. Where the kept values sum to exactly 0 no sign
                   is elected and the entry is 0: our choice, not mergekit's (0.1.5 elects + there and
                   averages the positive kept values) nor the paper code's (which falls back to the
                   tensor's majority sign).
  dare             Yu et al. (2024): drop each entry of tau_i with probability 1 - density, rescale kept
                   entries by 1 / density, then mean (DARE-linear) or, with sign_election, the TIES
                   election and disjoint mean (DARE-TIES); base + scale * that. Each (seed, rank, tensor
                   name) seeds its own random stream, so results never depend on block size.
  slerp            exactly 2 ranks: spherical interpolation of the flattened tensors with factor t;
                   linear where they are (anti)parallel (|cos| > 0.9995) or one is all zeros;
                   t = 0 and t = 1 return rank 0 and rank 1 exactly.
  model_stock      Jang et al. (2024), per tensor: c = mean pairwise cosine between the tau_i,
                   t = N c / (1 + (N - 1) c), merged = t * mean_i theta_i + (1 - t) * base. c is clamped
                   to [0, 1] (so t is in [0, 1]); pairs involving an all-zero tau are left out, and with
                   no pair left (N = 1, or every tau zero) t = 1: the plain mean.

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
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np

from shardfuse.io import UserError

SLERP_PARALLEL_COS = 0.9995  # above this |cos| slerp falls back to lerp (sin(theta) is too small)
RUNNING_STATISTICS = ("running_mean", "running_var")  # name suffixes; see is_running_statistic


# ---------------------------------------------------------------- parameters


@dataclass(frozen=True)
class Param:
    default: Any
    kind: str  # number | integer | boolean | weights
    describe: str
    accept: Callable[[Any], bool] = lambda value: True


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


SCALE = Param(1.0, "number", "a number > 0", lambda v: v > 0)
PARAMS: dict[str, dict[str, Param]] = {
    "consolidate": {"tolerance": Param(1e-6, "number", "a number >= 0", lambda v: v >= 0)},
    "uniform": {},
    "weighted": {"weights": Param(None, "weights", "a list of positive numbers, one per rank, or null")},
    "greedy_soup": {},
    "task_arithmetic": {"scale": SCALE},
    "ties": {"density": Param(0.2, "number", "a number in (0, 1]", lambda v: 0 < v <= 1), "scale": SCALE},
    "dare": {
        "density": Param(0.5, "number", "a number in (0, 1]", lambda v: 0 < v <= 1),
        "seed": Param(0, "integer", "an integer >= 0", lambda v: v >= 0),
        "sign_election": Param(False, "boolean", "true or false"),
        "scale": SCALE,
    },
    "slerp": {"t": Param(0.5, "number", "a number in [0, 1]", lambda v: 0 <= v <= 1)},
    "model_stock": {},
}
METHODS = tuple(PARAMS)
USES_BASE = frozenset({"task_arithmetic", "ties", "dare", "model_stock"})
USES_VAL = frozenset({"greedy_soup"})
CHECKS: dict[str, Callable[[str, dict[str, Any], int], None]] = {}  # cross-parameter checks, by method


def _valid_type(param: Param, value: Any, num_ranks: int) -> bool:
    if param.kind == "number":
        return _is_number(value)
    if param.kind == "integer":
        return isinstance(value, int) and not isinstance(value, bool)
    if param.kind == "boolean":
        return isinstance(value, bool)
    return value is None or (
        isinstance(value, list) and len(value) == num_ranks and all(_is_number(w) and w > 0 for w in value)
    )


def resolve_params(method: str, params: Any, rows: list[int]) -> dict[str, Any]:
    """Check ``params`` of ``method`` for a run whose ranks have ``rows`` rows; fill in defaults."""
    if method not in PARAMS:
        raise UserError(f"unknown merge method {method!r}; use one of {', '.join(METHODS)}")
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UserError(
            f"merge parameters must be a JSON object, got {type(params).__name__}; "
            "pass e.g. --params-json '{\"density\": 0.2}'"
        )
    spec = PARAMS[method]
    unknown = sorted(set(params) - set(spec))
    if unknown:
        valid = f"valid: {', '.join(spec)}" if spec else "it takes none"
        raise UserError(
            f"merge method {method} has no parameter {', '.join(map(repr, unknown))} ({valid}); "
            "remove it from --params-json"
        )
    num_ranks = len(rows)
    resolved = {}
    for name, param in spec.items():
        value = params.get(name, param.default)
        if not (_valid_type(param, value, num_ranks) and (value is None or param.accept(value))):
            need = (
                f"{param.describe} (the run has {num_ranks} ranks)"
                if param.kind == "weights"
                else param.describe
            )
            raise UserError(
                f"merge method {method}: parameter {name!r} must be {need}, got {value!r}; "
                f"fix it in --params-json (run key merge_{name})"
            )
        resolved[name] = float(value) if param.kind == "number" else value
    if method == "slerp" and num_ranks != 2:
        raise UserError(
            f"slerp interpolates exactly 2 models but the run has {num_ranks} ranks; use world_size 2 "
            "or another merge method"
        )
    CHECKS.get(method, lambda *_: None)(method, resolved, num_ranks)
    return resolved


def rank_weights(method: str, params: dict[str, Any], rows: list[int]) -> list[float] | None:
    """The normalised weights of weighted (explicit, else shard rows) and uniform; None otherwise."""
    if method == "uniform":
        return [1.0 / len(rows)] * len(rows)
    if method != "weighted":
        return None
    raw = params["weights"] if params["weights"] is not None else rows
    total = float(sum(raw))
    if total <= 0:
        raise UserError("weighted merge needs ranks with rows > 0; use merge_method uniform")
    return [w / total for w in raw]


# ---------------------------------------------------------------- plans


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


class ConsolidatePlan(Plan):
    def check(self, spread: float) -> None:
        tolerance = self.params["tolerance"]
        if not spread <= tolerance:
            raise UserError(
                f"consolidate: tensor {self.job.name!r} differs between ranks by up to {spread:.3g} "
                f"(merge_tolerance {tolerance:.3g}); the ranks are not synchronous — use merge_method "
                "uniform/weighted or raise merge_tolerance"
            )

    def combine(self, start, blocks, base):
        return blocks[0]


class UniformPlan(Plan):
    plain_mean = True

    def combine(self, start, blocks, base):
        return _mean(blocks)


class WeightedPlan(Plan):
    def combine(self, start, blocks, base):
        weights = self.job.weights
        total = blocks[0]
        total *= weights[0]
        for block, weight in zip(blocks[1:], weights[1:], strict=True):
            block *= weight
            total += block
        return total


class TaskArithmeticPlan(Plan):
    def combine(self, start, blocks, base):
        for block in blocks:
            block -= base
        return _add_to_base(_mean(blocks), base, self.params["scale"])


class TiesPlan(Plan):
    """Top-k per task vector: the scan finds each rank's k-th largest magnitude over the whole tensor
    (one rank's magnitudes in memory at a time); combine keeps entries above it, and as many entries
    equal to it as k allows, in flat order."""

    def __post_init__(self) -> None:
        numel, num_ranks = self.job.numel, len(self.job.ranks)
        self.keep_count = max(1, math.floor(self.params["density"] * numel + 0.5)) if numel else 0
        self.scan_order = "ranks" if 0 < self.keep_count < numel else None
        self.threshold = [-math.inf] * num_ranks  # keep everything unless the scan says otherwise
        self.equal_left = [0] * num_ranks
        self.num_kept = 0
        self._magnitudes: np.ndarray | None = None

    def scan_rank(self, index, start, block, base):
        if start == 0:
            self._magnitudes = np.empty(self.job.numel)
        np.abs(np.subtract(block, base, out=block), out=self._magnitudes[start : start + len(block)])

    def end_rank(self, index):
        magnitudes, self._magnitudes = self._magnitudes, None
        kth = self.job.numel - self.keep_count
        magnitudes.partition(kth)
        threshold = magnitudes[kth]
        self.threshold[index] = threshold
        self.equal_left[index] = self.keep_count - int(np.count_nonzero(magnitudes[kth + 1 :] > threshold))

    def trim(self, index: int, tau: np.ndarray) -> None:
        magnitude = np.abs(tau)
        keep = magnitude > self.threshold[index]
        if self.equal_left[index] > 0:
            equal = magnitude == self.threshold[index]
            running = np.cumsum(equal)
            keep |= equal & (running <= self.equal_left[index])
            self.equal_left[index] -= min(int(running[-1]) if len(running) else 0, self.equal_left[index])
        np.copyto(tau, 0.0, where=~keep)
        self.num_kept += int(np.count_nonzero(keep))

    def combine(self, start, blocks, base):
        for index, block in enumerate(blocks):
            block -= base
            self.trim(index, block)
        self.stats["kept_fraction"] = self.num_kept / max(1, self.job.numel * len(blocks))
        return _add_to_base(_elect_disjoint_mean(blocks), base, self.params["scale"])


def stream_seed(seed: int, rank: int, name: str) -> np.random.Generator:
    """DARE's random stream for one (seed, rank, tensor): independent of every other tensor and rank."""
    name_key = int.from_bytes(hashlib.sha256(name.encode()).digest()[:8], "little")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, rank, name_key])))


class DarePlan(Plan):
    def __post_init__(self) -> None:
        self.streams = [stream_seed(self.params["seed"], rank, self.job.name) for rank in self.job.ranks]
        self.num_kept = 0

    def combine(self, start, blocks, base):
        density = self.params["density"]
        for stream, block in zip(self.streams, blocks, strict=True):
            keep = stream.random(len(block)) < density  # one float64 draw per entry, in flat order
            block -= base
            block /= density
            np.copyto(block, 0.0, where=~keep)
            self.num_kept += int(np.count_nonzero(keep))
        self.stats["kept_fraction"] = self.num_kept / max(1, self.job.numel * len(blocks))
        merged = _elect_disjoint_mean(blocks) if self.params["sign_election"] else _mean(blocks)
        return _add_to_base(merged, base, self.params["scale"])


class SlerpPlan(Plan):
    def __post_init__(self) -> None:
        self.t = self.params["t"]
        self.scan_order = "blocks" if 0 < self.t < 1 else None
        self.sums = np.zeros(3)  # a.b, a.a, b.b
        self.coefficients = (1 - self.t, self.t)
        self.stats.update(interpolation="endpoint" if self.scan_order is None else "lerp", angle_deg=None)

    def scan_blocks(self, start, blocks, base):
        first, second = blocks
        self.sums += (np.dot(first, second), np.dot(first, first), np.dot(second, second))

    def end_scan(self):
        dot, first_sq, second_sq = self.sums
        if first_sq > 0 and second_sq > 0:
            # sqrt(x * x) == x in IEEE arithmetic, so identical tensors give cos == 1 exactly.
            cos = min(1.0, max(-1.0, dot / math.sqrt(first_sq * second_sq)))
            theta = math.acos(cos)
            self.stats["angle_deg"] = math.degrees(theta)
            if abs(cos) <= SLERP_PARALLEL_COS:
                sin_theta = math.sin(theta)
                self.coefficients = (
                    math.sin((1 - self.t) * theta) / sin_theta,
                    math.sin(self.t * theta) / sin_theta,
                )
                self.stats["interpolation"] = "slerp"

    def combine(self, start, blocks, base):
        first, second = blocks
        if self.t in (0.0, 1.0):
            return first if self.t == 0.0 else second
        first *= self.coefficients[0]
        second *= self.coefficients[1]
        first += second
        return first


class ModelStockPlan(Plan):
    def __post_init__(self) -> None:
        num_ranks = len(self.job.ranks)
        self.scan_order = "blocks" if num_ranks > 1 else None
        self.gram = np.zeros((num_ranks, num_ranks))
        self.ratio = 1.0
        self.stats.update(t=1.0, cos=None)

    def scan_blocks(self, start, blocks, base):
        taus = [np.subtract(block, base) for block in blocks]
        for i, tau in enumerate(taus):
            for j in range(i, len(taus)):
                self.gram[i, j] += np.dot(tau, taus[j])

    def end_scan(self):
        squares = np.diag(self.gram)
        num_ranks = len(squares)
        cosines = [  # sqrt(x * x) == x: identical task vectors give cos == 1, hence t == 1, exactly
            self.gram[i, j] / math.sqrt(squares[i] * squares[j])
            for i in range(num_ranks)
            for j in range(i + 1, num_ranks)
            if squares[i] > 0 and squares[j] > 0
        ]
        if cosines:
            cos = min(1.0, max(0.0, float(np.mean(cosines))))
            self.ratio = num_ranks * cos / (1 + (num_ranks - 1) * cos)
            self.stats.update(t=self.ratio, cos=float(np.mean(cosines)))

    def combine(self, start, blocks, base):
        merged = _mean(blocks)
        if self.ratio == 1.0:
            return merged
        merged *= self.ratio
        merged += (1 - self.ratio) * base
        return merged


PLANS: dict[str, type[Plan]] = {
    "consolidate": ConsolidatePlan,
    "uniform": UniformPlan,
    "weighted": WeightedPlan,
    "greedy_soup": UniformPlan,  # over the selected ranks
    "task_arithmetic": TaskArithmeticPlan,
    "ties": TiesPlan,
    "dare": DarePlan,
    "slerp": SlerpPlan,
    "model_stock": ModelStockPlan,
}


def is_running_statistic(name: str) -> bool:
    """Whether tensor ``name`` is a running statistic (BatchNorm's ``running_mean``/``running_var``).

    By name, because merging is state-dict generic (no model is built): the last component of the
    name, as PyTorch's norm layers spell it, e.g. ``features.1.running_var``."""
    return name.rsplit(".", 1)[-1] in RUNNING_STATISTICS


def make_plan(method: str, params: dict[str, Any], job: TensorJob) -> Plan:
    if method == "consolidate" or not is_running_statistic(job.name):
        return PLANS[method](job, params)
    # Statistics of activations, not weights: their "task vector" means nothing, so trimming, dropping,
    # scaling or a spherical path would give statistics that no rank measured. The (weighted) mean is
    # what a soup of the ranks would carry.
    plan = (WeightedPlan if method == "weighted" else UniformPlan)(job, params)
    plan.stats["running_statistic"] = "weighted mean" if method == "weighted" else "mean"
    return plan


def register(params: dict[str, dict[str, Param]], plans: dict[str, type[Plan]], uses_base, check) -> None:
    """Add methods defined elsewhere (shardfuse.merge_methods_more) to the tables above."""
    global METHODS, USES_BASE
    PARAMS.update(params)
    PLANS.update(plans)
    CHECKS.update(dict.fromkeys(params, check))
    METHODS, USES_BASE = tuple(PARAMS), USES_BASE | uses_base


import shardfuse.merge_methods_more  # noqa: E402, F401  registers itself (it imports this module)
