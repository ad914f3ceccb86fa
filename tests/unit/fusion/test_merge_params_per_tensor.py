"""Merge parameters per layer and per tensor (mergekit's gradients and filter lists): the resolver
against hand-computed values, merges of tiny state dicts checked tensor by tensor, the scalar path
unchanged, and the one-line refusals (config check and merge stage)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion import lora
from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods import settings
from shardfuse.fusion.methods.registry import rank_weights, resolve_params, tensor_params
from shardfuse.io import UserError
from shardfuse.merge import merge
from tests.support.fusion import gather_to, make_run

LAYERS = ["layers.0.w", "layers.1.w", "layers.2.w", "layers.3.w", "layers.4.w"]
OUTSIDE = ["embed.weight", "head.weight"]  # mergekit's pre_weights and post_weights


def values_of(method, given, names, num_ranks=2):
    table = tensor_params(method, resolve_params(method, given, [1] * num_ranks), names, num_ranks)
    return {name: table.by_tensor[name] for name in names}


@pytest.mark.parametrize(
    ("name", "index"),
    [
        ("model.layers.12.mlp.down_proj.weight", 12),
        ("transformer.h.3.attn.c_attn.weight", 3),
        ("blocks.0.attention.qkv.weight", 0),
        ("encoder.layer.7.output.dense.bias", 7),
        ("decoder.block.2.layer.0.SelfAttention.q.weight", 2),  # the first layer component counts
        ("net.0.weight", None),
        ("hidden.1.weight", None),
        ("layers_norm.weight", None),
        ("model.embed_tokens.weight", None),
    ],
)
def test_a_tensors_layer_is_the_number_after_a_layer_component_of_its_name(name, index):
    assert settings.layer_index(name) == index


def test_a_gradient_is_interpolated_over_the_layers_and_tensors_outside_them_take_its_first_value():
    # 5 layers: t = 0, 1/4, 1/2, 3/4, 1; three values: s = 2t = 0, 0.5, 1, 1.5, 2.
    values = values_of("task_arithmetic", {"scale": [0.5, 1.0, 4.0]}, OUTSIDE + LAYERS)
    scales = {name: v["scale"] for name, v in values.items()}
    assert scales == {
        "embed.weight": 0.5,
        "head.weight": 0.5,  # mergekit plans post_weights at t = 0 too, not t = 1
        "layers.0.w": 0.5,
        "layers.1.w": 0.75,
        "layers.2.w": 1.0,
        "layers.3.w": 2.5,
        "layers.4.w": 4.0,
    }
    # As many values as layers: each layer its own.
    exact = values_of("ties", {"density": [0.1, 0.2, 0.3, 0.4, 0.5]}, LAYERS)
    assert [exact[name]["density"] for name in LAYERS] == [0.1, 0.2, 0.3, 0.4, 0.5]
    # One layer: t = 1; a one-value gradient is that value everywhere.
    assert values_of("slerp", {"t": [0.3]}, ["h.0.w", "wte"]) == {"h.0.w": {"t": 0.3}, "wte": {"t": 0.3}}


def test_the_interpolation_is_mergekits_arithmetic_to_the_last_bit():
    # 7 layers over 5 values: s = 4 i / 6 falls between knots; (1 - f) v_lo + f v_hi, f = s - floor(s).
    gradient = [0.1, 0.5, 0.3, 0.7, 1.0]
    names = [f"layers.{i}.w" for i in range(7)]
    got = [settings.evaluate(gradient, name, settings.position(name, 7)) for name in names]
    expected = []
    for i in range(7):
        s = (i / 6) * 4
        low = int(s)
        high = min(4, low + 1)
        expected.append((1 - (s - low)) * gradient[low] + (s - low) * gradient[high])
    assert got == expected
    assert got[1] == 0.36666666666666664 and got[4] == 0.5666666666666665  # mergekit 0.1.5's floats


def test_a_filter_list_takes_the_first_entry_whose_filter_is_in_the_name_else_the_default():
    given = [
        {"filter": "attn", "value": 0.1},
        {"filter": "attn.q", "value": 0.9},  # shadowed by "attn" for every name it matches
        {"filter": "mlp", "value": [0.0, 1.0]},
        {"value": 0.5},
    ]
    names = ["layers.0.attn.q", "layers.1.mlp.w", "layers.2.mlp.w", "layers.2.norm", "embed.weight"]
    values = values_of("slerp", {"t": given}, names)
    assert {name: v["t"] for name, v in values.items()} == {
        "layers.0.attn.q": 0.1,
        "layers.1.mlp.w": 0.5,
        "layers.2.mlp.w": 1.0,
        "layers.2.norm": 0.5,
        "embed.weight": 0.5,
    }
    star = values_of("slerp", {"t": [{"filter": "norm", "value": 0.2}, {"filter": "*", "value": 0.7}]}, names)
    assert [star[name]["t"] for name in names] == [0.7, 0.7, 0.7, 0.2, 0.7]


def test_per_rank_weights_with_a_gradient_are_resolved_and_normalised_per_tensor():
    given = {"weights": [1.0, [0.0, 1.0]]}  # rank 1 fades in over the 3 layers
    resolved = resolve_params("weighted", given, [10, 30])
    assert rank_weights("weighted", resolved, [10, 30]) is None  # no one weight per rank any more
    names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w"]
    values = values_of("weighted", given, names)
    assert [values[name]["weights"] for name in names] == [[1.0, 0.0], [1.0, 0.0], [1.0, 0.5], [1.0, 1.0]]


def tiny_run(tmp_path, names, num_ranks=2, shape=(4, 3)):
    gen = torch.Generator().manual_seed(7)
    base = {name: torch.randn(*shape, generator=gen) for name in names}
    ranks = [
        {name: base[name] + torch.randn(*shape, generator=gen) for name in names} for _ in range(num_ranks)
    ]
    gather_path = gather_to(
        tmp_path, make_run(tmp_path, ranks, [10, 30, 60][:num_ranks], base=base), num_ranks
    )
    return base, ranks, gather_path


def test_task_arithmetic_with_a_per_layer_scale_matches_a_hand_computation_tensor_by_tensor(tmp_path):
    names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w", "head.weight"]
    base, ranks, gather_path = tiny_run(tmp_path, names)
    record = merge(
        gather_path, "task_arithmetic", tmp_path / "m.safetensors", tmp_path / "m.json", {"scale": [0.5, 2.0]}
    )
    merged, meta = load_weights(tmp_path / "m.safetensors")
    scales = {
        "embed.weight": 0.5,
        "layers.0.w": 0.5,
        "layers.1.w": 1.25,
        "layers.2.w": 2.0,
        "head.weight": 0.5,
    }
    for name, scale in scales.items():
        b = base[name].double().numpy()
        taus = [rank[name].double().numpy() - b for rank in ranks]
        expected = ((taus[0] + taus[1]) / 2 * scale + b).astype(np.float32)
        assert np.array_equal(merged[name].numpy(), expected), name
        assert record.tensor_stats[name]["params"] == {"scale": scale}
    assert (
        record.tensor_stats["layers.1.w"]["layer"] == 1
        and record.tensor_stats["head.weight"]["layer"] is None
    )
    assert record.params == {"scale": [0.5, 2.0]} and meta["merge_params"] == {"scale": [0.5, 2.0]}
    written = json.loads((tmp_path / "m.json").read_text())
    assert written["per_tensor_params"] == {"num_layers": 3, "varying": ["scale"], "unmatched_filters": []}


def test_weighted_with_a_rank_fading_in_over_the_layers_weighs_each_tensor_by_its_own_weights(tmp_path):
    names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w"]
    _, ranks, gather_path = tiny_run(tmp_path, names)
    record = merge(
        gather_path,
        "weighted",
        tmp_path / "m.safetensors",
        tmp_path / "m.json",
        {"weights": [1.0, [0.0, 1.0]]},
    )
    merged, _ = load_weights(tmp_path / "m.safetensors")
    for name, (w0, w1) in zip(names, [(1.0, 0.0), (1.0, 0.0), (2 / 3, 1 / 3), (0.5, 0.5)], strict=True):
        expected = w0 * ranks[0][name].double() + w1 * ranks[1][name].double()
        torch.testing.assert_close(merged[name], expected.float(), rtol=0, atol=1e-6)
    assert record.weights is None and record.tensor_stats["layers.1.w"]["params"] == {"weights": [1.0, 0.5]}


@pytest.mark.parametrize(
    ("method", "scalar", "constant"),
    [
        ("task_arithmetic", {"scale": 1.5}, {"scale": [1.5]}),
        (
            "ties",
            {"density": 0.4, "scale": 0.8},
            {"density": [{"filter": "nowhere", "value": 0.9}, {"value": 0.4}]},
        ),
        ("weighted", {"weights": [1.0, 3.0]}, {"weights": [1.0, [{"value": 3.0}]]}),
    ],
)
def test_scalar_parameters_merge_bitwise_as_before_and_a_constant_setting_merges_alike(
    tmp_path, method, scalar, constant
):
    names = ["embed.weight", "layers.0.w", "layers.1.w"]
    base, ranks, gather_path = tiny_run(tmp_path, names)
    record = merge(gather_path, method, tmp_path / "a.safetensors", tmp_path / "a.json", scalar)
    given = {**scalar, **constant}
    merge(gather_path, method, tmp_path / "b.safetensors", tmp_path / "b.json", given)
    plain, _ = load_weights(tmp_path / "a.safetensors")
    varied, _ = load_weights(tmp_path / "b.safetensors")
    resolved = resolve_params(method, scalar, [10, 30])
    weights = rank_weights(method, resolved, [10, 30])
    for name in names:
        arrays = [rank[name].numpy() for rank in ranks]
        expected, stats = merge_arrays(method, resolved, arrays, base[name].numpy(), name, weights)
        assert np.array_equal(plain[name].numpy(), expected) and torch.equal(plain[name], varied[name]), name
        assert record.tensor_stats[name].keys() == stats.keys()  # no per-tensor entries for scalars
    assert "per_tensor_params" not in json.loads((tmp_path / "a.json").read_text())
    assert tensor_params(method, resolved, names, 2) is None


def test_a_gradient_longer_than_the_layer_count_is_refused_naming_the_parameter(tmp_path):
    _, _, gather_path = tiny_run(tmp_path, ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w"])
    out = tmp_path / "m.safetensors"
    with pytest.raises(UserError) as caught:
        merge(gather_path, "task_arithmetic", out, tmp_path / "m.json", {"scale": [0.5, 1.0, 1.5, 2.0]})
    message = str(caught.value)
    assert "merge_scale is a gradient of 4 values but the tensors merged have 3 layers" in message
    assert "give at most 3 values" in message and "\n" not in message and not out.exists()
    with pytest.raises(
        UserError, match=r"merge_weights rank 1 is a gradient of 2 values but the tensors merged"
    ):
        tensor_params("weighted", {"weights": [1.0, [1.0, 2.0]]}, ["net.0.weight", "net.0.bias"], 2)
    with pytest.raises(UserError) as caught:
        tensor_params("weighted", {"weights": [1.0, [1.0, 2.0]]}, ["net.0.weight", "net.0.bias"], 2)
    assert "have no layers (a tensor's layer is the N of 'layers.N.'" in str(caught.value)


def test_a_filter_that_matches_no_tensor_is_a_warning_naming_it(tmp_path, capsys):
    names = ["embed.weight", "layers.0.mlp.w", "layers.1.mlp.w"]
    _, _, gather_path = tiny_run(tmp_path, names)
    given = {
        "scale": [
            {"filter": "self_attn", "value": 2.0},
            {"filter": "mlp", "value": [1.0, 3.0]},
            {"value": 1.0},
        ]
    }
    record = merge(gather_path, "task_arithmetic", tmp_path / "m.safetensors", tmp_path / "m.json", given)
    warning = "shardfuse.merge: warning: merge_scale filter 'self_attn' matches no tensor merged"
    assert capsys.readouterr().err.count(warning) == 1
    assert record.extra["per_tensor_params"]["unmatched_filters"] == ["merge_scale filter 'self_attn'"]
    assert [record.tensor_stats[name]["params"]["scale"] for name in names] == [1.0, 1.0, 3.0]


def test_a_tensor_whose_values_fail_the_methods_own_check_stops_the_merge_naming_it(tmp_path):
    names = ["embed.weight", "layers.0.w", "layers.1.w", "layers.2.w"]
    _, _, gather_path = tiny_run(tmp_path, names)
    out = tmp_path / "m.safetensors"
    # density 0.5 .. 0.9 passes at t = 0; at layer 2 0.9 + 0.15 leaves (0, 1).
    with pytest.raises(UserError) as caught:
        merge(gather_path, "della", out, tmp_path / "m.json", {"density": [0.5, 0.9]})
    assert str(caught.value).startswith(
        "tensor 'layers.2.w': merge method della: density +- epsilon must lie in (0, 1) but is [0.75, 1.05]"
    )
    vanishing = [{"filter": "layers.1.", "value": 0.0}, {"value": 1.0}]
    with pytest.raises(UserError) as caught:
        merge(gather_path, "weighted", out, tmp_path / "m.json", {"weights": [vanishing, vanishing]})
    assert (
        "tensor 'layers.1.w': merge method weighted: merge_weights are all 0 here (no rank to merge)"
        in str(caught.value)
    )
    assert not out.exists()


@pytest.mark.parametrize(
    ("method", "given", "message"),
    [
        (
            "ties",
            {"density": [{"filter": "mlp", "value": 0.5}]},
            "parameter 'density': a filter list ends with a default {value: ...} (no filter) for the tensors "
            "no filter names, but its last entry filters 'mlp'; add the default",
        ),
        (
            "ties",
            {"density": [{"value": 0.5}, {"filter": "mlp", "value": 0.3}]},
            "parameter 'density': filter entry 0 has no filter, so the entries after it are never used",
        ),
        (
            "ties",
            {"density": [0.2, 1.5]},
            "parameter 'density' must be a number in (0, 1] (each value of a list), got 1.5",
        ),
        (
            "ties",
            {"density": [0.2, {"value": 0.3}]},
            "parameter 'density' mixes values and lists or {filter, value} entries",
        ),
        ("ties", {"density": []}, "parameter 'density' is an empty list"),
        (
            "ties",
            {"density": [{"filter": "mlp", "valu": 0.5}, {"value": 0.3}]},
            "filter entry 0 must be {filter: SUBSTRING, value: ...}",
        ),
        (
            "ties",
            {"density": [{"filter": "", "value": 0.5}, {"value": 0.3}]},
            "filter entry 0's filter must be a non-empty string",
        ),
        (
            "dare",
            {"seed": [1, 2]},
            "parameter 'seed' is an integer from 0 to 9223372036854775807: a gradient interpolates numbers "
            "only",
        ),
        (
            "weighted",
            {"weights": [1.0, {"value": 1.0}]},
            "parameter 'weights' rank 1 is a mapping; a rank's filter list is a list",
        ),
        (
            "weighted",
            {"weights": [1.0, [0.5, -1.0]]},
            "parameter 'weights' rank 1 must be a number >= 0 (each value of a list), got -1.0",
        ),
        (
            "weighted",
            {"weights": [[0.0, 1.0], [0.0, 1.0]]},
            "merge_weights are all 0 here (no rank to merge)",
        ),
        (
            "weighted",
            {"weights": [1.0, [0.5, 1.0], 2.0]},
            "parameter 'weights' must be a list of positive numbers, one per rank",
        ),
    ],
)
def test_bad_per_tensor_settings_are_one_line_before_any_tensor_is_read(method, given, message):
    with pytest.raises(UserError) as caught:
        resolve_params(method, given, [10, 10])
    assert message in str(caught.value) and "\n" not in str(caught.value)


def config_of(**run):
    runs = {"r": {"strategy": "localsgd", **run}}
    return {"runs": runs, "datasets": {"digits": {"source": "digits"}}, "run_defaults": {"dataset": "digits"}}


def test_the_config_takes_gradients_and_filter_lists_and_refuses_bad_ones_before_any_job(tmp_path):
    slerp = [{"filter": "attn", "value": [0.0, 0.5, 1.0]}, {"filter": "mlp", "value": 0.3}, {"value": 0.5}]
    experiment = load_experiment(
        config_of(merge_method="slerp", merge_t=slerp, merge_weights=None, world_size=2), environ={}
    )
    assert experiment.runs["r"]["merge_t"] == slerp
    with pytest.raises(ConfigError) as caught:
        load_experiment(
            config_of(merge_method="ties", merge_density=[{"filter": "mlp", "value": 0.5}]), environ={}
        )
    assert (
        "config error at runs[r].merge_method: merge method ties: parameter 'density': a filter list ends"
        in str(caught.value)
    )
    table = tmp_path / "runs.tsv"
    table.write_text(
        "run\tmerge_method\tmerge_scale\tmerge_weights\n"
        "ta\ttask_arithmetic\t[0.5, 1.0]\tnull\n"
        'w\tweighted\t1.0\t[1, [{"filter": "mlp", "value": 0}, {"value": 2}]]\n'
    )
    config = config_of()
    config["runs"] = str(table)
    runs = load_experiment(config, environ={}).runs
    assert runs["ta"]["merge_scale"] == [0.5, 1.0]
    assert runs["w"]["merge_weights"] == [1, [{"filter": "mlp", "value": 0}, {"value": 2}]]


def test_lora_updates_take_per_layer_parameters_and_cat_refuses_them():
    gen = np.random.default_rng(0)
    names = ["layers.0.q.weight", "layers.1.q.weight"]

    def factors():
        return {
            name: lora.LoraFactors(gen.normal(size=(2, 3)), gen.normal(size=(4, 2)), 0.5) for name in names
        }

    ranks = [factors(), factors()]
    merged = {m.name: m for m in lora.merge_updates("task_arithmetic", {"scale": [1.0, 3.0]}, ranks)}
    for name, scale in zip(names, [1.0, 3.0], strict=True):
        updates = [0.5 * rank[name].b @ rank[name].a for rank in ranks]
        np.testing.assert_allclose(merged[name].update, scale * (updates[0] + updates[1]) / 2, rtol=1e-12)
        assert merged[name].stats["params"] == {"scale": scale}
    with pytest.raises(ConfigError, match=r"runs\[r\]\.merge_adapter: merge_adapter cat scales each rank's"):
        run = {"adapter": {"type": "lora"}, "merge_adapter": "cat", "merge_scale": [1.0, 3.0]}
        load_experiment(config_of(merge_method="task_arithmetic", **run), environ={})
    with pytest.raises(UserError) as caught:
        lora.linear_coefficients("task_arithmetic", {"scale": [1.0, 3.0]}, 2)
    assert (
        "merge_adapter cat scales each rank's factors by one coefficient for every module, but merge_scale"
        in str(caught.value)
    )
