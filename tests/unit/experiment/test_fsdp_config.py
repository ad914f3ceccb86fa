"""The fsdp run key (issue 31) as the config loads: 1 (the default) leaves every training name as it was,
S > 1 names a new training, and each combination sharding cannot serve is one line before any job. The
lookup of an hf or user model's wrap units (a subprocess on the meta device) runs for real here."""

from __future__ import annotations

import pytest

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from tests.support.helpers import base_config


def experiment(world_size=4, **run):
    config = base_config({"r": {"strategy": "ddp", "merge_method": "consolidate", **run}})
    config["run_defaults"]["world_size"] = world_size
    return load_experiment(config, environ={})


def test_fsdp_1_keeps_the_training_name_and_sharding_names_a_new_training():
    plain = experiment()
    assert experiment(fsdp=1).training("r") == plain.training("r")
    assert experiment(fsdp=1, fsdp_precision="fp32").training("r") == plain.training("r")
    sharded = experiment(fsdp=2)
    assert sharded.training("r") != plain.training("r")
    assert sharded.runs["r"]["fsdp"] == 2


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"fsdp": 3}, "runs[r].fsdp: 3 shards per replica do not divide world_size 4"),
        (
            {"fsdp": 2, "model": "cnn"},
            "runs[r].fsdp: fsdp 2 needs the model's wrap units, which the built-in cnn",
        ),
        (
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "uniform", "init": "per_rank"},
            "runs[r].init: init 'per_rank' with fsdp 2: it draws each rank's own weights",
        ),
        (
            {"fsdp": 2, "strategy": "localsgd", "merge_method": "uniform", "merge_align": "weight_matching"},
            "runs[r].merge_align: merge_align 'weight_matching' with fsdp 2",
        ),
        ({"fsdp": 2, "adapter": {"type": "lora", "r": 4}}, "runs[r].adapter: adapter"),
        ({"fsdp": 2, "keep": "best", "eval_every": 5}, "runs[r].keep: keep 'best' with fsdp 2"),
        ({"fsdp": 2, "precision": "bf16"}, "runs[r].precision: bf16 autocast with fsdp 2"),
        ({"fsdp_precision": "bf16"}, "runs[r].fsdp_precision: sets FSDP's mixed precision but fsdp is 1"),
        ({"fsdp": 0}, "runs[r]"),
    ],
)
def test_what_sharding_cannot_serve_is_one_line(run, message, monkeypatch):
    monkeypatch.setattr("shardfuse.experiment.checks.check_model_adapter", lambda *a, **k: {"checked": True})
    with pytest.raises(ConfigError) as caught:
        experiment(**run)
    assert message in str(caught.value) and "\n" not in str(caught.value)


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
        experiment(fsdp=2, model="plain:plain", code_paths=[str(code)])
    assert str(caught.value) == (
        "config error at runs[r].fsdp: fsdp > 1 needs wrap units but model 'plain:plain' has none: the "
        "built-in mlp and transformer, and Hugging Face models (their _no_split_modules) have them; a user "
        "model returns its blocks from a method fsdp_units(); or set fsdp: 1"
    )
    assert not list(tmp_path.glob(".snakemake/shardfuse/init-checks/*.json"))  # a refusal is not cached
    experiment(fsdp=2, model="plain:units", code_paths=[str(code)])
    (verdict,) = tmp_path.glob(".snakemake/shardfuse/init-checks/*.json")
    assert '"units": 2' in verdict.read_text()
