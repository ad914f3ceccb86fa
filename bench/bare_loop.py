"""The training loop a user writes by hand, under torchrun: bench/peers.py's baseline for the train stage.

Each rank loads every batch of its shard into memory first (the same batches the train stage reads,
through the same reader, so both see the same data), builds the same model from the same spec, wraps it
in DDP, and then times only the loop: forward, the task's loss, backward, AdamW step — nothing logged,
checkpointed, validated or checked. Rank 0 writes {"seconds": the slowest rank's loop, "steps"}.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from shardfuse.data.manifest import read_manifest
from shardfuse.data.reader import ShardReader
from shardfuse.models.registry import build_model, task_of


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shards", type=Path, required=True)
    parser.add_argument("--spec-json", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    spec, cfg = json.loads(args.spec_json), json.loads(args.config_json)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    manifest = read_manifest(args.shards)
    per_epoch = max(1, math.ceil(min(s["rows"] for s in manifest["shards"]) / cfg["batch_size"]))
    batches = []
    with ShardReader(args.shards, rank, seed=cfg["seed"] + rank, cache=True) as reader:
        epoch = 0
        while len(batches) < args.steps:
            batches += list(reader.epoch(epoch, per_epoch))
            epoch += 1
    batches = batches[: args.steps]
    torch.manual_seed(cfg["seed"])
    model = build_model(spec)
    task = task_of(spec, model.state_dict())
    # Buffers broadcast before every forward only where training changes them (BatchNorm), as the
    # train stage does: DDP's default broadcasts always, a collective per step that would charge the
    # bare loop with a cost the train stage does not pay.
    changing = any(getattr(module, "track_running_stats", False) for module in model.modules())
    net = DistributedDataParallel(model, broadcast_buffers=changing)
    optimizer = torch.optim.AdamW(model.parameters(), lr=cfg["lr"], weight_decay=cfg["weight_decay"])
    model.train()
    dist.barrier()
    started = time.perf_counter()
    for inputs, targets in batches:
        inputs, targets = task.batch(inputs, targets)
        optimizer.zero_grad(set_to_none=True)
        loss = task.loss(net(inputs), targets)
        loss.backward()
        optimizer.step()
    seconds = torch.tensor([time.perf_counter() - started], dtype=torch.float64)
    dist.all_reduce(seconds, op=dist.ReduceOp.MAX)
    if rank == 0:
        args.out.write_text(json.dumps({"seconds": float(seconds.item()), "steps": len(batches)}))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
