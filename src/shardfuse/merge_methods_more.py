"""More fusion methods, registered into ``shardfuse.merge_methods`` (same plans, same engine).

No command line; by hand:

    python -c "import numpy as np, shardfuse.merge_methods as m, shardfuse.merge_engine as e; \\
        p = m.resolve_params('karcher', {}, [10, 10]); \\
        print(e.merge_arrays('karcher', p, [np.ones(4), np.arange(4.0)])[0])"

Notation as in ``shardfuse.merge_methods``: theta_i rank i's tensor, base the shared initial weights,
tau_i = theta_i - base, n = numel. Every method works on the flattened tensor (the engine sees no
shape): where mergekit works row by row (della's ranking, nuslerp by default) we match its
whole-tensor case (a 1-D tensor; nuslerp_flatten: true). Defaults are mergekit 0.1.5's, so density 1
means no sparsification (mergekit returns the task vector unchanged there, ignoring gamma/epsilon).
Our mean convention (task_arithmetic's): base + scale * mean; mergekit's unnormalised sum with weight
w per model is scale = w * N.

  breadcrumbs       Davari & Belilovsky (2023): per tau_i, sort |tau_i| ascending (equal magnitudes:
                    lower flat index first), keep sorted positions [n_bot, n - n_top) with
                    n_top = floor(gamma n), target = floor(density n), n_bot = n - target - n_top (if
                    negative, n_top shrinks so that `target` remain: mergekit's magnitude_outliers);
                    base + scale * mean of the masked tau_i.
  breadcrumbs_ties  the same masks, then the TIES sign election and disjoint mean of merge_methods
                    (an entry whose masked values sum to exactly 0 is 0).
  della             Deep et al. (2024), MagPrune: rank r = 0..n-1 of |tau_i| ascending (ties: flat
                    order); keep probability p = density - epsilon + 2 epsilon r / (n - 1) (mergekit's
                    density +- epsilon; the paper's epsilon is the full width, 2 epsilon here), keep
                    where u < p with u from the (seed, rank, tensor) stream of dare, rescale kept by 1/p,
                    then TIES election and disjoint mean; base + scale * that. n = 1: p = density.
  sce               Wan et al. (2025), FuseChat-2: select the floor(topk * #{var != 0}) entries of
                    largest variance across ranks (population variance; ties: flat order), zero the rest
                    in every tau_i; weight w_i = mean(tau_i^2) / sum_j mean(tau_j^2) (uniform if that sum
                    < 1e-6); erase: majority sign sign(sum_i tau_i) with 0 counting as + (mergekit's, not
                    our TIES rule), merged = sum_i w_i m_i tau_i / max(sum_i w_i m_i, 1e-6) where m_i
                    says tau_i is nonzero with the majority sign; base + scale * merged.
  nuslerp           mergekit's nuslerp with nuslerp_flatten: true and no base model, 2 ranks (1: rank 0):
                    cos = <a, b> / (max(|a|, 1e-7) max(|b|, 1e-7)) clamped to [-1, 1], theta = acos,
                    (sin((1 - t) theta) a + sin(t theta) b) / sin(theta), linear where |sin theta| < 1e-8.
                    mergekit's weights w_0, w_1 are t = w_1 / (w_0 + w_1).
  multislerp        mergekit's multislerp without base: w normalised, u_i = theta_i / (|theta_i| + 1e-8),
                    m = sum_i w_i u_i, merged = m / |m| * sum_i w_i |theta_i|; where |m| < 1e-8 the
                    weighted mean (mergekit does that for 2 models and raises for more).
  karcher           mergekit's karcher: the weighted Riemannian (Karcher) mean of the unit vectors
                    u_i = theta_i / |theta_i| (ranks with |theta_i| < tol left out), started at the
                    normalised weighted mean, at most max_iter steps u <- exp_u(sum_i w_i log_u(u_i)),
                    stopping when the step's norm < tol; merged = (sum_i w_i |theta_i| / sum_i w_i) * u.

Streaming: every spherical method is a linear combination of the ranks whose coefficients follow from
the Gram matrix <theta_i, theta_j>, summed in one scan by blocks (O(N^2) memory). breadcrumbs keeps
two thresholds per rank (a scan rank by rank, one rank's magnitudes in memory, as TIES). della needs
each entry's rank: it holds an int32/int64 rank per entry of every rank for the tensor being merged.
sce with topk < 1 holds the variance and every rank's squared task vector of that tensor (the weights
are means over the selected entries, known only after the whole scan).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardfuse.io import UserError
from shardfuse.merge_methods import (
    SCALE,
    Param,
    Plan,
    _add_to_base,
    _elect_disjoint_mean,
    _mean,
    register,
    stream_seed,
)

UNIT_DENSITY = Param(1.0, "number", "a number in (0, 1]", lambda v: 0 < v <= 1)
WEIGHTS = Param(None, "weights", "a list of positive numbers, one per rank, or null")
BREADCRUMBS = {
    "density": UNIT_DENSITY,
    "gamma": Param(0.01, "number", "a number in [0, 1)", lambda v: 0 <= v < 1),
    "scale": SCALE,
}
PARAMS: dict[str, dict[str, Param]] = {
    "breadcrumbs": BREADCRUMBS,
    "breadcrumbs_ties": BREADCRUMBS,
    "della": {
        "density": UNIT_DENSITY,
        "epsilon": Param(0.15, "number", "a number in [0, 0.5)", lambda v: 0 <= v < 0.5),
        "seed": Param(0, "integer", "an integer >= 0", lambda v: v >= 0),
        "scale": SCALE,
    },
    "sce": {"topk": UNIT_DENSITY, "scale": SCALE},
    "nuslerp": {"t": Param(0.5, "number", "a number in [0, 1]", lambda v: 0 <= v <= 1)},
    "multislerp": {"weights": WEIGHTS},
    "karcher": {
        "weights": WEIGHTS,
        "max_iter": Param(10, "integer", "an integer >= 1", lambda v: v >= 1),
        "tol": Param(1e-5, "number", "a number > 0", lambda v: v > 0),
    },
}
USES_BASE = frozenset({"breadcrumbs", "breadcrumbs_ties", "della", "sce"})


def check_params(method: str, params: dict[str, Any], num_ranks: int) -> None:
    """Checks across parameters and ranks, after each parameter passed its own."""
    if method == "della" and params["density"] < 1:
        low, high = params["density"] - params["epsilon"], params["density"] + params["epsilon"]
        if not (low > 0 and high < 1):
            raise UserError(
                f"merge method della: density +- epsilon must lie in (0, 1) but is [{low:g}, {high:g}]; "
                "lower merge_epsilon or move merge_density towards 0.5"
            )
    if method == "nuslerp" and num_ranks > 2:
        raise UserError(
            f"nuslerp interpolates exactly 2 models but the run has {num_ranks} ranks; use world_size 2 "
            "or multislerp/karcher"
        )


def _weights(params: dict[str, Any], num_ranks: int) -> np.ndarray:
    """merge_weights normalised to sum 1 (null: equal)."""
    weights = np.asarray(params["weights"] or [1.0] * num_ranks, dtype=np.float64)
    return weights / weights.sum()


class GramPlan(Plan):
    """Scan: Gram matrix of the ranks; combine: sum_i coefficient_i theta_i (set by end_scan)."""

    def __post_init__(self) -> None:
        num_ranks = len(self.job.ranks)
        self.scan_order = "blocks" if num_ranks > 1 else None
        self.gram = np.zeros((num_ranks, num_ranks))
        self.coefficients: np.ndarray | None = None

    def scan_blocks(self, start, blocks, base):
        stacked = np.stack(blocks)
        self.gram += stacked @ stacked.T

    def combine(self, start, blocks, base):
        if self.coefficients is None:  # one rank
            return blocks[0]
        total = blocks[0]
        total *= self.coefficients[0]
        for block, coefficient in zip(blocks[1:], self.coefficients[1:], strict=True):
            block *= coefficient
            total += block
        return total


class NuslerpPlan(GramPlan):
    def end_scan(self):
        t = self.params["t"]
        norms = np.sqrt(np.diag(self.gram))
        cos = self.gram[0, 1] / (max(norms[0], 1e-7) * max(norms[1], 1e-7))
        theta = math.acos(min(1.0, max(-1.0, cos)))
        sin_theta = math.sin(theta)
        self.stats.update(angle_deg=math.degrees(theta), interpolation="slerp")
        if abs(sin_theta) < 1e-8:
            self.coefficients = np.array([1 - t, t])
            self.stats["interpolation"] = "lerp"
        else:
            self.coefficients = np.array([math.sin((1 - t) * theta), math.sin(t * theta)]) / sin_theta


class MultislerpPlan(GramPlan):
    def end_scan(self):
        weights = _weights(self.params, len(self.job.ranks))
        norms = np.sqrt(np.diag(self.gram))
        unit = weights / (norms + 1e-8)  # m = sum_i unit_i theta_i
        mean_norm = math.sqrt(max(0.0, float(unit @ self.gram @ unit)))
        if mean_norm < 1e-8:
            self.coefficients = weights
            self.stats["interpolation"] = "linear"
        else:
            self.coefficients = unit * (float(weights @ norms) / mean_norm)
            self.stats["interpolation"] = "spherical"


class KarcherPlan(GramPlan):
    def end_scan(self):
        num_ranks, tol = len(self.job.ranks), self.params["tol"]
        weights = np.asarray(self.params["weights"] or [1.0] * num_ranks, dtype=np.float64)
        norms = np.sqrt(np.diag(self.gram))
        valid = np.flatnonzero(norms >= tol)
        self.stats["iterations"] = 0
        if not len(valid):
            self.coefficients = np.zeros(num_ranks)
            return
        w = weights[valid] / weights[valid].sum()
        units = self.gram[np.ix_(valid, valid)] / np.outer(norms[valid], norms[valid])  # <u_i, u_j>

        def norm(c: np.ndarray) -> float:
            return math.sqrt(max(0.0, float(c @ units @ c)))

        u = w.copy()  # u = sum_k u[k] unit_k
        length = norm(u)
        u = np.eye(len(valid))[0] if length < tol else u / length
        for _ in range(self.params["max_iter"]):
            dots = np.clip(units @ u, -1.0, 1.0)
            step = np.zeros_like(u)
            for k, dot in enumerate(dots):
                theta = math.acos(dot)
                # w_k theta / sin(theta) (unit_k - cos(theta) u): the log map. |dot| = 1 (antipodal or
                # equal) has a zero tangent, which the Gram form would only reach through cancellation.
                if theta >= tol and dot * dot < 1.0:
                    factor = w[k] * theta / math.sin(theta)
                    step -= factor * dot * u
                    step[k] += factor
            step_norm = norm(step)
            if step_norm < tol:
                break
            self.stats["iterations"] += 1
            u = math.cos(step_norm) * u + math.sin(step_norm) * step / step_norm
            length = norm(u)
            if length > tol:
                u = u / length
        scale = float(weights @ norms) / weights.sum()
        self.coefficients = np.zeros(num_ranks)
        self.coefficients[valid] = scale * u / norms[valid]


class _RankedPlan(Plan):
    """A scan rank by rank that sees each rank's whole |tau| (one rank in memory at a time)."""

    def __post_init__(self) -> None:
        self.num_kept = 0
        self._magnitudes: np.ndarray | None = None

    def scan_rank(self, index, start, block, base):
        if start == 0:
            self._magnitudes = np.empty(self.job.numel)
        np.abs(np.subtract(block, base, out=block), out=self._magnitudes[start : start + len(block)])

    def end_rank(self, index):
        magnitudes, self._magnitudes = self._magnitudes, None
        self.ranked(index, magnitudes)

    def ranked(self, index: int, magnitudes: np.ndarray) -> None:
        raise NotImplementedError

    def merged(self, taus: list[np.ndarray], base: np.ndarray, ties: bool) -> np.ndarray:
        self.stats["kept_fraction"] = self.num_kept / max(1, self.job.numel * len(taus))
        return _add_to_base(_elect_disjoint_mean(taus) if ties else _mean(taus), base, self.params["scale"])


class BreadcrumbsPlan(_RankedPlan):
    """Keep sorted positions [low, high) of |tau| ascending (ties in flat order). The scan finds, per rank,
    the magnitudes at positions low and high - 1 and how many entries lie below each; combine counts
    the entries equal to them in flat order to place each one."""

    ties = False

    def __post_init__(self) -> None:
        super().__post_init__()
        n, density, gamma = self.job.numel, self.params["density"], self.params["gamma"]
        target, top = math.floor(density * n), math.floor(gamma * n)
        bottom = n - target - top
        if bottom < 0:
            top, bottom = top + bottom, 0
        self.low, self.high = bottom, n - top
        self.sparse = density < 1 and n > 0
        self.scan_order = "ranks" if self.sparse and self.low < self.high else None
        num_ranks = len(self.job.ranks)
        self.edges: list[list[tuple[float, int]]] = [[] for _ in range(num_ranks)]  # (value, #below)
        self.seen = [[0, 0] for _ in range(num_ranks)]  # entries equal to each edge so far

    def ranked(self, index, magnitudes):
        edges = []
        for position in (self.low, self.high - 1):
            value = float(np.partition(magnitudes, position)[position])
            edges.append((value, int(np.count_nonzero(magnitudes < value))))
        self.edges[index] = edges

    def mask(self, index: int, tau: np.ndarray) -> None:
        if not self.sparse:
            self.num_kept += len(tau)
            return
        if self.low >= self.high:
            tau[:] = 0.0
            return
        magnitude = np.abs(tau)
        (low_value, _), (high_value, _) = self.edges[index]
        keep = (magnitude > low_value) & (magnitude < high_value)
        for which, (value, below) in enumerate(self.edges[index]):
            if which == 1 and value == low_value:
                break
            equal = magnitude == value
            position = below + self.seen[index][which] + np.cumsum(equal) - 1
            keep |= equal & (position >= self.low) & (position < self.high)
            self.seen[index][which] += int(np.count_nonzero(equal))
        np.copyto(tau, 0.0, where=~keep)
        self.num_kept += int(np.count_nonzero(keep))

    def combine(self, start, blocks, base):
        for index, block in enumerate(blocks):
            block -= base
            self.mask(index, block)
        return self.merged(blocks, base, self.ties)


class BreadcrumbsTiesPlan(BreadcrumbsPlan):
    ties = True


class DellaPlan(_RankedPlan):
    def __post_init__(self) -> None:
        super().__post_init__()
        self.sparse = self.params["density"] < 1 and self.job.numel > 0
        self.scan_order = "ranks" if self.sparse else None
        self.kept_rank: list[np.ndarray | None] = [None] * len(self.job.ranks)  # rank, or -1 if dropped

    def probability(self, order: np.ndarray) -> np.ndarray:
        density, epsilon, n = self.params["density"], self.params["epsilon"], self.job.numel
        if n == 1:
            return np.full(order.shape, density)
        return (density - epsilon) + order * (2 * epsilon / (n - 1))

    def ranked(self, index, magnitudes):
        n = self.job.numel
        order = np.empty(n, dtype=np.int64)
        order[np.argsort(magnitudes, kind="stable")] = np.arange(n)
        draws = stream_seed(self.params["seed"], self.job.ranks[index], self.job.name).random(n)
        keep = draws < self.probability(order)
        self.kept_rank[index] = np.where(keep, order, -1).astype(np.int32 if n < 2**31 else np.int64)

    def combine(self, start, blocks, base):
        for index, block in enumerate(blocks):
            block -= base
            if not self.sparse:
                self.num_kept += len(block)
                continue
            kept = self.kept_rank[index][start : start + len(block)]
            keep = kept >= 0
            block /= self.probability(np.maximum(kept, 0))
            np.copyto(block, 0.0, where=~keep)
            self.num_kept += int(np.count_nonzero(keep))
        return self.merged(blocks, base, ties=True)


class ScePlan(Plan):
    def __post_init__(self) -> None:
        num_ranks, n = len(self.job.ranks), self.job.numel
        self.select = self.params["topk"] < 1 and n > 0
        self.scan_order = "blocks" if n > 0 else None
        self.squares = np.zeros(num_ranks)
        self.variance = np.empty(n) if self.select else None
        self.tau_squared = np.empty((num_ranks, n)) if self.select else None
        self.threshold, self.equal_left = -math.inf, 0
        self.weights, self.floor = np.full(num_ranks, 1.0), 1e-6

    def scan_blocks(self, start, blocks, base):
        taus = np.stack(blocks) - base
        if not self.select:
            self.squares += np.einsum("ij,ij->i", taus, taus)
            return
        self.variance[start : start + taus.shape[1]] = taus.var(axis=0)
        self.tau_squared[:, start : start + taus.shape[1]] = taus * taus

    def end_scan(self):
        if self.select:
            variance, self.variance = self.variance, None
            count = math.floor(int(np.count_nonzero(variance)) * self.params["topk"])
            if count == 0:
                self.threshold, self.equal_left = math.inf, 0
                self.squares[:] = 0.0
            else:
                order = np.argsort(-variance, kind="stable")[:count]
                self.threshold = float(variance[order[-1]])
                self.equal_left = count - int(np.count_nonzero(variance > self.threshold))
                self.squares = self.tau_squared[:, order].sum(axis=1)
            self.tau_squared = None
        means = self.squares / max(1, self.job.numel)
        total = float(means.sum())
        normalised = means / total if abs(total) >= 1e-6 else np.full(len(means), 1 / len(means))
        # sum w m tau / max(sum w m, 1e-6) with w divided by its largest: the same ratio, exact when
        # every weight is equal.
        top = float(normalised.max())
        self.weights, self.floor = normalised / top, 1e-6 / top
        self.stats["weights"] = [float(w) for w in normalised]

    def selected(self, start: int, taus: np.ndarray) -> np.ndarray:
        variance = taus.var(axis=0)
        keep = variance > self.threshold
        if self.equal_left > 0:
            equal = variance == self.threshold
            running = np.cumsum(equal)
            keep |= equal & (running <= self.equal_left)
            self.equal_left -= min(int(running[-1]) if len(running) else 0, self.equal_left)
        return keep

    def combine(self, start, blocks, base):
        taus = np.stack(blocks) - base
        if self.select:
            taus *= self.selected(start, taus)
        majority = np.where(taus.sum(axis=0) >= 0, 1.0, -1.0)
        agree = np.sign(taus) == majority
        erased = self.weights[:, None] * agree
        merged = (taus * erased).sum(axis=0) / np.maximum(erased.sum(axis=0), self.floor)
        return _add_to_base(merged, base, self.params["scale"])


PLANS: dict[str, type[Plan]] = {
    "breadcrumbs": BreadcrumbsPlan,
    "breadcrumbs_ties": BreadcrumbsTiesPlan,
    "della": DellaPlan,
    "sce": ScePlan,
    "nuslerp": NuslerpPlan,
    "multislerp": MultislerpPlan,
    "karcher": KarcherPlan,
}

register(PARAMS, PLANS, USES_BASE, check_params)
