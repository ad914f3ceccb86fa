"""A foreign init_from is checked against the model while the config loads (in a subprocess: the config
loader stays torch-free), its pass cached; a shardfuse checkpoint keeps its init_source and is not
checked there; the checked tensors follow init_from_prefix."""

from __future__ import annotations

import subprocess
import sys

import pytest
from safetensors.torch import save_file

from shardfuse.checkpoints.weights import save_weights
from shardfuse.data.sources.describe import info_from_spec
from shardfuse.experiment import init_check
from shardfuse.experiment.keys import train_config, training_name
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.models.adapter import storable_state
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec


def experiment(runs: dict):
    config = {"runs": runs, "datasets": {"d": {"source": "digits"}}, "run_defaults": {"dataset": "d"}}
    return load_experiment(config)


def mlp_state(hidden: int = 64, prefix: str = "") -> dict:
    spec = model_spec("mlp", {"hidden_sizes": [hidden]}, [], info_from_spec({"source": "digits"}))
    return {prefix + name: t.contiguous() for name, t in storable_state(build_model(spec))[0].items()}


def no_subprocess(monkeypatch) -> None:
    def refuse(*args, **kwargs):
        raise AssertionError("the check ran again instead of its cached pass")

    monkeypatch.setattr(init_check.subprocess, "run", refuse)


def test_a_foreign_file_that_fits_is_checked_once_and_its_pass_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for folder in ("plain", "folder"):
        (tmp_path / folder).mkdir()
        save_file(mlp_state(), tmp_path / folder / "model.safetensors")
    save_file(mlp_state(prefix="model."), tmp_path / "wrapped.safetensors")
    runs = {
        "scratch": {},
        "file": {"init_from": "plain/model.safetensors"},
        "folder": {"init_from": "folder"},
        "wrapped": {"init_from": "wrapped.safetensors", "init_from_prefix": {"model.": ""}},
    }
    found = experiment(runs).runs
    assert found["file"]["init_source"] == {"file": "plain/model.safetensors"}
    assert found["folder"]["init_source"] == {"folder": "folder"}
    assert len({training_name(cfg) for cfg in found.values()}) == 4
    assert train_config(found["wrapped"])["init_from_prefix"] == {"model.": ""}
    assert "init_from_prefix" not in train_config(found["file"])  # joins the name only when set
    # The file and the folder hold the same header: one check; the prefixed file another.
    assert len(list((tmp_path / init_check.CACHE_DIR).glob("*.json"))) == 2
    no_subprocess(monkeypatch)
    assert experiment(runs).runs == found


def test_a_misfit_foreign_file_fails_while_the_config_loads_and_is_not_cached(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    save_file(mlp_state(hidden=9), tmp_path / "w.safetensors")
    with pytest.raises(ConfigError) as caught:
        experiment({"r": {"init_from": "w.safetensors"}})
    assert str(caught.value) == (
        "config error at runs[r].init_from: init_from w.safetensors: tensor 'net.0.weight' is "
        "torch.float32 [9, 64] but the model needs torch.float32 [64, 64]; start from weights of this "
        "architecture (model, model_args), or map the file's names onto the model's with init_from_prefix"
    )
    assert not (tmp_path / init_check.CACHE_DIR).exists()


def test_a_shardfuse_checkpoint_keeps_its_init_source_and_is_not_checked_in_a_subprocess(
    tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    save_weights(tmp_path / "ours.safetensors", mlp_state(hidden=9), {"model": {}})
    no_subprocess(monkeypatch)
    found = experiment({"r": {"init_from": "ours.safetensors"}})
    assert found.runs["r"]["init_source"] == {"file": "ours.safetensors"}


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"init_from_prefix": {"model.": ""}},
            r"runs\[r\].init_from_prefix: it renames the tensors of init_from but init_from is not set",
        ),
        (
            {"init_from": "torch_folder"},
            r"runs\[r\].init_from: init_from torch_folder holds pytorch_model.bin",
        ),
        ({"init_from": "empty"}, r"init_from empty is a folder without model.safetensors"),
    ],
)
def test_init_keys_that_cannot_work_fail_without_building_the_model(tmp_path, monkeypatch, run, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "torch_folder").mkdir()
    (tmp_path / "torch_folder" / "pytorch_model.bin").write_bytes(b"never unpickled")
    (tmp_path / "empty").mkdir()
    no_subprocess(monkeypatch)
    with pytest.raises(ConfigError, match=message):
        experiment({"r": run})


def test_the_config_loader_stays_torch_free():
    """The Snakefile's process imports the config loader (with the init_from check) but never torch."""
    code = (
        "import sys, shardfuse.experiment.load, shardfuse.experiment.init_check, "
        "shardfuse.checkpoints.init_weights; print('torch' in sys.modules)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert proc.stdout.strip() == "False"
