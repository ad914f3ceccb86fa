"""The config's checks that only a model's own code can answer, run for real: a subprocess builds the
model on the meta device before any job, and a fit is cached under .snakemake/ of the working directory
(a refusal is not). An adapter that matches no module, an r above a target's dimension, a user model
without FSDP wrap units. (What the config decides around them, with the subprocess stubbed:
tests/unit/experiment/test_adapter_config.py and test_fsdp_config.py; the ranks' own refusal when the
train stage is run by hand: tests/slow/test_stage_edges.py.)"""

from __future__ import annotations

import pytest

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from tests.support.helpers import base_config


def adapter_experiment(**run):
    return load_experiment(
        base_config({"r": {"strategy": "localsgd", "merge_method": "uniform", **run}}), environ={}
    )


def fsdp_experiment(world_size=4, **run):
    config = base_config({"r": {"strategy": "ddp", "merge_method": "consolidate", **run}})
    config["run_defaults"]["world_size"] = world_size
    return load_experiment(config, environ={})


def test_an_adapter_matching_no_module_is_refused_for_real_naming_the_modules(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the verdicts are cached under .snakemake/ of the working directory
    with pytest.raises(ConfigError) as caught:
        adapter_experiment(adapter={"type": "lora", "target_modules": ["attn"]})
    assert str(caught.value) == (
        "config error at runs[r].adapter: adapter.target_modules ['attn'] matches no module of the model; "
        "its adaptable modules are net.0, net.2: name some of them (or all-linear)"
    )
    assert not list(tmp_path.glob(".snakemake/shardfuse/init-checks/*.json"))  # a refusal is not cached


def test_an_r_above_a_targets_dimension_is_refused_for_real_and_a_fit_is_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError) as caught:
        adapter_experiment(adapter={"type": "lora", "r": 100})
    assert str(caught.value).startswith(
        "config error at runs[r].adapter: adapter.r 100 exceeds the smaller dimension of module 'net.0' "
        "([64, 64]); use r <= 64"
    )
    adapter_experiment(adapter={"type": "lora", "r": 8, "alpha": 4})
    (verdict,) = tmp_path.glob(".snakemake/shardfuse/init-checks/*.json")
    assert verdict.read_text().split() == ["{", '"checked":', "true,", '"targets":', "2", "}"]


def test_a_user_model_without_wrap_units_is_refused_for_real_and_one_with_them_is_cached(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)  # the verdicts are cached under .snakemake/ of the working directory
    code = tmp_path / "code"
    code.mkdir()
    (code / "plain.py").write_text(
        "from torch import nn\n\n"
        "class Plain(nn.Module):\n"
        "    def __init__(self, d):\n"
        "        super().__init__()\n"
        "        self.blocks = nn.ModuleList([nn.Linear(d.num_features, 8), nn.Linear(8, d.num_outputs)])\n\n"
        "    def forward(self, x):\n"
        "        return self.blocks[1](self.blocks[0](x).relu())\n\n"
        "class Units(Plain):\n"
        "    def fsdp_units(self):\n"
        "        return list(self.blocks)\n\n"
        "def plain(d):\n    return Plain(d)\n\n"
        "def units(d):\n    return Units(d)\n"
    )
    with pytest.raises(ConfigError) as caught:
        fsdp_experiment(fsdp=2, model="plain:plain", code_paths=[str(code)])
    assert str(caught.value) == (
        "config error at runs[r].fsdp: fsdp > 1 needs wrap units but model 'plain:plain' has none: the "
        "built-in mlp and transformer, and Hugging Face models (their _no_split_modules) have them; a user "
        "model returns its blocks from a method fsdp_units(); or set fsdp: 1"
    )
    assert not list(tmp_path.glob(".snakemake/shardfuse/init-checks/*.json"))  # a refusal is not cached
    fsdp_experiment(fsdp=2, model="plain:units", code_paths=[str(code)])
    (verdict,) = tmp_path.glob(".snakemake/shardfuse/init-checks/*.json")
    assert '"units": 2' in verdict.read_text()
