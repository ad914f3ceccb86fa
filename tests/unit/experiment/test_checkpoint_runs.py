"""Runs over existing checkpoints, as the config check sees them (shardfuse/experiment/checkpoint_runs.py):
one rank per checkpoint, no partition or training, a name of their own; sources that are missing,
pickled, or of another architecture or dtype refused before any job, naming the file and the tensor.
The collect stage and the workflow: tests/stages/test_collect.py."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError

TENSORS = {"layer.weight": np.zeros((4, 3), np.float32), "layer.bias": np.zeros(4, np.float32)}


def config(tmp_path: Path, **run) -> dict:
    return {
        "datasets": {"digits": {"source": "digits"}},
        "runs": {"mine": {"merge_method": "uniform", **run}, "other": {}},
        "run_defaults": {"dataset": "digits", "world_size": 3, "strategy": "ddp", "partition": "iid"},
    }


def write(path: Path, tensors: dict = TENSORS) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path))
    return str(path)


def test_a_run_over_checkpoints_has_one_rank_each_and_a_name_of_its_own(tmp_path):
    folder = tmp_path / "ft"
    write(folder / "model.safetensors")
    run = {"checkpoints": [write(tmp_path / "a.safetensors"), str(folder), "run:other"]}
    experiment = load_experiment(config(tmp_path, **run), environ={})
    mine = experiment.runs["mine"]
    assert (mine["world_size"], mine["strategy"], mine["sync_every"], mine["partition"]) == (
        3,
        "localsgd",
        0,
        "iid",
    )
    assert mine["checkpoint_sources"] == [
        {"file": run["checkpoints"][0]},
        {"folder": str(folder)},
        {"run": "other"},
    ]
    assert re.fullmatch(r"digits-c3-checkpoints-[0-9a-f]{10}", experiment.training("mine"))
    assert experiment.training("other").startswith("digits-w3-ddp-")  # a trained run keeps its name
    again = load_experiment(config(tmp_path, **run, lr=0.5), environ={})  # training keys are not read
    assert again.training("mine") == experiment.training("mine")


F32, F16 = np.float32, np.float16
NARROW = {"layer.weight": np.zeros((4, 2), F32), "layer.bias": np.zeros(4, F32)}
HALF = {"layer.weight": np.zeros((4, 3), F16), "layer.bias": np.zeros(4, F16)}
FIRST = "{a} (checkpoints[0])"


@pytest.mark.parametrize(
    ("second", "message"),
    [
        (NARROW, "'layer.weight' of {b} is torch.float32 [4, 2] but " + FIRST + " has torch.float32 [4, 3]"),
        (HALF, "tensor 'layer.bias' of {b} is torch.float16 [4] but " + FIRST + " has torch.float32 [4]"),
        ({"layer.weight": np.zeros((4, 3), F32)}, "{b} has no tensor 'layer.bias', which " + FIRST),
        ({**TENSORS, "extra": np.zeros(1, F32)}, "{b} has tensor 'extra', which " + FIRST + " lacks"),
    ],
)  # fmt: skip
def test_checkpoints_of_another_architecture_or_dtype_are_refused_naming_the_file_and_tensor(
    tmp_path, second, message
):
    a, b = write(tmp_path / "a.safetensors"), write(tmp_path / "b.safetensors", second)
    with pytest.raises(ConfigError) as error:
        load_experiment(config(tmp_path, checkpoints=[a, b]), environ={})
    assert str(error.value).startswith("config error at runs[mine].checkpoints[1]: ")
    assert message.format(a=a, b=b) in str(error.value)


def test_missing_pickled_and_misplaced_sources_are_one_line_before_any_job(tmp_path):
    a = write(tmp_path / "a.safetensors")
    pickled = tmp_path / "old"
    pickled.mkdir()
    (pickled / "pytorch_model.bin").write_bytes(b"not unpickled")
    mine = "runs[mine]"
    cases = [
        ({"checkpoints": [a, str(tmp_path / "nope")]}, f"{mine}.checkpoints[1]: ", "is not a file or folder"),
        ({"checkpoints": [a, str(pickled)]}, f"{mine}.checkpoints[1]: ", "holds pytorch_model.bin but no"),
        ({"checkpoints": [a], "base": str(pickled)}, f"{mine}.base: ", "shardfuse reads safetensors only"),
        ({"base": a}, f"{mine}.base: ", "set checkpoints too, or remove base"),
        ({"checkpoints": [a], "init_from": a}, f"{mine}.init_from: ", "a run over checkpoints is not"),
        ({"checkpoints": ["run:nobody"]}, f"{mine}.checkpoints: ", "run:nobody names no run named 'nobody'"),
        ({"checkpoints": ["run:mine"]}, f"{mine}.checkpoints: ", "run:mine names itself"),
        ({"checkpoints": [a], "merge_method": "weighted"}, f"{mine}.merge_weights: ", "checkpoints do not"),
    ]  # fmt: skip
    for run, where, message in cases:
        with pytest.raises(ConfigError) as error:
            load_experiment(config(tmp_path, **run), environ={})
        assert f"config error at {where}" in str(error.value) and message in str(error.value), run


def test_a_mergekit_yaml_makes_a_run_over_its_models_with_its_method_under_shardfuse_names(tmp_path):
    import yaml

    a, b, base = (write(tmp_path / f"{name}.safetensors") for name in ("a", "b", "base"))
    gradient = [{"filter": "bias", "value": 0.5}, {"value": [0.2, 0.6]}]
    (tmp_path / "merge.yml").write_text(
        yaml.safe_dump(
            {
                "merge_method": "ties",
                "base_model": base,
                "parameters": {"lambda": 0.9, "weight": 1.0},
                "models": [
                    {"model": a, "parameters": {"density": gradient}},
                    {"model": b, "parameters": {"density": gradient}},
                ],
            }
        )
    )
    cfg = config(tmp_path)
    cfg["runs"]["mine"] = {"mergekit_config": str(tmp_path / "merge.yml")}
    mine = load_experiment(cfg, environ={}).runs["mine"]
    assert (mine["checkpoints"], mine["base"], mine["world_size"]) == ([a, b], base, 2)
    assert (mine["merge_method"], mine["merge_density"], mine["merge_scale"]) == ("ties", gradient, 0.9)
    cfg["runs"]["mine"]["merge_density"] = 0.3
    with pytest.raises(
        ConfigError, match=r"mergekit_config: the YAML gives .* the run sets merge_density too"
    ):
        load_experiment(cfg, environ={})
    cfg["runs"]["mine"] = {"mergekit_config": str(tmp_path / "merge.yml")}
    (tmp_path / "merge.yml").write_text(
        yaml.safe_dump({"merge_method": "passthrough", "models": [{"model": a}]})
    )
    with pytest.raises(ConfigError, match=r"runs\[mine\].mergekit_config: mergekit config .*passthrough"):
        load_experiment(cfg, environ={})
