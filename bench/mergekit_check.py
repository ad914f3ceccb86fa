"""Second reference for the merge methods: shardfuse's results against mergekit 0.1.5's own functions.

mergekit needs transformers 5, peft, datasets..., none of which the project pins, so it lives in a
separate virtual environment; this script imports shardfuse from this checkout's ``src`` (its merge
modules need numpy only). Setup (about a minute; torch 2.13.0 is the CPU build on local disk, so pin it
or pip fetches gigabytes):

    python3 -m venv /tmp/mkvenv
    /tmp/mkvenv/bin/pip install torch==2.13.0
    echo torch==2.13.0 > /tmp/mkvenv/constraints.txt
    /tmp/mkvenv/bin/pip install -c /tmp/mkvenv/constraints.txt mergekit==0.1.5

Run (a few seconds; exit status 1 if a matched method disagrees beyond tolerance):

    /tmp/mkvenv/bin/python bench/mergekit_check.py             # summary tables
    /tmp/mkvenv/bin/python bench/mergekit_check.py --verbose   # and one line per case

What it compares. For every shardfuse method with a mergekit counterpart, on seeded random tensors
(shapes (1000,), (64, 48) and (); N = 2 and 4 ranks where the method allows; two or three parameter
settings; ranks around a shared base, and for the base-free methods also independent ranks), it runs
``shardfuse.fusion.engine.merge_arrays`` on float32 inputs (shardfuse merges in float64 and rounds to
float32) and mergekit's method (``mergekit.merge_methods.merge_tensors``, or the function named) on the
same values in float64, with the conventions matched as each check's ``match`` says. Per method it
prints the largest |difference| and the largest difference in float32 ulps (ulp of the float32 binade
of the mergekit value). PASS: at most 0.5 ulp, i.e. shardfuse's float32 result is mergekit's float64
result correctly rounded. Two more columns for information: shardfuse's float64 result against
mergekit's (max |difference|), and mergekit run in float32 against itself in float64.

Inputs: multiples of 2^-24 below 1 in magnitude (exact in float32, so mergekit's float32 work dtype
on CPU in its random sparsifiers loses nothing), and task vectors whose magnitudes are distinct and
nonzero within each rank (magnitude rankings have no ties, so sort stability cannot matter).

Randomised methods (dare, della): mergekit draws its masks with ``torch.bernoulli(p)``; here that call
is replaced, for mergekit's calls only, by ``u < p`` with u the uniforms of shardfuse's own stream for
that rank and tensor (``stream_seed(seed, rank, name)``), the rule shardfuse applies. Everything else
(the probabilities, the masking, the sign election, the sums) is mergekit's code. della's result is
compared where its rescaling convention can be matched (density 1, and epsilon 0 where 1 / p is one
factor); with epsilon > 0 shardfuse divides each kept entry by its own p (the paper) while mergekit
rescales by one l1 factor or not at all, so only the masks are compared: mergekit's keep
probabilities against shardfuse's and the kept entries under the same uniforms.

A last table shows, on small constructed inputs, the conventions that differ (never a failure).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import math
import platform
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from unittest import mock

import numpy as np
import torch
from mergekit.merge_methods import merge_tensors
from mergekit.merge_methods.karcher import karcher_merge_tensors

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.plan import TensorJob, stream_seed
from shardfuse.fusion.methods.registry import make_plan, rank_weights, resolve_params, uses_base

SHAPES = ((1000,), (64, 48), ())
GRID = 2.0**-24  # every input is k * GRID with |k| < 2^23: exact in float32, and so is theta - base
TOLERANCE_ULPS = 0.5
NAME = "tensor"  # the tensor name that seeds shardfuse's random streams
Tensors = list[torch.Tensor]


# ---------------------------------------------------------------- inputs and measures


def grid(values: np.ndarray) -> np.ndarray:
    """Round to multiples of GRID below 0.5 in magnitude."""
    return np.clip(np.round(values / GRID), -(2**23 - 1), 2**23 - 1) * GRID


def distinct_magnitudes(tau: np.ndarray, gen: np.random.Generator) -> np.ndarray:
    """Redraw entries until |tau| has no zero and no repeated value."""
    while True:
        order = np.argsort(np.abs(tau), kind="stable")
        ordered = np.abs(tau)[order]
        redraw = np.concatenate([order[:1][ordered[:1] == 0], order[1:][ordered[1:] == ordered[:-1]]])
        if not len(redraw):
            return tau
        tau[redraw] = grid(0.05 * gen.standard_normal(len(redraw)))


def make_inputs(
    shape: tuple[int, ...], num_ranks: int, seed: int, independent: bool
) -> tuple[np.ndarray, list[np.ndarray]]:
    """float32 base and ranks: theta_i = base + tau_i (or tau_i alone when ``independent``); the tau_i
    share a component (correlation about 0.26, so model_stock's mean cosine is positive)."""
    gen = np.random.default_rng(seed)
    n = math.prod(shape)
    base = grid(0.1 * gen.standard_normal(n))
    common = gen.standard_normal(n)
    taus = [
        distinct_magnitudes(grid(0.03 * common + 0.05 * gen.standard_normal(n)), gen)
        for _ in range(num_ranks)
    ]
    ranks = [tau if independent else base + tau for tau in taus]
    return base.astype(np.float32).reshape(shape), [r.astype(np.float32).reshape(shape) for r in ranks]


def ulps(actual: np.ndarray, reference: np.ndarray) -> float:
    """Largest |actual - reference| in float32 ulps of the reference value's binade."""
    actual, reference = np.asarray(actual, np.float64), np.asarray(reference, np.float64)
    _, exponent = np.frexp(np.abs(reference))  # |r| = m 2^e, m in [0.5, 1): ulp = 2^(e - 24)
    ulp = np.where(reference == 0, 2.0**-149, np.ldexp(1.0, np.maximum(exponent - 24, -149)))
    return float(np.max(np.abs(actual - reference) / ulp, initial=0.0))


# ---------------------------------------------------------------- mergekit, conventions matched


def mk(method: str, ranks: Tensors, base: torch.Tensor | None = None, **parameters: Any) -> torch.Tensor:
    """mergekit's registered method on one tensor group (the base first when given)."""
    inputs = ranks if base is None else [base, *ranks]
    return merge_tensors(inputs, method, parameters=parameters, base_index=None if base is None else 0)


def disjoint(
    method: str, ranks: Tensors, base: torch.Tensor, factor: float, **parameters: Any
) -> torch.Tensor:
    """A sign-electing task arithmetic method as shardfuse's disjoint mean times ``factor``: weight 1,
    normalize on, rescale off, lambda = factor."""
    return mk(
        method, ranks, base, weight=1.0, normalize=True, rescale=False, **{"lambda": factor}, **parameters
    )


def mk_uniform(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("linear", ranks, weight=1.0)


def mk_weighted(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("linear", ranks, weight=p["weights"])


def mk_task_arithmetic(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("task_arithmetic", ranks, base, weight=p["scale"] / len(ranks))


def mk_ties(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return disjoint("ties", ranks, base, p["scale"], density=p["density"])


def mk_dare(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    density = p["density"]
    if p["sign_election"]:  # the disjoint mean of the unscaled kept values, times scale / density
        return disjoint("dare_ties", ranks, base, p["scale"] / density, density=density)
    weight = 1.0 / (density * len(ranks))  # sum_i weight * kept tau_i = mean_i of kept tau_i / density
    return mk(
        "dare_linear", ranks, base, weight=weight, rescale=False, density=density, **{"lambda": p["scale"]}
    )


def mk_slerp(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return merge_tensors(ranks, "slerp", parameters={"t": p["t"]}, base_index=0)


def mk_model_stock(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("model_stock", ranks, base, filter_wise=False)


def mk_breadcrumbs(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    weight = p["scale"] / len(ranks)
    return mk("breadcrumbs", ranks, base, weight=weight, density=p["density"], gamma=p["gamma"])


def mk_breadcrumbs_ties(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return disjoint("breadcrumbs_ties", ranks, base, p["scale"], density=p["density"], gamma=p["gamma"])


def mk_della(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    """At density 1 nothing is dropped; at epsilon 0 every keep probability is density, so shardfuse's
    1 / p is the one factor lambda = scale / density."""
    density, epsilon = p["density"], p["epsilon"]
    if density < 1 and epsilon != 0:
        raise ValueError("della's result is compared at density 1 or epsilon 0 only")
    return disjoint("della", ranks, base, p["scale"] / density, density=density, epsilon=epsilon)


def mk_sce(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    if p["scale"] != 1:
        raise ValueError("mergekit's sce has no scale")
    return mk("sce", ranks, base, select_topk=p["topk"])


def mk_nuslerp(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("nuslerp", ranks, weight=[1 - p["t"], p["t"]], nuslerp_flatten=True)


def mk_multislerp(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    return mk("multislerp", ranks, weight=p["weights"] or 1.0)


def mk_karcher(ranks: Tensors, base: torch.Tensor | None, p: dict[str, Any]) -> torch.Tensor:
    """Equal weights: the registered method (it has no weights); else its function with the
    normalised weights as alphas."""
    if p["weights"] is None:
        return mk("karcher", ranks, max_iter=p["max_iter"], tol=p["tol"])
    alphas = [w / sum(p["weights"]) for w in p["weights"]]
    return karcher_merge_tensors(ranks, alphas, max_iter=p["max_iter"], tol=p["tol"])


@dataclass(frozen=True)
class Check:
    """One shardfuse method (``label``) against its mergekit counterpart, conventions matched."""

    label: str
    method: str  # shardfuse's
    settings: tuple[dict[str, Any], ...]  # shardfuse parameters; weights "ramp"/"random" made concrete
    mergekit: Callable[[Tensors, torch.Tensor | None, dict[str, Any]], torch.Tensor]
    match: str  # mergekit's function and how its convention is matched
    ranks: tuple[int, ...] = (2, 4)
    independent: bool = False  # also ranks that share no base (the base-free methods)
    shared_uniforms: bool = False  # mergekit's torch.bernoulli draws from shardfuse's streams
    flatten: bool = False  # mergekit sees the flattened tensor (it ranks row by row otherwise)
    shapes: tuple[tuple[int, ...], ...] = SHAPES


BREADCRUMBS_SETTINGS = (
    {"density": 0.5},
    {"density": 0.2, "gamma": 0.05, "scale": 0.7},
    {"density": 0.9, "gamma": 0.2},
)
CHECKS = (
    Check("uniform", "uniform", ({},), mk_uniform, "linear, weight 1 each", independent=True),
    Check(
        "weighted",
        "weighted",
        ({"weights": "ramp"}, {"weights": "random"}),
        mk_weighted,
        "linear, the same weights (normalize on)",
        independent=True,
    ),
    Check(
        "task_arithmetic",
        "task_arithmetic",
        ({"scale": 1.0}, {"scale": 0.7}),
        mk_task_arithmetic,
        "task_arithmetic, weight scale / N",
    ),
    Check(
        "ties",
        "ties",
        ({"density": 0.5}, {"density": 0.2, "scale": 1.3}),
        mk_ties,
        "ties, weight 1, lambda scale; density * numel with fraction < 0.5, so k rounds alike",
    ),
    Check(
        "dare",
        "dare",
        ({"density": 0.5}, {"density": 0.25, "seed": 3, "scale": 0.8}),
        mk_dare,
        "dare_linear, rescale off, weight 1 / (N density), lambda scale; same uniforms",
        shared_uniforms=True,
    ),
    Check(
        "dare (sign_election)",
        "dare",
        ({"density": 0.5, "sign_election": True}, {"density": 0.25, "seed": 3, "sign_election": True}),
        mk_dare,
        "dare_ties, rescale off, normalize on, weight 1, lambda scale / density; same uniforms",
        shared_uniforms=True,
    ),
    Check(
        "slerp",
        "slerp",
        ({"t": 0.3}, {"t": 0.75}),
        mk_slerp,
        "slerp with rank 0 as its base input, the same t",
        ranks=(2,),
        independent=True,
    ),
    Check(
        "model_stock",
        "model_stock",
        ({},),
        mk_model_stock,
        "model_stock, filter_wise off; inputs whose mean cosine is > 0",
    ),
    Check(
        "breadcrumbs",
        "breadcrumbs",
        BREADCRUMBS_SETTINGS,
        mk_breadcrumbs,
        "breadcrumbs, weight scale / N, the same density and gamma",
    ),
    Check(
        "breadcrumbs_ties",
        "breadcrumbs_ties",
        BREADCRUMBS_SETTINGS,
        mk_breadcrumbs_ties,
        "breadcrumbs_ties, weight 1, normalize on (default off), lambda scale",
    ),
    Check(
        "della",
        "della",
        (
            {"density": 1.0},
            {"density": 1.0, "scale": 0.6},
            {"density": 0.5, "epsilon": 0.0},
            {"density": 0.25, "epsilon": 0.0, "seed": 5, "scale": 0.8},
        ),
        mk_della,
        "della, weight 1, normalize on, rescale off, lambda scale / density, flattened; density 1 or "
        "epsilon 0; same uniforms",
        shared_uniforms=True,
        flatten=True,
        shapes=((1000,), (64, 48)),
    ),
    Check(
        "sce",
        "sce",
        ({"topk": 1.0}, {"topk": 0.5}, {"topk": 0.2}),
        mk_sce,
        "sce, select_topk = topk; scale 1",
    ),
    Check(
        "nuslerp",
        "nuslerp",
        ({"t": 0.5}, {"t": 0.3}),
        mk_nuslerp,
        "nuslerp without base, weights (1 - t, t), nuslerp_flatten on",
        ranks=(2,),
        independent=True,
    ),
    Check(
        "multislerp",
        "multislerp",
        ({"weights": None}, {"weights": "random"}),
        mk_multislerp,
        "multislerp without base, the same weights",
        independent=True,
        # Not 1-element tensors: with opposite signs the weighted mean of the unit vectors (+-1) is
        # ~1e-8, mergekit's epsilon only, and its direction arbitrary in both tools (the differences
        # table shows one such case).
        shapes=((1000,), (64, 48)),
    ),
    Check(
        "karcher",
        "karcher",
        ({}, {"max_iter": 50, "tol": 1e-9}, {"weights": "random"}),
        mk_karcher,
        "karcher (equal weights); weighted: karcher_merge_tensors, alphas = normalised weights",
        independent=True,
    ),
)

NOT_COMPARED = (
    ("consolidate", "no counterpart: rank 0 after a tolerance check (mergekit's passthrough checks nothing)"),
    (
        "greedy_soup",
        "the selection on the validation split has no counterpart; its math is uniform's (above)",
    ),
    (
        "della, epsilon > 0",
        "result not compared: shardfuse divides each kept entry by its own p (the paper), mergekit "
        "rescales the kept task vector by one l1 factor (rescale on, its default) or not at all; its "
        "masks are compared below",
    ),
    ("della on a 0-dim or 1-element tensor", "mergekit fails (IndexError; NaN keep probability)"),
    ("sce, scale != 1", "mergekit's sce has no lambda"),
)


def concrete(given: dict[str, Any], num_ranks: int, gen: np.random.Generator) -> dict[str, Any]:
    """The placeholders "ramp" and "random" made weights for num_ranks ranks."""
    params = dict(given)
    if params.get("weights") == "ramp":
        params["weights"] = [float(i + 1) for i in range(num_ranks)]
    elif params.get("weights") == "random":
        params["weights"] = [float(w) for w in gen.uniform(0.2, 2.0, num_ranks)]
    return params


# ---------------------------------------------------------------- shared random draws


def shard_uniforms(seed: int, num_ranks: int, n: int) -> list[np.ndarray]:
    """The uniforms shardfuse's dare and della draw for each rank of tensor NAME (one block)."""
    return [stream_seed(seed, rank, NAME).random(n) for rank in range(num_ranks)]


@contextlib.contextmanager
def bernoulli_from(uniforms: list[np.ndarray]) -> Iterator[list[tuple[torch.Tensor, torch.Tensor]]]:
    """While active, torch.bernoulli(p) is u < p with u the next rank's uniforms (mergekit sparsifies
    the ranks in input order). Yields the list of (p, mask) pairs mergekit drew."""
    drawn: list[tuple[torch.Tensor, torch.Tensor]] = []
    queue = iter(uniforms)

    def bernoulli(probs: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        draws = torch.from_numpy(next(queue)).reshape(probs.shape)
        mask = (draws < probs.double()).to(probs.dtype)
        drawn.append((probs.detach().clone(), mask))
        return mask

    with mock.patch.object(torch, "bernoulli", bernoulli):
        yield drawn
    if len(drawn) not in (0, len(uniforms)):
        raise AssertionError(f"mergekit drew {len(drawn)} masks for {len(uniforms)} ranks")


# ---------------------------------------------------------------- matched results


@dataclass
class Outcome:
    check: Check
    detail: str
    abs_diff: float
    ulps32: float
    diff64: float  # shardfuse in float64 against mergekit in float64
    mergekit32: float  # mergekit in float32 against itself in float64
    values: str  # the worst entry: shardfuse (float32), mergekit (float64)

    @property
    def passed(self) -> bool:
        return self.ulps32 <= TOLERANCE_ULPS


def run_shardfuse(
    check: Check, ranks: list[np.ndarray], base: np.ndarray, params: dict, dtype: type
) -> np.ndarray:
    """merge_arrays on the inputs cast to ``dtype`` (float32: float64 math, rounded to float32)."""
    weights = rank_weights(check.method, params, [1] * len(ranks))
    base_array = base.astype(dtype) if uses_base(check.method) else None
    merged, _ = merge_arrays(
        check.method, params, [r.astype(dtype) for r in ranks], base_array, NAME, weights
    )
    return merged


def run_mergekit(
    check: Check, ranks: list[np.ndarray], base: np.ndarray, params: dict, dtype: type
) -> np.ndarray:
    """The check's mergekit call on the inputs cast to ``dtype``, as float64 in the inputs' shape."""

    def tensor(array: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(array.astype(dtype).reshape(-1) if check.flatten else array.astype(dtype))

    base_tensor = tensor(base) if uses_base(check.method) else None
    draws = (
        bernoulli_from(shard_uniforms(params["seed"], len(ranks), base.size))
        if check.shared_uniforms
        else contextlib.nullcontext()
    )
    with draws, torch.no_grad():
        merged = check.mergekit([tensor(r) for r in ranks], base_tensor, params)
    return merged.numpy().astype(np.float64).reshape(ranks[0].shape)


def run_case(
    check: Check, given: dict, num_ranks: int, shape: tuple, independent: bool, seed: int
) -> Outcome:
    """Both sides on one seeded input; the float32 result is judged against mergekit's float64."""
    base, ranks = make_inputs(shape, num_ranks, seed, independent)
    params = resolve_params(
        check.method, concrete(given, num_ranks, np.random.default_rng(seed)), [1] * num_ranks
    )
    shard32 = run_shardfuse(check, ranks, base, params, np.float32)
    shard64 = run_shardfuse(check, ranks, base, params, np.float64)
    reference = run_mergekit(check, ranks, base, params, np.float64)
    mergekit32 = run_mergekit(check, ranks, base, params, np.float32)
    if shard32.dtype != np.float32 or shard32.shape != shape:
        raise AssertionError(f"shardfuse returned {shard32.dtype} {shard32.shape} for float32 {shape}")
    worst = np.unravel_index(np.argmax(np.abs(shard32 - reference)), shape) if shape else ()
    inputs = f" inputs {[float(r) for r in ranks]}" if not shape else ""
    return Outcome(
        check,
        f"{given} N={num_ranks} shape={shape}{' independent' if independent else ''}{inputs}",
        float(np.max(np.abs(shard32.astype(np.float64) - reference), initial=0.0)),
        ulps(shard32, reference),
        float(np.max(np.abs(shard64 - reference), initial=0.0)),
        float(np.max(np.abs(mergekit32 - reference), initial=0.0)),
        f"shardfuse {float(shard32[worst]):.9g}, mergekit {float(reference[worst]):.9g}",
    )


def cases(check: Check) -> Iterator[tuple[dict, int, tuple, bool]]:
    """(parameters, N, shape, independent) for every case of ``check``."""
    for given in check.settings:
        for num_ranks in check.ranks:
            for shape in check.shapes:
                for independent in (False, True) if check.independent else (False,):
                    yield given, num_ranks, shape, independent


# ---------------------------------------------------------------- della's masks (epsilon > 0)

DELLA_MASK_SETTINGS = ({"density": 0.5, "epsilon": 0.15}, {"density": 0.3, "epsilon": 0.1, "seed": 5})
PROBABILITY_ULPS = 4.0  # mergekit evaluates the keep probability in float32: a few roundings


@dataclass
class MaskOutcome:
    detail: str
    entries: int
    mismatched: int
    probability_ulps: float
    kept_shardfuse: float
    kept_mergekit: float

    @property
    def passed(self) -> bool:
        return self.mismatched == 0 and self.probability_ulps <= PROBABILITY_ULPS


def della_masks(given: dict, num_ranks: int, shape: tuple, seed: int) -> MaskOutcome:
    """shardfuse's della keep probabilities and masks against mergekit's della_magprune's under the
    same uniforms (mergekit on the flattened tensor, since it ranks row by row)."""
    base, ranks = make_inputs(shape, num_ranks, seed, independent=False)
    params = resolve_params("della", given, [1] * num_ranks)
    base64 = base.astype(np.float64).ravel()
    taus = [r.astype(np.float64).ravel() - base64 for r in ranks]
    plan = make_plan("della", params, TensorJob(NAME, base.size, list(range(num_ranks))))
    for index, rank in enumerate(ranks):
        plan.scan_rank(index, 0, rank.astype(np.float64).ravel(), base64)
        plan.end_rank(index)
    uniforms = shard_uniforms(params["seed"], num_ranks, base.size)
    with bernoulli_from(uniforms) as drawn, torch.no_grad():
        tensors = [torch.from_numpy(r.astype(np.float64).ravel()) for r in ranks]
        mk(
            "della",
            tensors,
            torch.from_numpy(base64),
            weight=1.0,
            density=params["density"],
            epsilon=params["epsilon"],
        )
    mismatched, probability_ulps = 0, 0.0
    for index, (probs, mask) in enumerate(drawn):
        order = np.empty(base.size, dtype=np.int64)
        order[np.argsort(np.abs(taus[index]), kind="stable")] = np.arange(base.size)
        probability_ulps = max(probability_ulps, ulps(probs.numpy().ravel(), plan.probability(order)))
        mismatched += int(np.count_nonzero((plan.kept_rank[index] >= 0) != (mask.numpy().ravel() > 0)))
    return MaskOutcome(
        f"{given} N={num_ranks} shape={shape}",
        base.size * num_ranks,
        mismatched,
        probability_ulps,
        float(np.mean([plan.kept_rank[i] >= 0 for i in range(num_ranks)])),
        float(np.mean([mask.numpy() > 0 for _, mask in drawn])),
    )


# ---------------------------------------------------------------- conventions that differ


def f64(*values: Any) -> list[np.ndarray]:
    """float64 arrays of ``values``."""
    return [np.asarray(v, dtype=np.float64) for v in values]


def t64(arrays: list[np.ndarray]) -> Tensors:
    """Tensors sharing the arrays' memory."""
    return [torch.from_numpy(a) for a in arrays]


def shard(method: str, given: dict, ranks: list[np.ndarray], base: np.ndarray | None = None) -> np.ndarray:
    """shardfuse's merge of in-memory arrays."""
    return merge_arrays(method, resolve_params(method, given, [1] * len(ranks)), ranks, base, NAME)[0]


def show(values: Any) -> str:
    """A short rendering of an array."""
    return np.array2string(np.asarray(values), precision=4, separator=", ", threshold=8)


def differences() -> list[tuple[str, str, str, str]]:
    """(case, shardfuse, mergekit, why) on small constructed inputs."""
    rows = []
    base, ranks = np.zeros(2), f64([1, 2], [-1, 1])
    rows.append(
        (
            "ties, kept values summing to exactly 0 (entry 0: +1 and -1), density 1",
            show(shard("ties", {"density": 1.0}, ranks, base)),
            show(mk_ties(t64(ranks), torch.from_numpy(base), {"density": 1.0, "scale": 1.0}).numpy()),
            "no sign elected, 0 (ours) vs + elected (sum >= 0), mean of the positive values",
        )
    )
    base, ranks = np.zeros(5), f64(np.arange(1.0, 6.0))
    rows.append(
        (
            "ties, k for density 0.3 of 5 entries (1.5), one rank",
            show(shard("ties", {"density": 0.3}, ranks, base)),
            show(mk_ties(t64(ranks), torch.from_numpy(base), {"density": 0.3, "scale": 1.0}).numpy()),
            "k = round(1.5) = 2 (ours) vs int(1.5) = 1",
        )
    )
    base, ranks = np.zeros(2), f64([1, 0], [-1, 0.5])
    rows.append(
        (
            "model_stock, mean cosine < 0 (-0.894), N = 2",
            show(shard("model_stock", {}, ranks, base)),
            show(mk_model_stock(t64(ranks), torch.from_numpy(base), {}).numpy()),
            "cosine clamped to [0, 1]: t = 0, the base (ours) vs t = 2c / (1 + c) = -16.9",
        )
    )
    ranks = f64([1, 0], [-1, 0], [0, 1], [0, -1])
    try:
        theirs = show(mk_multislerp(t64(ranks), None, {"weights": None}).numpy())
    except ValueError as error:
        theirs = f"ValueError: {str(error)[:40]}..."
    rows.append(
        (
            "multislerp, two antipodal pairs (weighted mean of units is 0), N = 4",
            show(shard("multislerp", {}, ranks)),
            theirs,
            "the weighted mean (ours); mergekit falls back to it for N = 2 only",
        )
    )
    ranks = f64([0.05464065074920654], [-0.028199970722198486])
    rows.append(
        (
            "multislerp, one element, opposite signs, N = 2, equal weights",
            show(shard("multislerp", {}, ranks)),
            show(mk_multislerp(t64(ranks), None, {"weights": None}).numpy()),
            "mean of units ~1e-8: its length from the Gram form (ours) loses digits, 1e-3 relative",
        )
    )
    gen = np.random.default_rng(1)
    base, ranks = gen.standard_normal(1000), [gen.standard_normal(1000) for _ in range(2)]
    with bernoulli_from(shard_uniforms(0, 2, 1000)):
        theirs = mk("dare_linear", t64(ranks), torch.from_numpy(base), weight=0.5, density=0.5).numpy()
    ours = shard("dare", {"density": 0.5}, ranks, base)
    rows.append(
        (
            "dare_linear with mergekit's default rescale (l1), density 0.5, same uniforms",
            f"max abs diff {np.max(np.abs(ours - theirs)):.3g}",
            "-",
            "kept entries / density (ours, the paper) vs the kept task vector rescaled to the l1 norm",
        )
    )
    a, b = gen.standard_normal((64, 48)), gen.standard_normal((64, 48))
    theirs = mk("nuslerp", t64([a, b]), weight=[0.5, 0.5], nuslerp_flatten=False).numpy()
    rows.append(
        (
            "nuslerp with nuslerp_flatten off (row-wise), 64 x 48, t = 0.5",
            f"max abs diff {np.max(np.abs(shard('nuslerp', {'t': 0.5}, [a, b]) - theirs)):.3g}",
            "-",
            "whole-tensor angle (ours, mergekit's flatten, its default) vs one angle per row",
        )
    )
    return rows


# ---------------------------------------------------------------- report


def table(header: list[str], rows: list[list[str]]) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--verbose", action="store_true", help="one line per case")
    parser.add_argument("--seed", type=int, default=0, help="seed of the first case's inputs")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    print(
        f"mergekit {importlib.metadata.version('mergekit')}, torch {torch.__version__}, "
        f"numpy {np.__version__}, python {platform.python_version()}\n"
    )

    rows, failed, failing, seed = [], [], [], args.seed
    for check in CHECKS:
        outcomes = []
        for given, num_ranks, shape, independent in cases(check):
            outcomes.append(run_case(check, given, num_ranks, shape, independent, seed))
            seed += 1
            if args.verbose:
                o = outcomes[-1]
                print(f"  {check.label:22} {o.detail:70} {o.ulps32:.3f} ulp {'PASS' if o.passed else 'FAIL'}")
        passed = all(o.passed for o in outcomes)
        failing += [o for o in outcomes if not o.passed]
        failed += [] if passed else [check.label]
        rows.append(
            [
                check.label,
                check.match,
                str(len(outcomes)),
                f"{max(o.abs_diff for o in outcomes):.3g}",
                f"{max(o.ulps32 for o in outcomes):.3f}",
                f"{max(o.diff64 for o in outcomes):.2g}",
                f"{max(o.mergekit32 for o in outcomes):.2g}",
                "PASS" if passed else "FAIL",
            ]
        )
    print("Matched conventions: shardfuse (float32 out) against mergekit (float64)\n")
    header = ["method", "mergekit, conventions matched", "cases", "max abs diff", "max f32 ulps"]
    print(table([*header, "f64: max abs diff", "mergekit in f32: max abs diff", "<= 0.5 ulp"], rows))
    if failing:
        print("\nCases beyond 0.5 ulp (worst entry)\n")
        for o in failing:
            print(f"- {o.check.label} {o.detail}: {o.ulps32:.4g} ulps, {o.values}")

    masks = []
    for given in DELLA_MASK_SETTINGS:
        for num_ranks in (2, 4):
            for shape in ((1000,), (64, 48)):
                masks.append(della_masks(given, num_ranks, shape, seed))
                seed += 1
    failed += [] if all(m.passed for m in masks) else ["della masks"]
    print("\ndella with epsilon > 0: masks under the same uniforms (mergekit on the flattened tensor)\n")
    mask_rows = [
        [
            m.detail,
            str(m.entries),
            str(m.mismatched),
            f"{m.probability_ulps:.1f}",
            f"{m.kept_shardfuse:.4f} / {m.kept_mergekit:.4f}",
            "PASS" if m.passed else "FAIL",
        ]
        for m in masks
    ]
    header = ["case", "entries", "masks differ", "keep prob. (f32 ulps)", "kept shardfuse / mergekit"]
    print(table([*header, f"same masks, p <= {PROBABILITY_ULPS:g} ulps"], mask_rows))

    print("\nNot compared\n")
    print(table(["method", "why"], [list(row) for row in NOT_COMPARED]))
    print("\nConventions that differ (shown, never a failure)\n")
    print(table(["case", "shardfuse", "mergekit", "why"], [list(row) for row in differences()]))

    print(f"\n{time.perf_counter() - started:.1f} s")
    if failed:
        print(f"FAIL: {', '.join(failed)}")
        return 1
    print("PASS: every matched method within 0.5 float32 ulp of mergekit")
    return 0


if __name__ == "__main__":
    sys.exit(main())
