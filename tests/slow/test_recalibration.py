"""The recalibration demonstration: a uniform soup of two CNN ranks, merged with --recalibrate, scores at
least as well as without (BatchNorm statistics re-estimated on the validation split). The fast tier
keeps the unit tests of the statistics (tests/stages/test_recalibrate.py)."""

from __future__ import annotations

import json

from tests.support.helpers import run_stage


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
