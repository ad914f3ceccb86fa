"""Spherical methods: interpolate on the sphere of the flattened tensors.

theta_i is rank i's tensor (i = 0..N-1), base the run's shared initial weights (train's
base.safetensors, saved before the first step), tau_i = theta_i - base its task vector, n = numel.

  slerp            exactly 2 ranks: spherical interpolation of the flattened tensors with factor t;
                   linear where they are (anti)parallel (|cos| > 0.9995) or one is all zeros;
                   t = 0 and t = 1 return rank 0 and rank 1 exactly.
  nuslerp          mergekit's nuslerp with nuslerp_flatten: true and no base model, 2 ranks (1: rank 0):
                   cos = <a, b> / (max(|a|, 1e-7) max(|b|, 1e-7)) clamped to [-1, 1], theta = acos,
                   (sin((1 - t) theta) a + sin(t theta) b) / sin(theta), linear where |sin theta| < 1e-8.
                   mergekit's weights w_0, w_1 are t = w_1 / (w_0 + w_1).
  multislerp       mergekit's multislerp without base: w normalised, u_i = theta_i / (|theta_i| + 1e-8),
                   m = sum_i w_i u_i, merged = m / |m| * sum_i w_i |theta_i|; where |m| < 1e-8 the
                   weighted mean (mergekit does that for 2 models and raises for more).
  karcher          mergekit's karcher: the weighted Riemannian (Karcher) mean of the unit vectors
                   u_i = theta_i / |theta_i| (ranks with |theta_i| < tol left out), started at the
                   normalised weighted mean, at most max_iter steps u <- exp_u(sum_i w_i log_u(u_i)),
                   stopping when the step's norm < tol; merged = (sum_i w_i |theta_i| / sum_i w_i) * u.

mergekit's conventions (flattened tensors, its defaults, our mean): :mod:`shardfuse.fusion.methods.plan`.
"""

from __future__ import annotations

import math

import numpy as np

from shardfuse.fusion.methods.plan import (
    SLERP_PARALLEL_COS,
    Plan,
    _weights,
    normalised,
)
from shardfuse.io import UserError


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
            if norms.any():  # a tensor that is zero in every rank stays zero; anything else is lost
                raise UserError(
                    f"merge method karcher: every rank's {self.job.name} is shorter than tol {tol:g} "
                    f"(norms up to {norms.max():.3g}), so no rank is left to average; lower merge_tol"
                )
            self.coefficients = np.zeros(num_ranks)
            return
        w = normalised(weights[valid])
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
        with np.errstate(over="ignore", invalid="ignore"):
            scale = float(weights @ norms) / weights.sum()
        if not math.isfinite(scale):  # weights whose sum overflows: normalised first
            scale = float(normalised(weights) @ norms)
        self.coefficients = np.zeros(num_ranks)
        self.coefficients[valid] = scale * u / norms[valid]
