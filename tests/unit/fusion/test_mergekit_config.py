"""mergekit's YAML translated into shardfuse's methods and parameters (shardfuse.fusion.methods.mergekit):
each method's translation, and one line for every field or combination shardfuse does not run as
mergekit would. The results against mergekit's own merges: tests/services/test_mergekit_folders.py."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml

from shardfuse.fusion.methods import mergekit
from shardfuse.fusion.methods.registry import resolve_params
from shardfuse.io import UserError


@pytest.fixture
def folders(tmp_path, monkeypatch) -> Path:
    for name in ("base", "a", "b", "c"):
        (tmp_path / name).mkdir()
    monkeypatch.chdir(tmp_path)  # mergekit reads model paths from the working directory
    return tmp_path


def read(folders: Path, config: dict) -> mergekit.MergekitConfig:
    path = folders / "merge.yml"
    path.write_text(yaml.safe_dump(config))
    return mergekit.read(path)


def gta(method: str, parameters: dict | None = None, **per_model) -> dict:
    entries = [{"model": m, "parameters": dict(per_model)} if per_model else {"model": m} for m in ("a", "b")]
    return {"merge_method": method, "base_model": "base", "models": entries, "parameters": parameters or {}}


def test_linear_is_weighted_with_the_models_weights_and_refuses_normalize_false(folders):
    cfg = read(
        folders,
        {"merge_method": "linear", "models": [
            {"model": "a", "parameters": {"weight": [{"filter": "attn", "value": 3.0}, {"value": 1.0}]}},
            {"model": "b", "parameters": {"weight": 2.0}},
        ]},
    )  # fmt: skip
    assert (cfg.method, cfg.models, cfg.base) == ("weighted", ("a", "b"), None)
    assert cfg.params == {"weights": [[{"filter": "attn", "value": 3.0}, {"value": 1.0}], 2.0]}
    resolve_params(cfg.method, cfg.params, [1, 1])  # shardfuse takes what the translation gives
    config = {"merge_method": "linear", "models": [{"model": "a"}], "parameters": {"normalize": False}}
    config["models"][0]["parameters"] = {"weight": 1.0}
    with pytest.raises(UserError, match="linear with normalize: false sums the weighted models"):
        read(folders, config)


def test_task_arithmetic_scale_is_lambda_times_weight_times_the_number_of_models(folders):
    cfg = read(folders, gta("task_arithmetic", {"lambda": 0.5}, weight=[0.2, 0.6]))
    assert cfg.method == "task_arithmetic" and cfg.base == "base"
    assert cfg.params == {"scale": pytest.approx([0.2, 0.6])}  # 0.5 x w x 2
    assert read(folders, gta("task_arithmetic", {"lambda": 0.5, "normalize": True}, weight=0.3)).params == {
        "scale": 0.5
    }
    with pytest.raises(UserError, match=r"different weight values .* give every model the same weight"):
        read(folders, {**gta("task_arithmetic"), "models": [
            {"model": "a", "parameters": {"weight": 1.0}}, {"model": "b", "parameters": {"weight": 0.5}}
        ]})  # fmt: skip


def test_ties_takes_one_density_for_all_and_says_where_its_kept_count_differs(folders):
    filters = [{"filter": "mlp", "value": 0.5}, {"value": 0.25}]
    cfg = read(folders, gta("ties", {"lambda": 0.9}, weight=1.0, density=filters))
    assert (cfg.method, cfg.params) == ("ties", {"density": filters, "scale": 0.9})
    assert any("int(density x numel)" in note for note in cfg.notes)
    with pytest.raises(UserError, match="ties with normalize: false sums the agreeing task vectors"):
        read(folders, gta("ties", {"normalize": False}, weight=1.0))
    with pytest.raises(UserError, match="ties with rescale: true restores each sparsified task vector's L1"):
        read(folders, gta("ties", {"rescale": True}, weight=1.0))
    with pytest.raises(UserError, match="different density values"):
        read(folders, {**gta("ties"), "models": [
            {"model": "a", "parameters": {"weight": 1.0, "density": 0.5}},
            {"model": "b", "parameters": {"weight": 1.0, "density": 0.3}},
        ]})  # fmt: skip


def test_dare_and_della_under_their_mergekit_names(folders):
    with pytest.raises(UserError, match=r"dare_ties with normalize: false .* set normalize: true"):
        read(folders, gta("dare_ties", weight=1.0, density=0.5))
    ties = read(folders, gta("dare_ties", {"normalize": True, "lambda": 0.7}, weight=1.0, density=0.5))
    assert ties.params == {"density": 0.5, "sign_election": True, "scale": 0.7}
    linear = read(folders, gta("dare_linear", weight=0.5, density=0.4))
    assert (linear.method, linear.params) == ("dare", {"density": 0.4, "sign_election": False, "scale": 1.0})
    assert any("seeded stream" in note for note in linear.notes)
    with pytest.raises(UserError, match="dare_linear with rescale: false leaves kept entries unscaled"):
        read(folders, gta("dare_linear", {"rescale": False}, weight=0.5))
    della = read(folders, gta("della", weight=1.0, density=0.5, epsilon=0.1))
    assert (della.method, della.params["sign_election"], della.params["epsilon"]) == ("della", True, 0.1)
    della_linear = read(folders, gta("della_linear", weight=0.5, density=0.5))
    assert della_linear.params == {"density": 0.5, "epsilon": 0.15, "sign_election": False, "scale": 1.0}
    for cfg in (ties, linear, della, della_linear):
        resolve_params(cfg.method, cfg.params, [1, 1])


def test_slerp_puts_the_base_first_and_a_listed_base_of_a_task_vector_method_is_only_the_base(folders):
    listed = {"merge_method": "slerp", "base_model": "b", "parameters": {"t": [0.0, 1.0]}}
    cfg = read(folders, {**listed, "models": [{"model": "a"}, {"model": "b"}]})
    assert (cfg.method, cfg.models, cfg.base, cfg.params) == ("slerp", ("b", "a"), None, {"t": [0.0, 1.0]})
    assert read(folders, {**listed, "models": [{"model": "a"}]}).models == ("b", "a")
    with pytest.raises(UserError, match="slerp interpolates base_model and exactly one other model"):
        read(folders, {**listed, "models": [{"model": "a"}, {"model": "c"}]})
    listed_base = [{"model": "base"}, {"model": "a"}, {"model": "b"}]
    ties = read(folders, {**gta("ties", {"weight": 1.0}), "models": listed_base})
    assert ties.models == ("a", "b") and ties.base == "base"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"slices": []}, "slices (frankenmerges, passthrough of layer ranges) are not a shardfuse merge"),
        ({"tokenizer": {"source": "union"}}, "tokenizer (a union or mapped vocabulary) is not implemented"),
        ({"merge_method": "passthrough"}, "merge_method 'passthrough' is not one shardfuse implements"),
        ({"merge_method": "nearswap"}, "merge_method 'nearswap' is not one shardfuse implements"),
        ({"tokenizer_source": "union"}, "tokenizer_source: union (a merged vocabulary) is not implemented"),
        ({"shard_size": 3}, "unknown field 'shard_size'"),
        ({"base_model": "org/model-7b"}, "base_model 'org/model-7b' is not a local folder or file"),
        ({"base_model": None}, "ties needs base_model"),
        ({"dtype": "int8"}, "dtype 'int8' is not a float dtype"),
        ({"parameters": {"lambda": 1.0, "weight": 1.0, "gamma": 0.1}}, "ties has no parameter 'gamma'"),
        ({"models": [{"model": "a", "parameters": {"lambda": 2.0, "weight": 1.0}}]},
         "models[0].parameters.lambda is one value for the whole merge"),
        ({"parameters": {}, "models": [{"model": "a"}]}, "models[0] has no weight; give parameters.weight"),
        ({"models": [{"model": "a+lora/x"}]}, "is a model+LoRA reference"),
        ({"models": [{"model": "a", "layer_range": [0, 2]}]}, "models[0] must be {model: PATH"),
    ],
)  # fmt: skip
def test_what_shardfuse_does_not_run_as_mergekit_would_is_one_line_naming_the_field(folders, change, message):
    config = {**gta("ties", {"weight": 1.0}), **change}
    with pytest.raises(UserError, match=message if message.startswith("^") else re.escape(message)) as info:
        read(folders, config)
    assert "\n" not in str(info.value) and "merge.yml" in str(info.value)


def test_a_base_where_the_method_takes_none_is_refused(folders):
    with pytest.raises(UserError, match=r"shardfuse's karcher takes no base_model .* remove base_model"):
        read(folders, {"merge_method": "karcher", "base_model": "base", "models": [{"model": "a"}]})


def test_dtype_tokenizer_source_and_the_params_logged(folders):
    cfg = read(folders, {**gta("ties", {"weight": 1.0}), "dtype": "bf16", "tokenizer_source": "base"})
    assert (cfg.dtype, cfg.out_dtype, cfg.tokenizer_source) == ("bfloat16", "bfloat16", "base")
    assert any("computes in float64" in note for note in cfg.notes)
    other = read(folders, {**gta("ties", {"weight": 1.0}), "out_dtype": "float16", "tokenizer_source": "b"})
    assert (other.dtype, other.out_dtype, other.tokenizer_source) == (None, "float16", "b")
    logged = cfg.logged_params()
    assert logged["mergekit.merge_method"] == "ties" and logged["mergekit.parameters.weight"] == "1.0"
    assert logged["mergekit.dtype"] == "bf16" and len(cfg.sha256) == 64


def test_a_config_path_that_is_not_a_file_is_refused_without_reading_it(folders):
    import os

    os.mkfifo(folders / "pipe.yml")  # reading a FIFO would wait for a writer forever
    for path in (folders / "pipe.yml", folders / "a", folders / "missing.yml"):
        with pytest.raises(UserError, match="is not a file; give a mergekit YAML file"):
            mergekit.read(path)


def test_an_alias_bomb_in_a_mergekit_yaml_is_refused_before_anything_writes_it_out(folders):
    """A weight whose aliases write out to 490 million values (a "billion laughs") was read without a
    word, to be written out by the logged params' JSON and the gradient's interpolation; refused from the
    node graph, as a config file is."""
    layers = ['&a ["lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol", "lol"]']
    for previous, name in zip("abcdefgh", "bcdefghi", strict=True):
        layers.append(f"&{name} [{', '.join([f'*{previous}'] * 9)}]")
    path = folders / "bomb.yml"
    path.write_text(
        f"merge_method: linear\nmodels:\n  - model: a\n    parameters: {{weight: [{', '.join(layers)}]}}\n"
        "  - model: b\n    parameters: {weight: 1.0}\n"
    )
    with pytest.raises(UserError) as refused:
        mergekit.read(path)
    assert str(refused.value) == (
        f"mergekit config {path}: writes out to 490,329,073 values through its aliases (*name of an &name "
        "anchor), more than 1,000,000; write the values out or use fewer aliases"
    )
