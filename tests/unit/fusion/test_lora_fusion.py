"""LoRA fusion in update space (shardfuse.fusion.lora): every method that fuses updates gives, on the
ranks' ΔW = s·B·A over the frozen base, what it gives on the dense models W0 + ΔW (the engine's own
reference, ``merge_arrays``, masks seeded alike); the others are refused in one line; svd and cat
adapters; one module at a time, in blocks that shrink as ranks are added."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest

from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.lora import (
    LoraFactors,
    cat_factors,
    linear_coefficients,
    merge_model,
    merge_updates,
    svd_factors,
    update_methods,
)
from shardfuse.fusion.methods.registry import linear_names, names, rank_weights, resolve_params, uses_base
from shardfuse.io import UserError

# Parameters that make each method do its work (sparsify, drop, select), not its defaults' no-ops.
GIVEN = {
    "consolidate": {"tolerance": 10.0},
    "task_arithmetic": {"scale": 0.7},
    "ties": {"density": 0.5, "scale": 1.3},
    "dare": {"density": 0.6, "seed": 3, "sign_election": True},
    "breadcrumbs": {"density": 0.7, "gamma": 0.1},
    "breadcrumbs_ties": {"density": 0.6, "gamma": 0.05},
    "della": {"density": 0.6, "epsilon": 0.2, "seed": 5},
    "sce": {"topk": 0.5},
}
# name: (weight shape, adapter rank, fan_in_fan_out); None: not adapted
MODULES = {
    "embed.weight": ((6, 5), None, False),
    "layers.0.q.weight": ((7, 5), 2, False),
    "layers.0.q.bias": ((7,), None, False),
    "layers.0.c_attn.weight": ((5, 9), 3, True),  # GPT-2's Conv1D: stored [in, out]
    "head.weight": ((3, 7), 1, False),
}
TINY_BLOCKS = 8 * 4 * 5  # 5 float64 entries per input at 3 ranks + base: blocks cut rows


def params_of(method, num_ranks):
    return resolve_params(method, GIVEN.get(method, {}), [10 * (i + 1) for i in range(num_ranks)])


def weights_of(method, num_ranks):
    return rank_weights(method, params_of(method, num_ranks), [10 * (i + 1) for i in range(num_ranks)])


def random_factors(gen, shape, rank, fan_in_fan_out, scaling=0.5):
    out_features, in_features = shape[::-1] if fan_in_fan_out else shape
    a = gen.standard_normal((rank, in_features))
    b = gen.standard_normal((out_features, rank)) * 0.3
    return LoraFactors(a, b, scaling, fan_in_fan_out)


def random_model(num_ranks, seed=0, dtype=np.float64):
    """A frozen base and each rank's adapters of its adapted modules."""
    gen = np.random.default_rng(seed)
    base = {name: gen.standard_normal(shape).astype(dtype) for name, (shape, _, _) in MODULES.items()}
    ranks = [
        {
            name: random_factors(gen, shape, rank, flip, scaling=2.0 / rank)
            for name, (shape, rank, flip) in MODULES.items()
            if rank is not None
        }
        for _ in range(num_ranks)
    ]
    return base, ranks


def dense_merge(method, num_ranks, base, ranks):
    """The reference: each tensor of the dense models W_i = W0 + ΔW_i merged as the merge stage would."""
    merged = {}
    for name, weight in base.items():
        dense = [weight + factors[name].update() if name in factors else weight for factors in ranks]
        merged[name], _ = merge_arrays(
            method,
            params_of(method, num_ranks),
            dense,
            base=weight if uses_base(method) else None,
            name=name,
            weights=weights_of(method, num_ranks),
        )
    return merged


def _accepts(method, num_ranks):
    try:
        params_of(method, num_ranks)
    except UserError:  # the method's check: e.g. none keeps one model
        return False
    return True


@pytest.mark.parametrize(
    ("method", "num_ranks"),
    [(m, n) for n in (1, 2, 3) for m in update_methods() if _accepts(m, n) and (n > 1 or not _accepts(m, 2))],
)
def test_the_update_space_merge_is_the_dense_merge_of_base_plus_updates(method, num_ranks):
    base, ranks = random_model(num_ranks, seed=num_ranks)
    expected = dense_merge(method, num_ranks, base, ranks)
    fused = merge_model(
        method,
        params_of(method, num_ranks),
        base,
        ranks,
        weights=weights_of(method, num_ranks),
        block_bytes=TINY_BLOCKS,
    )
    seen = []
    for tensor in fused:
        seen.append(tensor.name)
        np.testing.assert_allclose(tensor.weight, expected[tensor.name], rtol=0, atol=1e-12)
        if tensor.merged is None:
            assert tensor.weight is base[tensor.name]  # not adapted: the base's own array
    assert seen == list(base)


def test_the_dense_weights_keep_the_base_dtype_and_the_updates_stay_float64():
    base, ranks = random_model(2, dtype=np.float32)
    for tensor in merge_model("ties", params_of("ties", 2), base, ranks):
        assert tensor.weight.dtype == np.float32
        if tensor.merged is not None:
            assert tensor.merged.update.dtype == np.float64
            assert 0 < tensor.merged.stats["kept_fraction"] < 1
            assert tensor.merged.stats["max_abs_diff"] > 0


def test_the_methods_that_cannot_fuse_updates_are_the_spherical_ones_and_greedy_soup():
    assert sorted(set(names()) - set(update_methods())) == [
        "greedy_soup",
        "karcher",
        "multislerp",
        "nuslerp",
        "slerp",
    ]
    assert {method for method in names() if uses_base(method)} <= set(update_methods())


@pytest.mark.parametrize("method", sorted(set(names()) - set(update_methods())))
def test_a_method_on_whole_weights_is_refused_in_one_line_before_any_work(method):
    base, ranks = random_model(2)
    for call in (
        lambda: merge_updates(method, {}, ranks),  # refused when called, not when first iterated
        lambda: merge_model(method, {}, base, ranks),
    ):
        with pytest.raises(UserError, match=f"merge method {method} cannot fuse LoRA adapters: it ") as info:
            call()
        assert "\n" not in str(info.value)
        assert "; use uniform" in str(info.value) or "; use weighted or task_arithmetic" in str(info.value)


def test_adapters_of_different_modules_or_over_another_base_are_refused():
    base, ranks = random_model(2)
    del ranks[1]["head.weight"]
    with pytest.raises(UserError, match="the adapters of rank 1 and rank 0 adapt different modules"):
        merge_updates("uniform", {}, ranks)
    base, ranks = random_model(2)
    base["head.weight"] = base["head.weight"].T
    with pytest.raises(UserError, match="fuse adapters over the base they were trained on"):
        merge_model("uniform", {}, base, ranks)


# ---------------------------------------------------------------- streaming


@dataclass(frozen=True, eq=False)
class LoggedFactors(LoraFactors):
    """Factors that log (module, block size) for every block the engine forms from them."""

    module: str = ""
    log: list = field(default_factory=list, compare=False)

    def update_block(self, start, count):
        self.log.append((self.module, count))
        return super().update_block(start, count)


@pytest.mark.parametrize("num_ranks", [2, 3])
def test_updates_are_merged_one_module_at_a_time_in_blocks_that_shrink_with_more_ranks(num_ranks):
    _, ranks = random_model(num_ranks)
    log = []
    logged = [
        {name: LoggedFactors(f.a, f.b, f.scaling, f.fan_in_fan_out, name, log) for name, f in factors.items()}
        for factors in ranks
    ]
    block_bytes = 8 * 12
    merged = merge_updates("ties", params_of("ties", num_ranks), logged, block_bytes=block_bytes)
    assert log == []  # nothing formed before the first module is asked for
    for update in merged:
        assert {module for module, _ in log} == {update.name}  # this module's blocks only
        assert max(count for _, count in log) == block_bytes // (8 * (num_ranks + 1))  # ranks + base
        log.clear()


# ---------------------------------------------------------------- adapters out


@pytest.mark.parametrize("fan_in_fan_out", [False, True])
@pytest.mark.parametrize("rank", [2, 3, 9])
def test_svd_refactorises_an_update_of_rank_at_most_r_exactly(rank, fan_in_fan_out):
    update = random_factors(np.random.default_rng(1), (8, 6), 2, fan_in_fan_out, scaling=0.25).update()
    factors, error = svd_factors(update, rank, scaling=4.0, fan_in_fan_out=fan_in_fan_out)
    assert (factors.rank, factors.shape, factors.scaling) == (rank, (8, 6), 4.0)
    np.testing.assert_allclose(factors.update(), update, rtol=0, atol=1e-12)
    assert error < 1e-14


def test_svd_truncation_error_is_the_tail_of_the_singular_values():
    gen = np.random.default_rng(2)
    left, _ = np.linalg.qr(gen.standard_normal((7, 5)))
    right, _ = np.linalg.qr(gen.standard_normal((6, 5)))
    singular = np.array([5.0, 3.0, 2.0, 1.0, 0.5])
    update = (left * singular) @ right.T
    factors, error = svd_factors(update, 2, scaling=1.0)
    assert error == pytest.approx(np.sqrt((2.0**2 + 1.0 + 0.25) / (25 + 9 + 4 + 1 + 0.25)), rel=1e-12)
    best = (left[:, :2] * singular[:2]) @ right[:, :2].T  # Eckart-Young
    np.testing.assert_allclose(factors.update(), best, rtol=0, atol=1e-12)
    assert svd_factors(np.zeros((3, 4)), 2, scaling=1.0)[1] == 0.0


@pytest.mark.parametrize("method", linear_names())
def test_cat_is_the_merged_update_exactly_for_linear_methods(method):
    num_ranks = 3
    _, ranks = random_model(num_ranks, seed=7)
    weights = weights_of(method, num_ranks)
    params = params_of(method, num_ranks)
    coefficients = linear_coefficients(method, params, num_ranks, weights)
    for merged in merge_updates(method, params, ranks, weights=weights):
        factors = [rank[merged.name] for rank in ranks]
        cat = cat_factors(factors, coefficients, scaling=0.125)
        assert cat.rank == sum(f.rank for f in factors)
        np.testing.assert_allclose(cat.update(), merged.update, rtol=0, atol=1e-12)


def test_cat_refuses_a_method_that_is_not_linear_in_the_updates():
    with pytest.raises(UserError) as info:
        linear_coefficients("ties", params_of("ties", 2), 2)
    assert str(info.value) == (
        "merge_adapter cat is exact only for the methods linear in the updates "
        "(uniform, weighted, task_arithmetic), not ties; use merge_adapter svd"
    )
