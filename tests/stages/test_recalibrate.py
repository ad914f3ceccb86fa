"""BatchNorm after fusion: the merged model's running statistics re-estimated on the validation split."""

from __future__ import annotations

import json

import pytest
import torch

from shardfuse.data import load_table, read_dataset_info
from shardfuse.models import build_model, model_spec
from shardfuse.recalibrate import recalibrate_batchnorm
from tests.support.helpers import run_stage


@pytest.fixture(scope="module")
def cnn_spec_and_data(digits_images_data):
    dataset, _ = digits_images_data
    spec = model_spec("cnn", {"channels": [6, 5]}, [], read_dataset_info(dataset))
    return spec, dataset


def test_recalibration_sets_the_statistics_the_validation_split_measures(cnn_spec_and_data):
    spec, dataset = cnn_spec_and_data
    torch.manual_seed(0)
    tensors = {k: v.clone() for k, v in build_model(spec).state_dict().items()}
    tensors["features.1.running_mean"].fill_(5.0)  # stale statistics, as after averaging
    val = dataset / "val.parquet"
    updated, done = recalibrate_batchnorm(tensors, spec, val, batch_size=100_000)  # one batch
    assert done == {"batchnorm_layers": 2, "rows": 179, "batch_size": 100_000}
    # By hand: the first conv's outputs over the whole split, per channel.
    images, _ = load_table(val)
    conv = torch.nn.functional.conv2d(
        images, tensors["features.0.weight"], tensors["features.0.bias"], padding=1
    )
    torch.testing.assert_close(
        updated["features.1.running_mean"], conv.mean(dim=(0, 2, 3)), rtol=1e-4, atol=1e-5
    )
    torch.testing.assert_close(
        updated["features.1.running_var"], conv.var(dim=(0, 2, 3), unbiased=True), rtol=1e-4, atol=1e-5
    )
    # Only the statistics change; the weights are untouched.
    for name, tensor in tensors.items():
        if not name.endswith(("running_mean", "running_var", "num_batches_tracked")):
            assert torch.equal(updated[name], tensor), name


def test_recalibration_leaves_a_model_without_batchnorm_as_it_is(digits_dataset):
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], read_dataset_info(digits_dataset))
    tensors = build_model(spec).state_dict()
    updated, done = recalibrate_batchnorm(tensors, spec, digits_dataset / "val.parquet", 64)
    assert done["batchnorm_layers"] == 0 and updated is tensors


def test_merge_recalibrate_repairs_an_averaged_cnn(tmp_path, digits_images_data):
    dataset, shards = digits_images_data
    config = {
        "model": "cnn", "model_args": {"channels": [8, 16]}, "hidden_sizes": [64], "activation": "relu",
        "dropout": 0.0, "optimizer": "adamw", "lr": 0.003, "momentum": 0.9, "weight_decay": 0.0,
        "batch_size": 32, "epochs": 6, "seed": 0, "strategy": "localsgd", "sync_every": 0,
    }  # fmt: skip
    ranks = tmp_path / "t" / "ranks"
    proc = run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", ranks, "--", "--run-name", "t", "--shard-dir", shards,
        "--dataset-dir", dataset, "--config-json", json.dumps(config), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    gather = tmp_path / "t" / "gather.json"
    assert run_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", gather).returncode == 0
    scores = {}
    for flag in ([], ["--recalibrate"]):
        out = tmp_path / ("recalibrated" if flag else "plain")
        proc = run_stage(
            "merge", "--gather", gather, "--method", "uniform", "--val-split", dataset / "val.parquet", *flag,
            "--out-weights", out / "merged.safetensors", "--out-json", out / "merge.json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        proc = run_stage(
            "evaluate", "--run", "t", "--test", dataset / "test.parquet", "--gather", gather,
            "--merged", out / "merged.safetensors", "--out", out / "eval.json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        scores[bool(flag)] = json.loads((out / "eval.json").read_text())["merged"]["accuracy"]
        record = json.loads((out / "merge.json").read_text())
        assert (record.get("recalibration") or {}).get("batchnorm_layers", 0) == (2 if flag else 0)
    print(f"uniform soup of 2 CNN ranks: {scores[False]:.4f}, recalibrated {scores[True]:.4f}")
    assert scores[True] >= scores[False]
