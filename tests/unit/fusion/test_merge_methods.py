"""Fusion methods against direct, obviously-correct references; streaming safetensors IO against
safetensors itself; parameter validation; properties that hold for every method."""

from __future__ import annotations

import hashlib
import json
import math
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

from shardfuse.checkpoints.stream import (
    DTYPES,
    TORCH_NAMES,
    SafetensorsReader,
    SafetensorsWriter,
    decode_float,
    encode_float,
)
from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.plan import stream_seed
from shardfuse.fusion.methods.registry import names, rank_weights, resolve_params
from shardfuse.io import UserError
from tests.support.fusion import ranks_for


def params(method, num_ranks=3, **given_params):
    return resolve_params(method, given_params, [10] * num_ranks)


def random_ranks(num_ranks, size=40, seed=0, dtype=np.float32):
    gen = np.random.default_rng(seed)
    return [gen.standard_normal(size).astype(dtype) for _ in range(num_ranks)]


def f64(arrays):
    return [np.asarray(a, dtype=np.float64) for a in arrays]


# ---------------------------------------------------------------- references (loops, no tricks)


def reference_trim(tau, density):
    """Top-k by magnitude, ties to the lower index."""
    k = max(1, math.floor(density * tau.size + 0.5))
    keep = np.argsort(-np.abs(tau), kind="stable")[:k]
    trimmed = np.zeros_like(tau)
    trimmed[keep] = tau[keep]
    return trimmed


def reference_disjoint_mean(taus):
    out = np.zeros(taus[0].size)
    for j in range(out.size):
        total = sum(float(tau[j]) for tau in taus)
        sign = (total > 0) - (total < 0)
        agreeing = [tau[j] for tau in taus if sign != 0 and tau[j] * sign > 0]
        out[j] = sum(agreeing) / len(agreeing) if agreeing else 0.0
    return out


def reference_ties(ranks, base, density, scale):
    taus = [reference_trim(theta - base, density) for theta in f64(ranks)]
    return base + scale * reference_disjoint_mean(taus)


def reference_dare(ranks, base, density, seed, sign_election, scale, name="tensor"):
    taus = []
    for rank, theta in enumerate(f64(ranks)):
        keep = stream_seed(seed, rank, name).random(theta.size) < density
        taus.append(np.where(keep, (theta - base) / density, 0.0))
    merged = reference_disjoint_mean(taus) if sign_election else sum(taus) / len(taus)
    return base + scale * merged


def reference_slerp(a, b, t):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    norm_a, norm_b = np.linalg.norm(a), np.linalg.norm(b)
    if norm_a == 0 or norm_b == 0:
        return (1 - t) * a + t * b
    cos = np.clip(a @ b / (norm_a * norm_b), -1, 1)
    if abs(cos) > 0.9995:
        return (1 - t) * a + t * b
    theta = np.arccos(cos)
    return (np.sin((1 - t) * theta) * a + np.sin(t * theta) * b) / np.sin(theta)


def reference_model_stock(ranks, base):
    taus = [theta - base for theta in f64(ranks)]
    n = len(taus)
    cosines = [
        taus[i] @ taus[j] / (np.linalg.norm(taus[i]) * np.linalg.norm(taus[j]))
        for i in range(n)
        for j in range(i + 1, n)
        if np.linalg.norm(taus[i]) > 0 and np.linalg.norm(taus[j]) > 0
    ]
    if not cosines:
        return np.mean(f64(ranks), axis=0), 1.0
    cos = min(1.0, max(0.0, float(np.mean(cosines))))
    t = n * cos / (1 + (n - 1) * cos)
    return t * np.mean(f64(ranks), axis=0) + (1 - t) * base, t


def close(actual, expected, dtype=np.float32):
    np.testing.assert_allclose(actual, np.asarray(expected).astype(dtype), rtol=1e-6, atol=1e-6)


# ---------------------------------------------------------------- each method vs its reference


def test_uniform_and_weighted_match_the_plain_weighted_sum():
    ranks = random_ranks(4)
    merged, _ = merge_arrays("uniform", params("uniform", 4), ranks)
    close(merged, np.mean(f64(ranks), axis=0))
    weights = rank_weights("weighted", params("weighted", 4, weights=[1, 2, 3, 4]), [5] * 4)
    assert weights == pytest.approx([0.1, 0.2, 0.3, 0.4])
    merged, _ = merge_arrays("weighted", params("weighted", 4), ranks, weights=weights)
    close(merged, sum(w * a for w, a in zip(weights, f64(ranks), strict=True)))


def test_weighted_defaults_to_shard_rows():
    assert rank_weights(
        "weighted", resolve_params("weighted", {}, [10, 30, 60]), [10, 30, 60]
    ) == pytest.approx([0.1, 0.3, 0.6])


@pytest.mark.parametrize("scale", [1.0, 0.5, 2.5])
def test_task_arithmetic_adds_the_scaled_mean_task_vector(scale):
    ranks, base = random_ranks(3), random_ranks(1, seed=9)[0].astype(np.float64)
    merged, _ = merge_arrays("task_arithmetic", params("task_arithmetic", scale=scale), ranks, base)
    close(merged, base + scale * np.mean([theta - base for theta in f64(ranks)], axis=0))


def test_task_arithmetic_with_scale_1_is_the_uniform_soup():
    ranks, base = random_ranks(3), random_ranks(1, seed=9)[0]
    soup, _ = merge_arrays("uniform", params("uniform"), ranks)
    merged, _ = merge_arrays("task_arithmetic", params("task_arithmetic"), ranks, base)
    np.testing.assert_allclose(merged, soup, rtol=0, atol=1e-6)


@pytest.mark.parametrize("density", [0.05, 0.2, 0.5, 0.9, 1.0])
def test_ties_matches_the_loop_reference(density):
    ranks, base = random_ranks(4, size=57), random_ranks(1, seed=5, size=57)[0].astype(np.float64)
    merged, stats = merge_arrays("ties", params("ties", 4, density=density, scale=0.7), ranks, base)
    close(merged, reference_ties(ranks, base, density, 0.7))
    k = max(1, math.floor(density * 57 + 0.5))
    assert stats["kept_fraction"] == pytest.approx(k / 57)


def test_ties_sign_election_edge_cases():
    base = np.zeros(6)
    ranks = [  # entry: 0 opposite values sum to 0; 1 two against one; 2 all zero; 3 one value only;
        np.array([1.0, 2.0, 0.0, 0.0, -1.0, 3.0]),  # 4 majority negative by sum; 5 all agree
        np.array([-1.0, 2.0, 0.0, 0.0, -1.0, 1.0]),
        np.array([0.0, -3.0, 0.0, 5.0, 1.5, 2.0]),
    ]
    merged, _ = merge_arrays("ties", params("ties", density=1.0), ranks, base)
    # sum 0 -> 0; sum +1 -> mean of the positive values 2, 2; no values -> 0; lone 5; sum -0.5 -> mean of
    # the negatives; all positive -> their mean
    np.testing.assert_array_equal(merged, [0.0, 2.0, 0.0, 5.0, -1.0, 2.0])
    close(merged, reference_ties(ranks, base, 1.0, 1.0), np.float64)


def test_ties_breaks_equal_magnitudes_by_lower_index_and_keeps_exactly_k():
    base = np.zeros(8)
    ranks = [np.array([1.0, -1.0, 1.0, 1.0, -1.0, 1.0, 0.5, 2.0])]  # k = 4: 2.0 and the first three 1s
    merged, stats = merge_arrays("ties", params("ties", 1, density=0.5), ranks, base)
    np.testing.assert_array_equal(merged, [1.0, -1.0, 1.0, 0.0, 0.0, 0.0, 0.0, 2.0])
    assert stats["kept_fraction"] == 0.5


def test_zero_task_vectors_give_the_base_for_task_vector_methods():
    base = random_ranks(1, seed=3)[0]
    for method, extra in [("task_arithmetic", {}), ("ties", {}), ("dare", {}), ("model_stock", {})]:
        merged, stats = merge_arrays(method, params(method, **extra), [base.copy(), base.copy()], base)
        np.testing.assert_array_equal(merged, base)
    assert stats == {"max_abs_diff": 0.0, "t": 1.0, "cos": None}


@pytest.mark.parametrize("sign_election", [False, True])
def test_dare_matches_the_reference_with_the_same_random_streams(sign_election):
    ranks, base = random_ranks(3, size=500), random_ranks(1, seed=4, size=500)[0].astype(np.float64)
    p = params("dare", density=0.3, seed=7, sign_election=sign_election, scale=1.5)
    merged, stats = merge_arrays("dare", p, ranks, base, name="layer.weight")
    close(merged, reference_dare(ranks, base, 0.3, 7, sign_election, 1.5, name="layer.weight"))
    assert 0.25 < stats["kept_fraction"] < 0.35


def test_dare_is_deterministic_per_seed_and_differs_between_seeds_ranks_and_tensors():
    ranks, base = random_ranks(2, size=200), np.zeros(200)
    one, _ = merge_arrays("dare", params("dare", 2, seed=1), ranks, base)
    again, _ = merge_arrays("dare", params("dare", 2, seed=1), ranks, base)
    other, _ = merge_arrays("dare", params("dare", 2, seed=2), ranks, base)
    renamed, _ = merge_arrays("dare", params("dare", 2, seed=1), ranks, base, name="other")
    np.testing.assert_array_equal(one, again)
    assert not np.array_equal(one, other) and not np.array_equal(one, renamed)
    masks = [stream_seed(1, rank, "tensor").random(200) < 0.5 for rank in (0, 1)]
    assert not np.array_equal(*masks)


def test_slerp_endpoints_are_the_ranks_exactly():
    a, b = random_ranks(2, size=33)
    assert np.array_equal(merge_arrays("slerp", params("slerp", 2, t=0.0), [a, b])[0], a)
    assert np.array_equal(merge_arrays("slerp", params("slerp", 2, t=1.0), [a, b])[0], b)


def test_slerp_of_orthogonal_unit_vectors_at_half_is_their_normalised_sum():
    a, b = np.array([1.0, 0.0, 0.0]), np.array([0.0, 1.0, 0.0])
    merged, stats = merge_arrays("slerp", params("slerp", 2, t=0.5), [a, b])
    np.testing.assert_allclose(merged, [math.sqrt(0.5), math.sqrt(0.5), 0.0], rtol=1e-15)
    assert stats["angle_deg"] == pytest.approx(90.0) and stats["interpolation"] == "slerp"


@pytest.mark.parametrize("t", [0.1, 0.5, 0.77])
def test_slerp_matches_the_formula(t):
    a, b = random_ranks(2, size=64, dtype=np.float64)
    merged, _ = merge_arrays("slerp", params("slerp", 2, t=t), [a, b])
    np.testing.assert_allclose(merged, reference_slerp(a, b, t), rtol=1e-12, atol=1e-12)


def test_slerp_falls_back_to_lerp_for_near_parallel_and_zero_vectors():
    a = random_ranks(1, size=64, dtype=np.float64)[0]
    b = a * 2.0 + 1e-6
    merged, stats = merge_arrays("slerp", params("slerp", 2, t=0.25), [a, b])
    np.testing.assert_allclose(merged, 0.75 * a + 0.25 * b, rtol=1e-15)
    assert stats["interpolation"] == "lerp" and stats["angle_deg"] < 1
    merged, stats = merge_arrays("slerp", params("slerp", 2, t=0.25), [np.zeros(64), b])
    np.testing.assert_allclose(merged, 0.25 * b, rtol=1e-15)
    assert stats["angle_deg"] is None


def test_model_stock_matches_the_reference_and_the_two_model_ratio():
    base = random_ranks(1, seed=8, size=100)[0].astype(np.float64)
    ranks = [base + 0.5 * tau for tau in random_ranks(3, size=100, dtype=np.float64)]
    ranks[1] = ranks[1] + 0.3 * (ranks[0] - base)  # correlated task vectors: cos > 0
    merged, stats = merge_arrays("model_stock", params("model_stock"), ranks, base)
    expected, t = reference_model_stock(ranks, base)
    np.testing.assert_allclose(merged, expected, rtol=1e-12)
    assert stats["t"] == pytest.approx(t)
    pair, stats = merge_arrays("model_stock", params("model_stock", 2), ranks[:2], base)
    tau0, tau1 = ranks[0] - base, ranks[1] - base
    cos = tau0 @ tau1 / (np.linalg.norm(tau0) * np.linalg.norm(tau1))
    assert stats["t"] == pytest.approx(2 * cos / (1 + cos))
    np.testing.assert_allclose(pair, stats["t"] * (ranks[0] + ranks[1]) / 2 + (1 - stats["t"]) * base)


def test_model_stock_clamps_opposed_task_vectors_to_the_base_and_keeps_one_model():
    base = np.zeros(4)
    merged, stats = merge_arrays("model_stock", params("model_stock", 2), [np.ones(4), -np.ones(4)], base)
    assert stats["t"] == 0.0 and np.array_equal(merged, base)
    single = np.arange(4.0)
    assert np.array_equal(merge_arrays("model_stock", params("model_stock", 1), [single], base)[0], single)


def test_consolidate_returns_rank_0_within_tolerance_and_names_the_tensor_beyond_it():
    a = random_ranks(1)[0]
    merged, stats = merge_arrays("consolidate", params("consolidate", 2, tolerance=1e-3), [a, a + 1e-4])
    assert np.array_equal(merged, a) and 0 < stats["max_abs_diff"] < 1e-3
    with pytest.raises(UserError, match=r"^consolidate: tensor 'w' differs between ranks by up to 0\.01 "):
        merge_arrays("consolidate", params("consolidate", 2), [a, a + 0.01], name="w")


def test_consolidate_treats_equal_nans_as_equal_and_a_nan_against_a_number_as_a_difference():
    a = np.array([1.0, np.nan, 3.0])
    assert (
        merge_arrays("consolidate", params("consolidate", 2, tolerance=0.0), [a, a.copy()])[1]["max_abs_diff"]
        == 0
    )
    with pytest.raises(UserError, match="differs between ranks by up to inf"):
        merge_arrays("consolidate", params("consolidate", 2), [a, np.array([1.0, 2.0, 3.0])])


@pytest.mark.parametrize("method", names())
def test_integer_and_bool_tensors_are_copied_from_rank_0_and_must_agree(method):
    n = ranks_for(method)
    counters = [np.array([7, 8], dtype=np.int64)] * n
    merged, stats = merge_arrays(method, params(method, n), counters, base=np.zeros(2))
    assert merged.dtype == np.int64 and np.array_equal(merged, counters[0]) and stats["copied_from_rank"] == 0
    if n == 1:
        return
    with pytest.raises(
        UserError, match=r"tensor 'mask' \(bool\) differs between rank 0 and rank 1; integer/bool"
    ):
        merge_arrays(method, params(method, n), [np.array([True]), np.array([False])], np.zeros(1), "mask")


# Parameters under which each method would move a weight away from the plain mean.
STATISTIC_CASE_PARAMS = {
    "consolidate": {"tolerance": 100.0},
    "task_arithmetic": {"scale": 0.5},
    "ties": {"density": 0.3},
    "dare": {"density": 0.5},
    "slerp": {"t": 0.2},
}


@pytest.mark.parametrize("method", names())
def test_running_statistics_are_the_plain_mean_for_every_method_but_consolidate(method):
    n = ranks_for(method)
    ranks, base = random_ranks(n, seed=4), random_ranks(1, seed=5)[0]
    p = resolve_params(method, STATISTIC_CASE_PARAMS.get(method, {}), [1] * n)
    weights = [0.25, 0.75] if n == 2 else None
    for name in ("features.1.running_mean", "bn.running_var", "running_var"):
        merged, stats = merge_arrays(method, p, ranks, base, name, weights)
        if method == "consolidate":
            assert np.array_equal(merged, ranks[0]) and "running_statistic" not in stats
        elif method == "weighted":
            close(merged, 0.25 * ranks[0].astype(np.float64) + 0.75 * ranks[1])
            assert stats["running_statistic"] == "weighted mean"
        else:
            assert np.array_equal(merged, (np.mean(f64(ranks), axis=0)).astype(np.float32))
            assert stats["running_statistic"] == "mean" and "kept_fraction" not in stats


@pytest.mark.parametrize("name", ["bn.running_variance", "running_mean_head.weight", "bn.weight"])
def test_only_the_exact_running_statistic_names_escape_the_method(name):
    ranks, base = random_ranks(3, seed=4), np.zeros(40, dtype=np.float32)
    merged, stats = merge_arrays("ties", params("ties", density=0.2), ranks, base, name)
    expected = reference_ties(ranks, base.astype(np.float64), density=0.2, scale=1.0)
    close(merged, expected)
    assert "running_statistic" not in stats


# ---------------------------------------------------------------- parameters


@pytest.mark.parametrize(
    ("method", "given", "message"),
    [
        (
            "ties",
            {"density": 0},
            r"merge method ties: parameter 'density' must be a number in \(0, 1\], got 0",
        ),
        ("ties", {"density": 1.5}, r"'density' must be a number in \(0, 1\]"),
        ("dare", {"seed": -1}, r"'seed' must be an integer from 0 to 9223372036854775807, got -1"),
        ("dare", {"seed": 2**63}, r"'seed' must be an integer from 0 to \d+, got 9223372036854775808"),
        ("dare", {"seed": 1.5}, r"'seed' must be an integer from 0 to"),
        ("dare", {"sign_election": "yes"}, r"'sign_election' must be true or false"),
        ("slerp", {"t": 1.2}, r"'t' must be a number in \[0, 1\]"),
        ("task_arithmetic", {"scale": 0}, r"'scale' must be a number > 0"),
        ("task_arithmetic", {"scale": True}, r"'scale' must be a number > 0"),
        ("consolidate", {"tolerance": -1}, r"'tolerance' must be a number >= 0"),
        (
            "weighted",
            {"weights": [1, 2]},
            r"'weights' must be a list of positive numbers, one per rank, or null \(the run has 3",
        ),
        ("weighted", {"weights": [1, 0, 2]}, r"'weights' must be a list of positive numbers"),
        ("ties", {"densty": 0.3}, r"merge method ties has no parameter 'densty' \(valid: density, scale\)"),
        ("uniform", {"t": 0.5}, r"merge method uniform has no parameter 't' \(it takes none\)"),
        ("soup", {}, r"unknown merge method 'soup'; use one of consolidate, uniform"),
        ("slerp", {}, r"slerp interpolates exactly 2 models but the run has 3 ranks"),
    ],
)
def test_bad_parameters_are_one_line_user_errors(method, given, message):
    with pytest.raises(UserError, match=message) as caught:
        resolve_params(method, given, [10, 20, 30])
    assert "\n" not in str(caught.value)


def test_parameters_resolve_with_their_defaults():
    assert resolve_params("dare", {}, [1, 1]) == {
        "density": 0.5,
        "seed": 0,
        "sign_election": False,
        "scale": 1.0,
    }
    assert resolve_params("ties", {"density": 1}, [1]) == {"density": 1.0, "scale": 1.0}
    assert resolve_params("consolidate", None, [1]) == {"tolerance": 1e-6}
    assert resolve_params("slerp", {}, [1, 1]) == {"t": 0.5}


# ---------------------------------------------------------------- properties


METHOD_PARAMS = {"ties": {"density": 1.0}, "dare": {"density": 1.0}, "consolidate": {"tolerance": 0.0}}
dyadic = st.integers(-(2**16), 2**16).map(lambda i: i / 64)  # exact in float32 and in float64 sums
tensors = st.integers(1, 24).flatmap(lambda size: st.lists(dyadic, min_size=size, max_size=size))


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    values=tensors,
    base_shift=dyadic,
    num_ranks=st.integers(1, 5),
    method=st.sampled_from(names()),
    t=st.sampled_from([0.0, 0.3, 0.5, 1.0]),
)
def test_merging_identical_models_returns_that_model(values, base_shift, num_ranks, method, t):
    if method in ("slerp", "nuslerp"):
        num_ranks = 2
    num_ranks = min(num_ranks, ranks_for(method, num_ranks))
    theta = np.array(values, dtype=np.float32)
    base = theta + np.float32(base_shift)
    p = resolve_params(
        method, {**METHOD_PARAMS.get(method, {}), **({"t": t} if method == "slerp" else {})}, [3] * num_ranks
    )
    weights = rank_weights(method, p, [1 + r for r in range(num_ranks)])
    merged, _ = merge_arrays(method, p, [theta.copy() for _ in range(num_ranks)], base, weights=weights)
    assert merged.dtype == np.float32
    np.testing.assert_array_equal(merged, theta)


@settings(max_examples=40, deadline=None)
@given(raw=st.lists(st.floats(1e-3, 1e3), min_size=1, max_size=8), factor=st.floats(1e-3, 1e3))
def test_weights_are_normalised_and_only_their_ratios_matter(raw, factor):
    p = {"weights": raw}
    weights = rank_weights("weighted", resolve_params("weighted", p, [1] * len(raw)), [1] * len(raw))
    scaled = rank_weights("weighted", {"weights": [w * factor for w in raw]}, [1] * len(raw))
    assert math.fsum(weights) == pytest.approx(1.0, abs=1e-12)
    assert weights == pytest.approx(scaled, rel=1e-9)
    assert all(w > 0 for w in weights)


@pytest.mark.parametrize("method", names())
@pytest.mark.parametrize("dtype", [np.float16, np.float32, np.float64])
def test_output_dtype_is_the_input_dtype(method, dtype):
    n = ranks_for(method)
    ranks, base = random_ranks(n, dtype=dtype), random_ranks(1, seed=3, dtype=dtype)[0]
    p = resolve_params(method, {"tolerance": 100.0} if method == "consolidate" else {}, [1] * n)
    merged, _ = merge_arrays(method, p, ranks, base, weights=rank_weights(method, p, [1] * n))
    assert merged.dtype == dtype and merged.shape == ranks[0].shape


# ---------------------------------------------------------------- streaming safetensors IO

ALL_DTYPES = [
    name for name in DTYPES if getattr(torch, TORCH_NAMES[name], None) is not None and name != "F8_E8M0"
]


def sample_tensors(seed=0):
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i, name in enumerate(ALL_DTYPES):
        dtype = getattr(torch, TORCH_NAMES[name])
        raw = torch.randint(0, 255, (3, 5 + i), generator=gen, dtype=torch.uint8)
        tensors[f"t{i}.{name.lower()}"] = raw.view(-1)[: raw.numel() // dtype.itemsize * dtype.itemsize].view(
            dtype
        )
    tensors.update(
        empty=torch.zeros(0, 4), scalar=torch.tensor(2.5), **{"ünï": torch.arange(6.0).reshape(2, 3)}
    )
    return tensors


def write_streaming(path, tensors, metadata, seed=0):
    """Write through SafetensorsWriter in random-sized chunks."""
    entries = {
        name: (next(k for k, v in TORCH_NAMES.items() if getattr(torch, v, None) == t.dtype), list(t.shape))
        for name, t in tensors.items()
    }
    writer = SafetensorsWriter(path, entries, metadata)
    chooser = random.Random(seed)
    for name in writer.names:
        data = tensors[name].contiguous().view(-1).view(torch.uint8).numpy() if tensors[name].numel() else b""
        position = 0
        while position < len(data):
            step = chooser.randint(1, 9)
            writer.write(name, data[position : position + step])
            position += step
    return writer.close()


def test_streaming_writer_is_byte_identical_to_save_file(tmp_path):
    tensors = sample_tensors()
    for metadata in (None, {"shardfuse": json.dumps({"run": "r", "note": 'quote " é'})}):
        save_file(tensors, str(tmp_path / "reference.safetensors"), metadata=metadata)
        digest = write_streaming(tmp_path / "streamed.safetensors", tensors, metadata)
        expected = (tmp_path / "reference.safetensors").read_bytes()
        assert (tmp_path / "streamed.safetensors").read_bytes() == expected
        assert digest == hashlib.sha256(expected).hexdigest()
    with safe_open(str(tmp_path / "streamed.safetensors"), framework="pt") as handle:
        assert all(torch.equal(handle.get_tensor(name), tensor) for name, tensor in tensors.items())


def test_writer_refuses_bytes_out_of_order_or_a_short_tensor(tmp_path):
    writer = SafetensorsWriter(tmp_path / "x.safetensors", {"a": ("F32", [2]), "b": ("F32", [1])})
    with pytest.raises(RuntimeError, match="got bytes of 'b', expected 'a'"):
        writer.write("b", b"1234")
    writer.write("a", b"12345678")
    with pytest.raises(RuntimeError, match="'b' was not fully written"):
        writer.close()


def test_reader_hashes_while_streaming_and_completes_the_hash_for_skipped_bytes(tmp_path):
    tensors = sample_tensors(1)
    save_file(tensors, str(tmp_path / "m.safetensors"))
    expected = hashlib.sha256((tmp_path / "m.safetensors").read_bytes()).hexdigest()
    with SafetensorsReader(tmp_path / "m.safetensors") as reader:
        buffer = np.empty(4096, dtype=np.uint8)
        for info in reader.tensors.values():  # file order, in two pieces each
            half = info.numel // 2
            reader.read_into(info, 0, half, buffer)
            reader.read_into(info, half, info.numel - half, buffer)
        assert reader._hashed_upto == reader.size and reader.sha256() == expected
    with SafetensorsReader(tmp_path / "m.safetensors") as reader:
        last = list(reader.tensors.values())[-1]
        assert np.array_equal(reader.read_array(last), tensors[last.name].numpy().view(last.dtype.holder))
        assert reader.sha256() == expected


def header_only(header: str) -> bytes:
    return len(header).to_bytes(8, "little") + header.encode()


@pytest.mark.parametrize(
    ("content", "reason"),
    [
        (b"\x80\x04 pickle", "shorter than 8 bytes|header length"),
        (b"\x08\x00\x00\x00\x00\x00\x00\x00not json", "header is not UTF-8 JSON"),
        (header_only('{"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}}'), "the tensors cover"),
        (header_only('{"a":{"dtype":"F4","shape":[2],"data_offsets":[0,1]}}'), "tensor 'a' has an unknown"),
        (header_only('{"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}}'), "tensor 'a' has 8 bytes"),
    ],
)
def test_reader_rejects_files_that_are_not_safetensors_in_one_line(tmp_path, content, reason):
    (tmp_path / "bad.safetensors").write_bytes(content)
    with pytest.raises(
        UserError, match=rf"bad.safetensors is not a valid safetensors file \(({reason})"
    ) as caught:
        SafetensorsReader(tmp_path / "bad.safetensors")
    assert "\n" not in str(caught.value)


def test_reader_rejects_a_truncated_file(tmp_path):
    save_file({"a": torch.ones(10)}, str(tmp_path / "m.safetensors"))
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "m.safetensors").write_bytes(data[:-4])
    with pytest.raises(UserError, match=r"the tensors cover \d+ bytes but the file has"):
        SafetensorsReader(tmp_path / "m.safetensors")


@pytest.mark.parametrize("name", ["F16", "BF16", "F32", "F64"])
def test_float_codecs_round_trip_exactly_and_round_like_torch(name):
    dtype = getattr(torch, TORCH_NAMES[name])
    values = torch.randn(10_000, dtype=torch.float64) * 100
    raw_reference = values.to(dtype).view(-1).view(torch.uint8).numpy()
    out = np.empty(len(values) * 8, dtype=np.uint8)
    assert np.array_equal(encode_float(values.numpy(), DTYPES[name], out), raw_reference)
    decoded = decode_float(raw_reference, DTYPES[name], np.empty(len(values)))
    assert np.array_equal(decoded, values.to(dtype).double().numpy())
