"""Sparsifying methods: trim or drop entries of each task vector, elect signs, add to the base.

theta_i is rank i's tensor (i = 0..N-1), base the run's shared initial weights (train's
base.safetensors, saved before the first step), tau_i = theta_i - base its task vector, n = numel.

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
  breadcrumbs      Davari & Belilovsky (2023): per tau_i, sort |tau_i| ascending (equal magnitudes:
                   lower flat index first), keep sorted positions [n_bot, n - n_top) with
                   n_top = floor(gamma n), target = floor(density n), n_bot = n - target - n_top (if
                   negative, n_top shrinks so that `target` remain: mergekit's magnitude_outliers);
                   base + scale * mean of the masked tau_i.
  breadcrumbs_ties the same masks, then the TIES sign election and disjoint mean of ties
                   (an entry whose masked values sum to exactly 0 is 0).
  della            Deep et al. (2024), MagPrune: rank r = 0..n-1 of |tau_i| ascending (ties: flat
                   order); keep probability p = density - epsilon + 2 epsilon r / (n - 1) (mergekit's
                   density +- epsilon; the paper's epsilon is the full width, 2 epsilon here), keep
                   where u < p with u from the (seed, rank, tensor) stream of dare, rescale kept by 1/p,
                   then TIES election and disjoint mean (sign_election: false, the mean: mergekit's
                   della_linear); base + scale * that. n = 1: p = density.
  sce              Wan et al. (2025), FuseChat-2: select the floor(topk * #{var != 0}) entries of
                   largest variance across ranks (population variance; ties: flat order), zero the rest
                   in every tau_i; weight w_i = mean(tau_i^2) / sum_j mean(tau_j^2) (uniform if that sum
                   < 1e-6); erase: majority sign sign(sum_i tau_i) with 0 counting as + (mergekit's, not
                   our TIES rule), merged = sum_i w_i m_i tau_i / max(sum_i w_i m_i, 1e-6) where m_i
                   says tau_i is nonzero with the majority sign; base + scale * merged.

mergekit's conventions (flattened tensors, its defaults, our mean): :mod:`shardfuse.fusion.methods.plan`.
"""

from __future__ import annotations

import math

import numpy as np

from shardfuse.fusion.methods.plan import (
    Plan,
    _add_to_base,
    _elect_disjoint_mean,
    _mean,
    stream_seed,
)
from shardfuse.fusion.methods.select import StreamedRanks


class TiesPlan(Plan):
    """Top-k per task vector: the scan finds each rank's k-th largest magnitude over the whole tensor
    (two passes per rank, :class:`StreamedRanks`: no rank's whole |tau| in memory); combine keeps
    entries above it, and as many entries equal to it as k allows, in flat order."""

    scan_passes = 2

    def __post_init__(self) -> None:
        numel, num_ranks = self.job.numel, len(self.job.ranks)
        self.keep_count = max(1, math.floor(self.params["density"] * numel + 0.5)) if numel else 0
        self.scan_order = "ranks" if 0 < self.keep_count < numel else None
        self.threshold = [-math.inf] * num_ranks  # keep everything unless the scan says otherwise
        self.equal_left = [0] * num_ranks
        self.num_kept = 0
        self._ranks: StreamedRanks | None = None

    def scan_rank(self, index, start, block, base):
        if self._ranks is None:
            self._ranks = StreamedRanks([self.job.numel - self.keep_count])
        self._ranks.add(np.abs(np.subtract(block, base, out=block), out=block))

    def end_rank(self, index):
        if not self._ranks.end_pass():
            return
        ((threshold, below, equal),) = self._ranks.results
        self._ranks = None
        self.threshold[index] = threshold
        above = self.job.numel - below - equal
        self.equal_left[index] = self.keep_count - above

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


class _RankedPlan(Plan):
    """A scan rank by rank that sees each rank's whole |tau| (one rank in memory at a time; breadcrumbs
    overrides it with the streamed two-pass scan), and the merge of the masked task vectors."""

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
    the magnitudes at positions low and high - 1 and how many entries lie below each (two passes,
    :class:`StreamedRanks`, as TIES); combine counts the entries equal to them in flat order to place
    each one."""

    ties = False
    scan_passes = 2

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
        self._ranks: StreamedRanks | None = None

    def scan_rank(self, index, start, block, base):
        if self._ranks is None:
            self._ranks = StreamedRanks([self.low, self.high - 1])
        self._ranks.add(np.abs(np.subtract(block, base, out=block), out=block))

    def end_rank(self, index):
        if self._ranks.end_pass():
            self.edges[index] = [(value, below) for value, below, _ in self._ranks.results]
            self._ranks = None

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
        return self.merged(blocks, base, ties=self.params["sign_election"])


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
