"""Training names are content addresses (results/trainings/<name>/): a refactor that changes one makes
every user's finished trainings invisible and re-trains them. The names of every run of the default
experiment and of every example are held to the ones recorded in golden/training_names.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from snakemake.utils import update_config

from shardfuse.experiment.load import load_experiment

REPO = Path(__file__).resolve().parents[2]
GOLDEN = Path(__file__).with_name("golden") / "training_names.json"
# Whose names follow files made on the user's machine: the hf example's pretrained folder (its weights
# are hashed into the names, by design) is written by scripts/make-pretrained.py; its slow test runs it.
# The domains example also reads instruction pairs scripts/make-instructions.py writes; the mergekit
# example's runs are over fine-tuned folders make-pretrained.py --from writes.
MADE_LOCALLY = {"hf_finetune.yaml", "hf_lora.yaml", "domains.yaml", "mergekit.yaml"}
CONFIGS = [
    REPO / "config" / "config.yaml",
    *sorted(p for p in (REPO / "config" / "examples").glob("*.yaml") if p.name not in MADE_LOCALLY),
]


def training_names(config_file: Path) -> dict[str, str]:
    """As Snakemake resolves ``--configfile <example>``: the example laid over config/config.yaml."""
    config = yaml.safe_load(CONFIGS[0].read_text())
    update_config(config, yaml.safe_load(config_file.read_text()))
    experiment = load_experiment(config, environ={})
    return {run: experiment.training(run) for run in sorted(experiment.runs)}


def test_every_config_of_the_repository_is_recorded():
    recorded = set(json.loads(GOLDEN.read_text()))
    assert recorded == {str(path.relative_to(REPO)) for path in CONFIGS}


@pytest.mark.parametrize("config_file", CONFIGS, ids=lambda path: path.name)
def test_training_names_are_unchanged(config_file, monkeypatch):
    monkeypatch.chdir(REPO)  # configs name runs tables and code paths relative to the checkout
    golden = json.loads(GOLDEN.read_text())[str(config_file.relative_to(REPO))]
    assert training_names(config_file) == golden
