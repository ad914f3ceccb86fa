"""The newer fusion methods (breadcrumbs, breadcrumbs_ties, della, sce, nuslerp, multislerp, karcher)
against references written from the published formulas (and mergekit's conventions where they differ),
their properties, their parameters' one-line errors, and the real merge CLI streaming them."""

from __future__ import annotations

import math
import re

import numpy as np
import pytest
import torch

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.plan import stream_seed
from shardfuse.fusion.methods.registry import names, resolve_params, uses_base
from shardfuse.io import UserError
from shardfuse.merge import merge
from tests.support.fusion import CASES, NEW_METHODS, expected_of, train_dir


def ranks_and_base(num_ranks, size=60, seed=0):
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(size) for _ in range(num_ranks)], gen.standard_normal(size)


def close(actual, expected):
    np.testing.assert_allclose(actual, expected, rtol=1e-6, atol=1e-9)


def merged64(method, given, ranks, base=None, name="tensor"):
    p = resolve_params(method, given, [1] * len(ranks))
    return merge_arrays(method, p, [np.asarray(r, np.float64) for r in ranks], base, name)


# ---------------------------------------------------------------- references (from the papers' equations)


def disjoint_mean(taus):
    """TIES: elect the sign of the sum, mean of the nonzero values of that sign (0 where the sum is 0)."""
    out = np.zeros(len(taus[0]))
    for j in range(len(out)):
        total = sum(tau[j] for tau in taus)
        sign = np.sign(total)
        agreeing = [tau[j] for tau in taus if sign != 0 and np.sign(tau[j]) == sign]
        out[j] = sum(agreeing) / len(agreeing) if agreeing else 0.0
    return out


def breadcrumbs_mask(tau, density, gamma):
    """Model Breadcrumbs: drop the gamma largest-magnitude entries and the smallest so density remain."""
    n = tau.size
    if density >= 1:
        return np.ones(n, dtype=bool)
    target, top = int(density * n), int(gamma * n)
    bottom = n - target - top
    if bottom < 0:
        top, bottom = top + bottom, 0
    ascending = sorted(range(n), key=lambda j: (abs(tau[j]), j))
    mask = np.zeros(n, dtype=bool)
    mask[ascending[bottom : n - top]] = True
    return mask


def reference_breadcrumbs(ranks, base, density, gamma, scale, ties):
    taus = [np.where(breadcrumbs_mask(r - base, density, gamma), r - base, 0.0) for r in ranks]
    merged = disjoint_mean(taus) if ties else sum(taus) / len(taus)
    return base + scale * merged


def reference_della(ranks, base, density, epsilon, seed, scale, name="tensor"):
    """DELLA MagPrune: keep probability rising linearly with magnitude rank over density +- epsilon."""
    taus = []
    for rank, theta in enumerate(ranks):
        tau = theta - base
        n = tau.size
        ascending = sorted(range(n), key=lambda j: (abs(tau[j]), j))
        order = np.empty(n)
        for position, j in enumerate(ascending):
            order[j] = position
        keep_probability = density - epsilon + 2 * epsilon * order / (n - 1)
        draws = stream_seed(seed, rank, name).random(n)
        taus.append(np.where(draws < keep_probability, tau / keep_probability, 0.0))
    return base + scale * disjoint_mean(taus)


def reference_sce(ranks, base, topk, scale):
    """FuseChat-2 SCE in plain torch: select by variance, weights by mean square, erase minority signs."""
    tvs = torch.tensor(np.stack(ranks) - base)
    if topk < 1:
        var = torch.var(tvs, dim=0, unbiased=False)
        k = int(int(torch.count_nonzero(var)) * topk)
        order = sorted(range(var.numel()), key=lambda j: (-float(var[j]), j))[:k]
        mask = torch.zeros_like(var)
        mask[order] = 1
        tvs = tvs * mask
    weights = torch.mean(tvs**2, dim=1)
    weights = weights / weights.sum() if float(weights.sum()) >= 1e-6 else torch.ones(len(ranks)) / len(ranks)
    majority = torch.where(tvs.sum(dim=0) >= 0, 1.0, -1.0)
    erased = weights[:, None] * (torch.sign(tvs) == majority).double()
    merged = (tvs * erased).sum(dim=0) / erased.sum(dim=0).clamp(min=1e-6)
    return base + scale * merged.numpy()


def reference_nuslerp(a, b, t):
    """mergekit nuslerp, flattened: slerp of the raw vectors, linear where sin(theta) < 1e-8."""
    unit_a, unit_b = a / max(np.linalg.norm(a), 1e-7), b / max(np.linalg.norm(b), 1e-7)
    theta = np.arccos(np.clip(unit_a @ unit_b, -1, 1))
    if abs(np.sin(theta)) < 1e-8:
        return (1 - t) * a + t * b
    return (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)


def reference_multislerp(ranks, weights):
    w = np.asarray(weights) / np.sum(weights)
    norms = np.array([np.linalg.norm(r) for r in ranks])
    mean = sum(wi * r / (n + 1e-8) for wi, r, n in zip(w, ranks, norms, strict=True))
    return mean / np.linalg.norm(mean) * float(w @ norms)


def reference_karcher(ranks, weights, max_iter, tol):
    """Karcher mean on the unit sphere: exp/log maps in the full space, as mergekit's loop."""
    norms = [np.linalg.norm(r) for r in ranks]
    valid = [i for i, n in enumerate(norms) if n >= tol]
    units = [ranks[i] / norms[i] for i in valid]
    w = np.array([weights[i] for i in valid]) / sum(weights[i] for i in valid)
    u = sum(wi * ui for wi, ui in zip(w, units, strict=True))
    u = u / np.linalg.norm(u)
    for _ in range(max_iter):
        step = np.zeros_like(u)
        for wi, ui in zip(w, units, strict=True):
            cos = np.clip(u @ ui, -1, 1)
            theta = np.arccos(cos)
            if theta >= tol:
                step += wi * theta / np.sin(theta) * (ui - cos * u)
        length = np.linalg.norm(step)
        if length < tol:
            break
        u = np.cos(length) * u + np.sin(length) * step / length
        u = u / np.linalg.norm(u)
    return sum(wi * n for wi, n in zip(weights, norms, strict=True)) / sum(weights) * u


# ---------------------------------------------------------------- each method vs its reference


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize(("density", "gamma"), [(0.9, 0.01), (0.5, 0.1), (0.3, 0.8), (1.0, 0.2), (0.05, 0.0)])
def test_breadcrumbs_match_the_published_masks(ties, density, gamma):
    ranks, base = ranks_and_base(3)
    method = "breadcrumbs_ties" if ties else "breadcrumbs"
    merged, _ = merged64(method, {"density": density, "gamma": gamma, "scale": 0.7}, ranks, base)
    close(merged, reference_breadcrumbs(ranks, base, density, gamma, 0.7, ties))


def test_breadcrumbs_place_equal_magnitudes_in_flat_order():
    gen = np.random.default_rng(2)
    ranks, base = [gen.integers(-2, 3, 61).astype(np.float64) for _ in range(3)], np.zeros(61)
    for method in ("breadcrumbs", "breadcrumbs_ties"):
        merged, _ = merged64(method, {"density": 0.5, "gamma": 0.1}, ranks, base)
        close(merged, reference_breadcrumbs(ranks, base, 0.5, 0.1, 1.0, method.endswith("ties")))


@pytest.mark.parametrize(("density", "epsilon", "seed"), [(0.5, 0.2, 0), (0.7, 0.15, 3), (0.3, 0.0, 9)])
def test_della_matches_magprune_with_the_ties_merge(density, epsilon, seed):
    ranks, base = ranks_and_base(3)
    merged, _ = merged64("della", {"density": density, "epsilon": epsilon, "seed": seed}, ranks, base, "w")
    close(merged, reference_della(ranks, base, density, epsilon, seed, 1.0, "w"))


def test_della_is_deterministic_per_seed_and_differs_across_seeds():
    ranks, base = ranks_and_base(4, size=200)
    first, _ = merged64("della", {"density": 0.5, "seed": 7}, ranks, base)
    again, _ = merged64("della", {"density": 0.5, "seed": 7}, ranks, base)
    other, _ = merged64("della", {"density": 0.5, "seed": 8}, ranks, base)
    assert np.array_equal(first, again) and not np.array_equal(first, other)


@pytest.mark.parametrize("topk", [1.0, 0.5, 0.1])
def test_sce_matches_select_calculate_erase(topk):
    ranks, base = ranks_and_base(4)
    merged, stats = merged64("sce", {"topk": topk, "scale": 1.3}, ranks, base)
    close(merged, reference_sce(ranks, base, topk, 1.3))
    assert math.fsum(stats["weights"]) == pytest.approx(1.0)


@pytest.mark.parametrize("t", [0.0, 0.25, 0.5, 0.9, 1.0])
def test_nuslerp_matches_mergekits_flattened_nuslerp(t):
    (a, b), _ = ranks_and_base(2)
    merged, _ = merged64("nuslerp", {"t": t}, [a, b])
    close(merged, reference_nuslerp(a, b, t))
    close(merged64("nuslerp", {"t": t}, [a, -2 * a])[0], (1 - t) * a + t * (-2 * a))  # antiparallel: lerp


@pytest.mark.parametrize("weights", [None, [1.0, 2.0, 3.0, 0.5]])
def test_multislerp_matches_the_normalised_weighted_mean_projected_back(weights):
    ranks, _ = ranks_and_base(4)
    merged, _ = merged64("multislerp", {"weights": weights}, ranks)
    close(merged, reference_multislerp(ranks, weights or [1.0] * 4))


@pytest.mark.parametrize(("weights", "max_iter", "tol"), [(None, 10, 1e-5), ([1.0, 3.0, 2.0], 50, 1e-9)])
def test_karcher_matches_the_iterated_riemannian_mean(weights, max_iter, tol):
    ranks, _ = ranks_and_base(3, size=30)
    given = {"weights": weights, "max_iter": max_iter, "tol": tol}
    merged, stats = merged64("karcher", given, ranks)
    close(merged, reference_karcher(ranks, weights or [1.0] * 3, max_iter, tol))
    assert stats["iterations"] >= 1


@pytest.mark.parametrize(
    ("values", "weights"),
    [
        ([0.07371258735656738, -0.002157747745513916], [1.0, 3.0]),
        ([-0.02306288480758667, 0.06214648485183716, -0.016552209854125977, -0.03622579574584961], None),
        ([0.04140174388885498, -0.05994570255279541, 0.04293304681777954, 0.07212609052658081], [2, 1, 1, 3]),
    ],
)
def test_karcher_of_one_element_tensors_with_mixed_signs(values, weights):
    """A 1-element bias whose ranks disagree in sign (inputs where mergekit 0.1.5 and we once differed).
    On the 0-sphere the unit vectors are +-1: the start (the weighted mean's sign) is already the mean,
    since every log map from it is zero (equal or antipodal), so the result is that sign times the
    weighted mean norm. The Gram form once stepped on a cancelled difference here (garbage, wrong sign)."""
    w = np.asarray(weights or [1.0] * len(values), dtype=np.float64)
    merged, _ = merged64("karcher", {"weights": weights}, [[v] for v in values])
    direction = np.sign(w @ np.sign(values))
    close(merged, [direction * (w @ np.abs(values)) / w.sum()])


# ---------------------------------------------------------------- properties


@pytest.mark.parametrize("method", NEW_METHODS)
@pytest.mark.parametrize("num_ranks", [1, 2, 3])
def test_identical_ranks_give_that_model(method, num_ranks):
    if method == "nuslerp" and num_ranks == 3:
        num_ranks = 2
    theta, base = ranks_and_base(1, seed=5)
    merged, _ = merged64(method, {}, [theta[0]] * num_ranks, base)
    close(merged, theta[0])


def test_breadcrumbs_and_della_at_density_1_are_task_arithmetic_and_ties():
    ranks, base = ranks_and_base(3)
    arithmetic, _ = merged64("task_arithmetic", {}, ranks, base)
    ties, _ = merged64("ties", {"density": 1.0}, ranks, base)
    assert np.array_equal(merged64("breadcrumbs", {"gamma": 0.5}, ranks, base)[0], arithmetic)
    assert np.array_equal(merged64("breadcrumbs_ties", {}, ranks, base)[0], ties)
    assert np.array_equal(merged64("della", {"epsilon": 0.4}, ranks, base)[0], ties)
    # della_linear (mergekit's name): no sign election, the mean of the (here unpruned) task vectors
    assert np.array_equal(merged64("della", {"sign_election": False}, ranks, base)[0], arithmetic)


def test_della_without_sign_election_is_the_mean_of_the_same_pruned_task_vectors():
    ranks, base = ranks_and_base(3, seed=2)
    given = {"density": 0.5, "epsilon": 0.2, "seed": 3}
    elected, stats = merged64("della", given, ranks, base)
    linear, linear_stats = merged64("della", {**given, "sign_election": False}, ranks, base)
    assert stats["kept_fraction"] == linear_stats["kept_fraction"]  # the same draws
    assert not np.array_equal(elected, linear)
    # with one rank the election keeps every kept entry: both are that rank's pruned task vector
    one, _ = merged64("della", given, ranks[:1], base)
    assert np.array_equal(one, merged64("della", {**given, "sign_election": False}, ranks[:1], base)[0])


def test_two_rank_karcher_and_multislerp_agree_on_the_midpoint_direction():
    ranks, _ = ranks_and_base(2)
    karcher, _ = merged64("karcher", {}, ranks)
    multislerp, _ = merged64("multislerp", {}, ranks)
    close(karcher, multislerp)


def test_new_methods_are_registered_and_task_vector_ones_read_the_base():
    assert set(NEW_METHODS) <= set(names())
    assert all(uses_base(method) for method in ("breadcrumbs", "breadcrumbs_ties", "della", "sce"))
    assert not any(uses_base(method) for method in ("nuslerp", "multislerp", "karcher"))


@pytest.mark.parametrize("method", NEW_METHODS)
def test_running_statistics_and_counters_follow_the_engine_rules(method):
    ranks, base = ranks_and_base(2, size=8)
    p = resolve_params(method, {}, [1, 1])
    merged, stats = merge_arrays(method, p, ranks, base, "bn.running_var")
    assert np.array_equal(merged, (ranks[0] + ranks[1]) / 2) and stats["running_statistic"] == "mean"
    counters = [np.array([3, 4])] * 2
    assert np.array_equal(merge_arrays(method, p, counters, base, "bn.num_batches_tracked")[0], counters[0])


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("method", "given", "num_ranks", "message"),
    [
        (
            "breadcrumbs",
            {"density": 0},
            3,
            "merge method breadcrumbs: parameter 'density' must be a number in (0, 1]",
        ),
        ("breadcrumbs", {"gamma": 1.0}, 3, "'gamma' must be a number in [0, 1)"),
        ("della", {"density": 1.5}, 3, "merge method della: parameter 'density' must be a number in (0, 1]"),
        ("della", {"density": 0.9, "epsilon": 0.2}, 3, "della: density +- epsilon must lie in (0, 1)"),
        ("sce", {"topk": 0}, 3, "'topk' must be a number in (0, 1]"),
        ("karcher", {"max_iter": 0}, 3, "'max_iter' must be an integer from 1 to 10000"),
        ("karcher", {"tol": 0}, 3, "'tol' must be a number > 0"),
        ("multislerp", {"weights": [1, 2]}, 3, "'weights' must be a list of positive numbers, one per rank"),
        ("nuslerp", {}, 3, "nuslerp interpolates exactly 2 models but the run has 3 ranks"),
    ],
)
def test_bad_parameters_of_the_new_methods_are_one_line_user_errors(method, given, num_ranks, message):
    with pytest.raises(UserError, match=re.escape(message)) as caught:
        resolve_params(method, given, [10] * num_ranks)
    assert "\n" not in str(caught.value)


def config_of(**run):
    runs = {"r": {"strategy": "localsgd", **run}}
    return {"runs": runs, "datasets": {"digits": {"source": "digits"}}, "run_defaults": {"dataset": "digits"}}


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"merge_method": "nuslerp", "world_size": 4},
            "runs[r].merge_method: nuslerp interpolates exactly 2 models but the run has 4 ranks",
        ),
        (
            {"merge_method": "della", "merge_density": 0.9, "world_size": 2},
            "runs[r].merge_method: merge method della: density +- epsilon must lie in (0, 1) but is "
            "[0.75, 1.05]; lower merge_epsilon",
        ),
        (
            {"merge_method": "multislerp", "merge_weights": [1, 2], "world_size": 4},
            "merge_weights: 2 weights for 4 ranks",
        ),
        ({"merge_method": "breadcrumbs", "merge_density": 0, "world_size": 2}, "merge_density"),
        ({"merge_method": "uniform", "merge_weights": [1, 2], "world_size": 2}, "multislerp or karcher"),
    ],
)
def test_bad_new_merge_keys_stop_the_config_before_any_job(run, message):
    with pytest.raises(ConfigError) as caught:
        load_experiment(config_of(**run), environ={})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_new_merge_keys_reach_only_their_method():
    from shardfuse.experiment.keys import merge_params

    experiment = load_experiment(
        config_of(merge_method="karcher", world_size=2, merge_max_iter=3, merge_gamma=0.2), environ={}
    )
    assert merge_params(experiment.runs["r"]) == {"max_iter": 3, "tol": 1e-5}


# ---------------------------------------------------------------- streaming, and the real CLI


@pytest.mark.parametrize("method", NEW_METHODS)
def test_streaming_by_tiny_blocks_equals_the_whole_tensor_merge(tmp_path, method):
    num_ranks, given = CASES[method]
    base, per_rank, gather_path = train_dir(tmp_path, num_ranks)
    merge(gather_path, method, tmp_path / "m.safetensors", tmp_path / "m.json", given, block_bytes=8 * 4 * 2)
    from shardfuse.checkpoints.weights import load_weights

    merged, meta = load_weights(tmp_path / "m.safetensors")
    for name in base:
        np.testing.assert_allclose(
            merged[name].numpy(), expected_of(method, given, base, per_rank, name), rtol=1e-6, atol=1e-7
        )
    assert meta["merge_method"] == method
