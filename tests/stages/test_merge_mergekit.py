"""``python -m shardfuse.merge --mergekit FILE --out DIR``: model folders merged as a mergekit YAML says
(shardfuse.fusion.folders), on small folders made here; against mergekit itself:
tests/services/test_mergekit_folders.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.registry import resolve_params
from tests.support.helpers import call_stage

NAMES = ["embed.weight", "layers.0.mlp.weight", "layers.0.attn.weight", "layers.1.mlp.weight", "norm.bias"]


def make_folder(path: Path, seed: int, names=NAMES, tokenizer: str | None = None) -> Path:
    rng = np.random.default_rng(seed)
    path.mkdir()
    tensors = {name: rng.normal(size=(4, 6)).astype(np.float32) for name in names}
    tensors["steps"] = np.array([7], dtype=np.int64)  # not a float: copied, and must agree
    save_file(tensors, str(path / "model.safetensors"), metadata={"format": "pt"})
    (path / "config.json").write_text(json.dumps({"model_type": "toy", "torch_dtype": "float32"}))
    if tokenizer is not None:
        (path / "tokenizer.json").write_text(tokenizer)
    return path


@pytest.fixture
def folders(tmp_path) -> Path:
    make_folder(tmp_path / "base", 0, tokenizer='{"from": "base"}')
    make_folder(tmp_path / "a", 1, tokenizer='{"from": "a"}')
    make_folder(tmp_path / "b", 2)
    return tmp_path


def write_yaml(root: Path, config: dict, name: str = "merge.yml") -> Path:
    text = json.dumps(config)
    for folder in ("base", "a", "b", "c"):
        text = text.replace(f'"{folder}"', json.dumps(str(root / folder)))
    (root / name).write_text(yaml.safe_dump(json.loads(text)))
    return root / name


TIES = {
    "merge_method": "ties",
    "base_model": "base",
    "parameters": {
        "weight": 1.0,
        "density": [{"filter": "mlp", "value": 0.5}, {"value": 0.75}],
        "lambda": 0.8,
    },
    "models": [{"model": "a"}, {"model": "b"}],
}


def test_the_folders_are_merged_with_config_tokenizer_yaml_and_record(folders):
    config = write_yaml(folders, {**TIES, "out_dtype": "float16", "tokenizer_source": "a"})
    proc = call_stage("merge", "--mergekit", config, "--out", folders / "out")
    assert proc.returncode == 0, proc.stderr
    assert "with ties (shardfuse's ties)" in proc.stdout and "note: TIES keeps round(" in proc.stdout
    out = folders / "out"
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json", "merge.json", "mergekit_config.yml", "model.safetensors", "tokenizer.json",
    ]  # fmt: skip
    assert json.loads((out / "config.json").read_text())["torch_dtype"] == "float16"
    assert (out / "tokenizer.json").read_text() == '{"from": "a"}'
    assert (out / "mergekit_config.yml").read_text() == config.read_text()
    record = json.loads((out / "merge.json").read_text())
    assert (record["mergekit_method"], record["method"], record["out_dtype"]) == ("ties", "ties", "float16")
    assert [i["model"] for i in record["inputs"]] == [str(folders / "a"), str(folders / "b")]
    merged = load_file(str(out / "model.safetensors"))
    with safe_open(str(out / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt"}
    ranks = [load_file(str(folders / name / "model.safetensors")) for name in "ab"]
    base = load_file(str(folders / "base" / "model.safetensors"))
    for name in NAMES:  # each tensor's density by the filter list, merged in float64, rounded once
        density = 0.5 if "mlp" in name else 0.75
        params = resolve_params("ties", {"density": density, "scale": 0.8}, [1, 1])
        expected, _ = merge_arrays("ties", params, [r[name].astype(np.float64) for r in ranks], base[name])
        assert merged[name].dtype == np.float16
        np.testing.assert_array_equal(merged[name], expected.astype(np.float32).astype(np.float16))
    assert merged["steps"].dtype == np.int64 and merged["steps"].tolist() == [7]


def test_an_output_folder_it_did_not_write_is_refused_and_left_as_it_was(folders):
    (folders / "mine").mkdir()
    (folders / "mine" / "notes.txt").write_text("keep me")
    config = write_yaml(folders, TIES)
    proc = call_stage("merge", "--mergekit", config, "--out", folders / "mine")
    assert proc.returncode != 0 and "holds files that merge --mergekit did not write" in proc.stderr
    assert [p.name for p in (folders / "mine").iterdir()] == ["notes.txt"]
    assert call_stage("merge", "--mergekit", config, "--out", folders / "out").returncode == 0
    assert call_stage("merge", "--mergekit", config, "--out", folders / "out").returncode == 0  # its own


@pytest.mark.parametrize(
    ("broken", "message"),
    [
        ("pickled", "holds pytorch_model.bin but no model.safetensors: shardfuse reads safetensors only"),
        ("architecture", "has no tensor 'layers.1.mlp.weight', which"),
        (
            "gradient",
            "(run as shardfuse's ties): merge_density is a gradient of 4 values but the tensors merged have",
        ),
        ("method", "merge_method 'passthrough' is not one shardfuse implements"),
    ],
)
def test_bad_input_is_one_line_and_leaves_nothing_behind(folders, broken, message):
    config = dict(TIES)
    if broken == "pickled":
        (folders / "c").mkdir()
        (folders / "c" / "pytorch_model.bin").write_bytes(b"\x80\x04not unpickled")
        config["models"] = [{"model": "a"}, {"model": "c"}]
    elif broken == "architecture":
        make_folder(folders / "c", 3, names=NAMES[:3])
        config["models"] = [{"model": "a"}, {"model": "c"}]
    elif broken == "gradient":
        config["parameters"] = {**TIES["parameters"], "density": [0.2, 0.4, 0.6, 0.8]}  # 2 layers
    else:
        config["merge_method"] = "passthrough"
    proc = call_stage("merge", "--mergekit", write_yaml(folders, config), "--out", folders / "out")
    assert proc.returncode != 0
    assert message in proc.stderr and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
    assert not (folders / "out").exists() and not list(folders.glob(".out*"))


def test_a_filter_that_names_no_tensor_is_a_warning(folders):
    config = dict(TIES)
    config["parameters"] = {
        **TIES["parameters"],
        "density": [{"filter": "self_attn", "value": 0.5}, {"value": 1}],
    }
    proc = call_stage("merge", "--mergekit", write_yaml(folders, config), "--out", folders / "out")
    assert proc.returncode == 0, proc.stderr
    assert "self_attn" in proc.stderr and "matches no tensor" in proc.stderr


def test_with_mergekit_a_runs_flags_are_refused(folders):
    config = write_yaml(folders, TIES)
    proc = call_stage("merge", "--mergekit", config, "--out", folders / "out", "--method", "ties")
    assert proc.returncode != 0 and "--method is a run's merge; with --mergekit" in proc.stderr
    proc = call_stage("merge", "--mergekit", config)
    assert proc.returncode != 0 and "--mergekit FILE and --out DIR go together" in proc.stderr
