"""The collect stage as the collect rule runs it (python -m shardfuse.collect): a run's existing
checkpoints (a plain safetensors file, a save_pretrained-style folder) loaded into the run's model and
written as a training's folder, which gather then accepts as is; a checkpoint that does not fit the model
is one line naming the file and the tensor, and leaves no folder. The config side:
tests/unit/experiment/test_checkpoint_runs.py; the whole workflow: tests/workflow/test_checkpoint_runs.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardfuse.checkpoints.gather_record import GatherRecord
from shardfuse.data.shard_set import partition_parquet
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from shardfuse.prepare import prepare
from tests.support.helpers import call_stage

MODEL_KEYS = {"model": "mlp", "hidden_sizes": [16], "activation": "relu", "dropout": 0.0, "seed": 0}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("collect")
    info = prepare("digits", {"source": "digits"}, root / "digits")
    partition_parquet(root / "digits" / "train.parquet", root / "w1", 1, 0)
    spec = model_spec(
        "mlp", {}, [], info, run_cfg={"hidden_sizes": [16], "activation": "relu", "dropout": 0.0}
    )
    checkpoints = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        state = {k: v.contiguous() for k, v in build_model(spec).state_dict().items()}
        state = {
            k: v + seed if v.is_floating_point() and k.startswith("net.") else v for k, v in state.items()
        }
        checkpoints.append(state)
    save_file(checkpoints[0], str(root / "a.safetensors"))
    (root / "ft").mkdir()
    save_file(checkpoints[1], str(root / "ft" / "model.safetensors"))  # a save_pretrained-style folder
    return {"root": root, "states": checkpoints}


def collect_args(root: Path, out: Path, *sources: Path) -> list[object]:
    args = ["--run-name", "digits-c2-checkpoints-0123456789", "--shard-dir", root / "w1"]
    args += ["--dataset-dir", root / "digits", "--config-json", json.dumps(MODEL_KEYS), "--out-dir", out]
    for source in sources:
        args += ["--checkpoint", source]
    return args


def test_checkpoints_become_a_training_folder_that_gather_accepts(data, tmp_path):
    root, out = data["root"], tmp_path / "ranks"
    proc = call_stage("collect", *collect_args(root, out, root / "a.safetensors", root / "ft"))
    assert proc.returncode == 0, proc.stderr
    for rank, state in enumerate(data["states"]):
        written = load_file(str(out / f"rank-{rank}.safetensors"))
        assert written.keys() == state.keys() and all(torch.equal(written[k], state[k]) for k in state)
    train = json.loads((out / "train.json").read_text())
    assert (train["mode"], train["world_size"], train["num_steps"]) == ("checkpoints", 2, 0)
    assert [entry["source"] for entry in train["ranks"]] == [str(root / "a.safetensors"), str(root / "ft")]
    proc = call_stage("gather", "--train-dir", out, "--world-size", 2, "--out", tmp_path / "gather.json")
    assert proc.returncode == 0, proc.stderr
    gather = GatherRecord.from_json(json.loads((tmp_path / "gather.json").read_text()))
    assert [rank.path for rank in gather.ranks] == [
        str(out / "rank-0.safetensors"),
        str(out / "rank-1.safetensors"),
    ]
    base = load_file(str(out / "base.safetensors"))  # the model as its keys build it (seed 0)
    assert not torch.equal(base["net.0.weight"], data["states"][0]["net.0.weight"])


def test_a_checkpoint_that_does_not_fit_the_model_is_one_line_and_leaves_no_folder(data, tmp_path):
    root, out = data["root"], tmp_path / "ranks"
    wrong = {**data["states"][0], "net.0.weight": torch.zeros(3, 64)}
    save_file(wrong, str(tmp_path / "wrong.safetensors"))
    proc = call_stage(
        "collect", *collect_args(root, out, root / "a.safetensors", tmp_path / "wrong.safetensors")
    )
    assert proc.returncode != 0
    wrong = tmp_path / "wrong.safetensors"
    line = f"checkpoint 1: {wrong}" + ": tensor 'net.0.weight' is torch.float32 [3, 64]"
    assert line in proc.stderr
    assert not out.exists() and not list(tmp_path.glob(".ranks-*"))


def test_an_out_dir_of_files_collect_did_not_write_is_refused_and_kept(data, tmp_path):
    root, out = data["root"], tmp_path / "mine"
    out.mkdir()
    (out / "notes.txt").write_text("keep me")
    proc = call_stage("collect", *collect_args(root, out, root / "a.safetensors"))
    assert (
        proc.returncode != 0
        and "holds files that a training (train or collect) did not write (no train.json" in proc.stderr
    )
    assert (out / "notes.txt").read_text() == "keep me"
