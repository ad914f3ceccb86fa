"""Linear methods: the ranks' (weighted) mean, around the base or not.

theta_i is rank i's tensor (i = 0..N-1), base the run's shared initial weights (train's
base.safetensors, saved before the first step), tau_i = theta_i - base its task vector, n = numel.

  consolidate      theta_0, after checking max |theta_i - theta_0| <= tolerance (synchronous runs)
  uniform          mean_i theta_i (model soup)
  weighted         sum_i w_i theta_i with w normalised; w_i = shard rows unless given (FedAvg)
  greedy_soup      uniform over the ranks that greedy selection on the validation split keeps
                   (Wortsman et al. 2022; the selection lives in shardfuse.merge)
  task_arithmetic  base + scale * mean_i tau_i. Ilharco et al. (2023) write base + lambda * sum_i tau_i,
                   i.e. scale = lambda * N here. A mean, so that scale 1 is the uniform soup and a scale
                   means the same for any N and for ties and dare, which average too.
  model_stock      Jang et al. (2024), per tensor: c = mean pairwise cosine between the tau_i,
                   t = N c / (1 + (N - 1) c), merged = t * mean_i theta_i + (1 - t) * base. c is clamped
                   to [0, 1] (so t is in [0, 1]); pairs involving an all-zero tau are left out, and with
                   no pair left (N = 1, or every tau zero) t = 1: the plain mean.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from shardfuse.fusion.methods.plan import (
    Plan,
    _add_to_base,
    _mean,
)
from shardfuse.io import UserError

# The coefficients c_i of the methods linear in the ranks' updates, merged ΔW = sum_i c_i ΔW_i
# (registry.Method.update_coefficients; LoRA's merge_adapter cat is exact for these only). ``weights`` are
# the rank weights the merge reads (registry.rank_weights; None: equal).


def mean_coefficients(params: dict[str, Any], num_ranks: int, weights: list[float] | None) -> list[float]:
    return [1.0 / num_ranks] * num_ranks


def weight_coefficients(params: dict[str, Any], num_ranks: int, weights: list[float] | None) -> list[float]:
    return mean_coefficients(params, num_ranks, weights) if weights is None else list(weights)


def scaled_mean_coefficients(
    params: dict[str, Any], num_ranks: int, weights: list[float] | None
) -> list[float]:
    return [params["scale"] / num_ranks] * num_ranks


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
