"""Training with real torchrun processes (gloo on CPU): what each strategy guarantees about the ranks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardfuse.checkpoint import load_weights, read_metadata
from shardfuse.launch import staging_dir
from tests.helpers import run_stage, subprocess_env

pytestmark = pytest.mark.integration

TRAIN_CFG = {
    "hidden_sizes": [16],
    "activation": "relu",
    "dropout": 0.1,
    "optimizer": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "batch_size": 64,
    "epochs": 2,
    "seed": 3,
}


def run_training(tmp_path, digits_dataset, digits_shards, name, **overrides):
    out = tmp_path / name / "train"
    cfg = json.dumps({**TRAIN_CFG, **overrides})
    proc = run_stage(
        "launch",
        "--nproc-per-node",
        2,
        "--out-dir",
        out,
        "--",
        "--run-name",
        name,
        "--shard-dir",
        digits_shards,
        "--dataset-dir",
        digits_dataset,
        "--config-json",
        cfg,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def trained(tmp_path_factory, digits_dataset, digits_shards):
    tmp = tmp_path_factory.mktemp("train")
    return {
        "ddp": run_training(tmp, digits_dataset, digits_shards, "ddp", strategy="ddp", sync_every=0),
        "independent": run_training(
            tmp, digits_dataset, digits_shards, "ind", strategy="localsgd", sync_every=0
        ),
        "localsgd": run_training(
            tmp, digits_dataset, digits_shards, "lsgd", strategy="localsgd", sync_every=5
        ),
    }


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
    cfg = json.dumps({**TRAIN_CFG, "strategy": "ddp", "sync_every": 0})
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
    from shardfuse.models import build_model
    from shardfuse.train import forward_updates_buffers

    spec = {"type": "mlp", "num_features": 8, "num_classes": 3, "hidden_sizes": [4], "activation": "relu"}
    assert not forward_updates_buffers(build_model({**spec, "dropout": 0.0}))  # input stats: set once
    batch_norm = torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4))
    assert forward_updates_buffers(batch_norm)  # running statistics change every forward


# torchrun's entry point for one rank, with rank 1 reaching the training loop late (a slow start-up).
LATE_RANK = """
import time
import shardfuse.train as train

start = train.resume_or_start

def late_start(setup):
    if setup.ctx.rank == 1:
        time.sleep({delay})
    return start(setup)

train.resume_or_start = late_start
train.run_cli(train.main)
"""


def test_train_seconds_leave_out_a_rank_that_reaches_the_loop_late(tmp_path, digits_dataset, digits_shards):
    # localsgd's ranks first meet at a sync inside the loop, so without a common start rank 0 would
    # wait out rank 1's delay in its own loop time, and train_seconds (the slowest rank's loop) would
    # count it. (ddp's wrapper meets the ranks before the loop.)
    delay = 2.0
    script = tmp_path / "late_rank.py"
    script.write_text(LATE_RANK.format(delay=delay))
    out = tmp_path / "train"
    cfg = json.dumps({**TRAIN_CFG, "strategy": "localsgd", "sync_every": 5})
    proc = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
            str(script),
            "--run-name", "late", "--shard-dir", str(digits_shards), "--dataset-dir", str(digits_dataset),
            "--config-json", cfg, "--out-dir", str(out),
        ],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((out / "train.json").read_text())["train_seconds"] < delay
