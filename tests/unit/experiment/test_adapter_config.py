"""The adapter run key (issue 30) as the config loads: its defaults filled in so that spelling them out
names the same training, a run without it keeps its training name, and every key an adapter rules out
is one line before any job. The check of an adapter against its model (a subprocess on the meta device)
is stubbed here; it runs for real in tests/slow/test_model_checks.py."""

from __future__ import annotations

import pytest

from shardfuse.experiment import model_checks as checks
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError, load_schema
from shardfuse.models.spec import ADAPTER_DEFAULTS
from tests.support.helpers import base_config

LORA = {"type": "lora", "r": 4}


@pytest.fixture(autouse=True)
def no_model_check(monkeypatch):
    """The unit tests of what the config decides need no subprocess."""
    monkeypatch.setattr(checks, "check_model_adapter", lambda *args, **kwargs: {"checked": True})


def experiment(**run):
    return load_experiment(
        base_config({"r": {"strategy": "localsgd", "merge_method": "uniform", **run}}), environ={}
    )


def test_the_defaults_are_the_schemas_and_spelling_them_out_names_the_same_training():
    schema = load_schema()["$defs"]["run"]["properties"]["adapter"]["properties"]
    assert {key: schema[key]["default"] for key in ADAPTER_DEFAULTS if key != "type"} == {
        key: value for key, value in ADAPTER_DEFAULTS.items() if key != "type"
    }
    short = experiment(adapter=LORA)
    spelled = experiment(adapter={**ADAPTER_DEFAULTS, "r": 4, "alpha": 16})
    assert short.training("r") == spelled.training("r")
    assert short.runs["r"]["adapter"] == {**ADAPTER_DEFAULTS, "r": 4}
    assert experiment(adapter={**LORA, "r": 8}).training("r") != short.training("r")
    assert experiment().training("r") not in (short.training("r"),)
    assert experiment(adapter=None).training("r") == experiment().training("r")  # null: unchanged names


@pytest.mark.parametrize(
    ("run", "message"),
    [
        ({"merge_method": "slerp"}, "runs[r].merge_method: slerp cannot fuse LoRA adapters: it"),
        ({"merge_method": "greedy_soup"}, "runs[r].merge_method: greedy_soup cannot fuse LoRA adapters"),
        ({"merge_align": "weight_matching"}, "runs[r].merge_align: LoRA adapters are fused in update space"),
        ({"merge_recalibrate": True}, "runs[r].merge_recalibrate: LoRA adapters are fused in update space"),
        ({"init": "per_rank"}, "runs[r].init: per_rank gives each rank its own base"),
        (
            {"strategy": "ddp", "merge_method": "consolidate", "adapter": {**LORA, "init": "per_rank"}},
            "runs[r].adapter.init: per_rank gives each rank its own adapter but ddp starts every rank",
        ),
        ({"merge_method": "ties", "merge_adapter": "cat"}, "runs[r].merge_adapter: cat is exact only for"),
    ],
)
def test_what_an_adapter_rules_out_is_one_line(run, message):
    with pytest.raises(ConfigError) as caught:
        experiment(**{"adapter": LORA, **run})
    assert message in str(caught.value) and "\n" not in str(caught.value)


def test_merge_adapter_without_an_adapter_and_bad_adapter_keys_are_refused():
    with pytest.raises(ConfigError, match=r"runs\[r\].merge_adapter: writes the fused LoRA update"):
        experiment(merge_adapter="svd")
    for adapter in ({"type": "dora"}, {"type": "lora", "r": 0}, {"type": "lora", "rank": 4}, {"r": 4}):
        with pytest.raises(ConfigError, match=r"runs\[r\]"):
            experiment(adapter=adapter)


def test_a_per_rank_adapter_run_has_the_shared_ddp_adapter_run_as_its_baseline():
    runs = {
        "ddp": {"strategy": "ddp", "merge_method": "consolidate", "adapter": LORA},
        "soup": {"strategy": "localsgd", "merge_method": "uniform", "adapter": {**LORA, "init": "per_rank"}},
        "other": {"strategy": "localsgd", "merge_method": "uniform", "adapter": {**LORA, "r": 8}},
    }
    loaded = load_experiment(base_config(runs), environ={})
    assert loaded.ddp_baseline("soup") == "ddp" and loaded.ddp_baseline("other") is None
