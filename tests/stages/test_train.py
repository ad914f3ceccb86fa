"""Training with real torchrun processes (gloo on CPU): what each strategy guarantees about the ranks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shardfuse.checkpoints.weights import load_weights, read_metadata
from shardfuse.launch import staging_dir
from shardfuse.metrics.system import INTERVAL_ENV, peak, read_system_metrics, system_metrics_path
from tests.support.helpers import call_stage, run_stage
from tests.support.training import (
    CPU_METRICS,
    SMALL_TRAIN_CFG,
    SMALL_TRAININGS,
    launch_training,
    run_training,
)


@pytest.fixture(scope="module")
def trained(small_trainings) -> dict[str, Path]:
    """The session's small ddp, independent (localsgd, no sync) and localsgd (sync every 5) trainings."""
    return {name: small_trainings / "results" / "trainings" / name / "ranks" for name in SMALL_TRAININGS}


def rank_tensors(train_dir, rank):
    return load_weights(train_dir / f"rank-{rank}.safetensors")[0]


def test_ddp_ranks_end_bitwise_identical(trained):
    rank0, rank1 = rank_tensors(trained["ddp"], 0), rank_tensors(trained["ddp"], 1)
    assert rank0.keys() == rank1.keys()
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)


def test_independent_localsgd_ranks_really_differ(trained):
    rank0, rank1 = rank_tensors(trained["independent"], 0), rank_tensors(trained["independent"], 1)
    diffs = [(rank0[n] - rank1[n]).abs().max().item() for n in rank0 if n.startswith("net.")]
    assert max(diffs) > 1e-2


def test_every_rank_starts_from_the_saved_base_weights(trained):
    for train_dir in trained.values():
        base_meta = read_metadata(train_dir / "base.safetensors")
        for rank in (0, 1):
            assert (
                read_metadata(train_dir / f"rank-{rank}.safetensors")["init_sha256"]
                == base_meta["init_sha256"]
            )
    # Same seed, same data: the base checkpoint does not depend on the strategy.
    bases = [load_weights(d / "base.safetensors")[0] for d in trained.values()]
    assert all(torch.equal(bases[0][n], other[n]) for other in bases[1:] for n in bases[0])


def test_each_rank_trains_on_exactly_its_own_shard(trained, digits_shards):
    manifest = json.loads((digits_shards / "manifest.json").read_text())
    info = json.loads((trained["ddp"] / "train.json").read_text())
    for shard in manifest["shards"]:
        meta = read_metadata(trained["ddp"] / f"rank-{shard['rank']}.safetensors")
        assert meta["rows"] == shard["rows"]
    assert [r["rows"] for r in info["ranks"]] == [s["rows"] for s in manifest["shards"]]


def test_train_json_and_gather_json_record_the_membership_every_rank_alive_on_its_own_shard(
    trained, tmp_path
):
    info = json.loads((trained["independent"] / "train.json").read_text())
    assert info["membership"] == {
        "num_shards": 2,
        "ranks": [
            {"rank": 0, "replica": 0, "data_shard": 0, "alive": True},
            {"rank": 1, "replica": 1, "data_shard": 1, "alive": True},
        ],
        "lost_ranks": [],
        "alive_replicas": [0, 1],
        "coverage": 1.0,
    }
    out = tmp_path / "gather.json"
    proc = call_stage("gather", "--train-dir", trained["independent"], "--world-size", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["membership"] == info["membership"]


def test_gather_reads_a_train_json_from_before_membership_as_every_rank_alive(trained, tmp_path):
    train_dir = tmp_path / "ranks"
    shutil.copytree(trained["independent"], train_dir)
    info = json.loads((train_dir / "train.json").read_text())
    recorded = info.pop("membership")
    (train_dir / "train.json").write_text(json.dumps(info))
    out = tmp_path / "gather.json"
    proc = call_stage("gather", "--train-dir", train_dir, "--world-size", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(out.read_text())["membership"] == recorded


def test_step_metrics_have_one_row_per_step_on_every_rank(trained):
    import pyarrow.parquet as pq

    info = json.loads((trained["localsgd"] / "train.json").read_text())
    for rank in (0, 1):
        table = pq.read_table(trained["localsgd"] / "metrics" / f"rank-{rank}.parquet").to_pydict()
        assert table["step"] == list(range(1, info["num_steps"] + 1))
        assert all(loss > 0 for loss in table["loss"])
        assert all(sps > 0 for sps in table["samples_per_second"])
    assert info["num_steps"] == info["epochs"] * info["steps_per_epoch"]


def test_failed_training_leaves_no_output_directory(tmp_path, digits_shards):
    out = tmp_path / "bad" / "train"
    empty_dataset = tmp_path / "no-dataset"
    empty_dataset.mkdir()
    cfg = json.dumps({**SMALL_TRAIN_CFG, "strategy": "ddp", "sync_every": 0})
    proc = run_stage(
        "launch",
        "--nproc-per-node",
        2,
        "--out-dir",
        out,
        "--",
        "--run-name",
        "bad",
        "--shard-dir",
        digits_shards,
        "--dataset-dir",
        empty_dataset,
        "--config-json",
        cfg,
    )
    assert proc.returncode == 2
    assert "dataset.json" in proc.stderr  # the rank's own one-line error is in the log
    assert proc.stderr.strip().splitlines()[-1].startswith("shardfuse.launch: error: training failed")
    assert not out.exists()
    assert staging_dir(out).exists()  # kept for inspection, never mistaken for a finished run


def test_geometry_that_disagrees_with_the_shards_fails_before_starting_ranks(
    tmp_path, digits_dataset, digits_shards
):
    out = tmp_path / "bad" / "train"
    proc = run_stage(
        "launch",
        "--nproc-per-node",
        3,
        "--out-dir",
        out,
        "--",
        "--run-name",
        "bad",
        "--shard-dir",
        digits_shards,
        "--dataset-dir",
        digits_dataset,
        "--config-json",
        "{}",
    )
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        "shardfuse.launch: error: the shard set has 2 shards but nodes x nproc_per_node = 1 x 3 = 3; "
        "make world_size and the geometry agree"
    )
    assert not out.exists() and not staging_dir(out).exists()


def test_ddp_broadcasts_buffers_only_for_models_whose_forward_updates_them():
    from shardfuse.models.registry import build_model
    from shardfuse.rank.setup import forward_updates_buffers

    spec = {"type": "mlp", "num_features": 8, "num_classes": 3, "hidden_sizes": [4], "activation": "relu"}
    assert not forward_updates_buffers(build_model({**spec, "dropout": 0.0}))  # input stats: set once
    batch_norm = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    assert forward_updates_buffers(batch_norm)  # running statistics change every forward


def test_bytes_all_reduced_per_rank_follow_the_strategy(trained):
    info = {name: json.loads((path / "train.json").read_text()) for name, path in trained.items()}
    assert [info[n]["mode"] for n in ("ddp", "independent", "localsgd")] == ["ddp", "independent", "localsgd"]
    # The MLP's parameters (64 -> 16 -> 10, float32): the payload of one all-reduce of all of them.
    payload = (64 * 16 + 16 + 16 * 10 + 10) * 4
    assert info["ddp"]["bytes_all_reduced_per_rank"] == info["ddp"]["num_steps"] * payload  # gradients
    assert info["localsgd"]["num_syncs"] == info["localsgd"]["num_steps"] // 5
    assert info["localsgd"]["bytes_all_reduced_per_rank"] == info["localsgd"]["num_syncs"] * payload
    assert info["independent"]["bytes_all_reduced_per_rank"] == 0
    assert info["ddp"]["effective_batch_size"] == SMALL_TRAIN_CFG["batch_size"] * 2
    assert all(
        i["init"] == "shared" and i["keep"] == "last" and i["validation"] is None for i in info.values()
    )


@pytest.fixture(scope="module")
def best_of_own_init(tmp_path_factory, digits_dataset, digits_shards) -> Path:
    """Independent ranks, each from its own initialisation, validated every 4 steps, keeping the best."""
    return run_training(
        tmp_path_factory.mktemp("best"),
        digits_dataset,
        digits_shards,
        "best",
        strategy="localsgd",
        sync_every=0,
        epochs=3,
        lr=0.5,
        eval_every=4,
        keep="best",
        init="per_rank",
    )


def test_keep_best_publishes_each_ranks_best_validated_step(best_of_own_init):
    out = best_of_own_init
    info = json.loads((out / "train.json").read_text())
    assert info["validation"] == {"score": "accuracy", "every": 4}
    for rank in (0, 1):
        table = pq.read_table(out / "metrics" / f"rank-{rank}.parquet").to_pandas()
        validated = table.dropna(subset=["val_score"])
        # Every 4 steps and at each epoch's end.
        every, per_epoch = info["validation"]["every"], info["steps_per_epoch"]
        expected_steps = [s for s in table["step"] if s % every == 0 or s % per_epoch == 0]
        assert validated["step"].tolist() == expected_steps
        best_step = int(validated.loc[validated["val_score"].idxmax(), "step"])  # first of the maxima
        assert info["ranks"][rank]["published_step"] == best_step
        assert info["ranks"][rank]["best_val_score"] == validated["val_score"].max()
        header = read_metadata(out / f"rank-{rank}.safetensors")
        assert header.get("published_step", header["num_steps"]) == best_step


def test_early_stopping_stops_every_rank_at_the_same_step(tmp_path, digits_dataset, digits_shards):
    # lr 0: the validation score never improves, so patience 2 runs out at the third validation.
    out = run_training(
        tmp_path,
        digits_dataset,
        digits_shards,
        "stop",
        strategy="ddp",
        sync_every=0,
        lr=0.0,
        eval_every=5,
        patience=2,
    )
    info = json.loads((out / "train.json").read_text())
    assert info["stopped_early"] is True and info["num_steps"] == 15
    for rank in (0, 1):
        assert read_metadata(out / f"rank-{rank}.safetensors")["num_steps"] == 15


def test_per_rank_init_gives_each_rank_its_own_initial_weights(best_of_own_init):
    out = best_of_own_init
    headers = [read_metadata(out / f"rank-{rank}.safetensors") for rank in (0, 1)]
    assert headers[0]["init_sha256"] != headers[1]["init_sha256"]
    assert all(h["init"] == "per_rank" for h in headers)
    assert headers[0]["init_sha256"] == read_metadata(out / "base.safetensors")["init_sha256"]  # rank 0's
    assert json.loads((out / "train.json").read_text())["init"] == "per_rank"


def test_warmup_longer_than_the_run_fails_before_the_first_step(tmp_path, digits_dataset, digits_shards):
    # Only the train stage knows the step count (it follows the shard sizes): digits' 2 shards of
    # about 630 rows in batches of 64 give 10 steps per epoch, 20 in 2 epochs.
    out = tmp_path / "warm" / "train"
    cfg = json.dumps({**SMALL_TRAIN_CFG, "strategy": "ddp", "sync_every": 0, "warmup_steps": 500})
    proc = run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", out, "--", "--run-name", "warm",
        "--shard-dir", digits_shards, "--dataset-dir", digits_dataset, "--config-json", cfg,
    )  # fmt: skip
    assert proc.returncode == 2
    assert (
        "warmup_steps 500 is longer than the run's 20 optimiser steps (epochs x steps per epoch / "
        "grad_accum_steps); lower warmup_steps or raise epochs" in proc.stderr
    )
    assert proc.stderr.strip().splitlines()[-1].startswith("shardfuse.launch: error: training failed")
    assert not out.exists()
    assert not (staging_dir(out) / "base.safetensors").exists()  # failed before anything was written


def test_torchrun_ranks_sample_system_metrics_and_train_bitwise_as_without(
    tmp_path, monkeypatch, trained, digits_dataset, digits_shards
):
    plain = trained["localsgd"]  # trained with sampling off
    monkeypatch.setenv(INTERVAL_ENV, "0.05")
    sampled = tmp_path / "on"
    cfg = {**SMALL_TRAIN_CFG, **SMALL_TRAININGS["localsgd"]}
    proc = launch_training(sampled, digits_dataset, digits_shards, "localsgd", cfg)
    assert "sysmetrics: warning" not in proc.stderr
    assert not list((plain / "metrics").glob("system-*"))
    for rank in (0, 1):
        path = system_metrics_path(sampled / "metrics", rank)
        metrics = read_system_metrics(path)
        assert set(CPU_METRICS) <= set(metrics)
        assert len(metrics["system/process_rss_megabytes"]) >= 2
        assert peak(metrics)["system/process_rss_megabytes"] > 10  # a rank with torch loaded
        assert not (sampled / "metrics" / f"system-rank-{rank}.f64").exists()
        weights, plain_weights = (load_weights(d / f"rank-{rank}.safetensors")[0] for d in (sampled, plain))
        assert weights.keys() == plain_weights.keys()
        assert all(torch.equal(weights[name], plain_weights[name]) for name in weights)
        losses = [
            pq.read_table(d / "metrics" / f"rank-{rank}.parquet")["loss"].to_numpy() for d in (sampled, plain)
        ]
        assert np.array_equal(*losses)
