"""FSDP2 inside a replica (issue 31), as the train stage runs it: ``fsdp: 2`` on two ranks (one replica,
each rank holding half of every parameter, its gradient and its optimiser state) against DDP on the same
two ranks and shards. Parity as torchtitan gates it: the loss curves equal within a stated tolerance
(the reductions sum in another order), the published weights too; one checkpoint for the replica."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import torch

from shardfuse.checkpoints.weights import load_weights
from shardfuse.io import read_json
from tests.support.training import launch_training

# AdamW, clipping and gradient accumulation: what FSDP changes in a step (sharded moments, the norm over
# every shard, no gradient sync before the last micro-batch).
PARITY_CFG = {
    "hidden_sizes": [32, 32], "activation": "relu", "dropout": 0.0, "optimizer": "adamw", "lr": 0.003,
    "momentum": 0.9, "weight_decay": 0.01, "decay_rule": "ndim>=2", "batch_size": 32, "epochs": 3,
    "seed": 5, "grad_clip_norm": 1.0, "grad_accum_steps": 2, "checkpoint_every": 0, "strategy": "ddp",
    "sync_every": 0,
}  # fmt: skip
LOSS_TOLERANCE = 1e-5  # absolute, per step, of losses around 0.1-2.4 (float32 summation order)
WEIGHT_TOLERANCE = 1e-5


def test_fsdp_on_one_replica_follows_ddp_on_the_same_ranks_and_publishes_one_checkpoint(
    tmp_path, digits_dataset, digits_shards
):
    ddp = tmp_path / "ddp"
    fsdp = tmp_path / "fsdp"
    launch_training(ddp, digits_dataset, digits_shards, "ddp", PARITY_CFG)
    launch_training(fsdp, digits_dataset, digits_shards, "fsdp", {**PARITY_CFG, "fsdp": 2})

    # DDP logs each rank's own loss; the replica logs the mean of its ranks' (the step's loss).
    ddp_losses = np.mean(
        [
            pq.read_table(ddp / "metrics" / f"rank-{rank}.parquet").column("loss").to_numpy()
            for rank in (0, 1)
        ],
        axis=0,
    )
    replica = pq.read_table(fsdp / "metrics" / "rank-0.parquet")
    assert not (fsdp / "metrics" / "rank-1.parquet").exists()
    assert len(ddp_losses) == replica.num_rows == 3 * 10  # 3 epochs x 10 steps of 2 micro-batches
    gap = np.abs(replica.column("loss").to_numpy() - ddp_losses)
    assert gap.max() <= LOSS_TOLERANCE, gap.max()
    assert ddp_losses[-1] < 0.6 * ddp_losses[0]  # it learned
    norms = pq.read_table(ddp / "metrics" / "rank-0.parquet").column("grad_norm").to_numpy()
    assert np.allclose(replica.column("grad_norm").to_numpy(), norms, rtol=1e-5)

    theirs, _ = load_weights(ddp / "rank-0.safetensors")
    mine, meta = load_weights(fsdp / "rank-0.safetensors")
    assert not (fsdp / "rank-1.safetensors").exists()
    assert mine.keys() == theirs.keys()
    for name in mine:
        assert torch.allclose(mine[name], theirs[name], atol=WEIGHT_TOLERANCE), name
    assert meta["fsdp"] == {"shards": 2, "replicas": 1, "ranks": [0, 1]} and meta["rank"] == 0
    train = read_json(fsdp / "train.json")
    assert train["world_size"] == 2 and train["strategy"] == "ddp"
    assert train["fsdp"]["shards_per_replica"] == 2 and train["fsdp"]["replicas"] == 1
    whole = sum(t.numel() * 4 for name, t in mine.items() if not name.startswith("input_"))
    # 30 steps x 2 micro-batches: two all-gathers each, and one reduce-scatter per step.
    assert train["fsdp"]["bytes_within_replica_per_rank"] == (2 * 60 + 30) * whole
    assert train["bytes_all_reduced_per_rank"] == 0  # one replica: nothing crosses replicas
    assert [entry["rank"] for entry in train["ranks"]] == [0] and train["ranks"][0]["ranks"] == [0, 1]
    rows = json.loads((digits_shards / "manifest.json").read_text())["shards"]
    assert train["ranks"][0]["rows"] == sum(shard["rows"] for shard in rows) == meta["rows"]
