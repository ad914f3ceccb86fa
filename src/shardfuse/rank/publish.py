"""The end of a rank's training: its weights and sidecar, its metrics, and rank 0's ``train.json``, written
last (the launcher renames the staging directory into place only once it exists).
"""

from __future__ import annotations

import math
import os
from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.checkpoints.weights import save_weights
from shardfuse.experiment.records import TrainRecord, mode_of
from shardfuse.io import read_json
from shardfuse.metrics.steps import MetricsLog
from shardfuse.metrics.system import SystemSampler
from shardfuse.models.adapter import storable_state
from shardfuse.rank.setup import (
    RankSetup,
    StepPlan,
    optimizer_steps,
    publish_rank0_buffers,
)


def publish(
    setup: RankSetup,
    plan: StepPlan,
    num_steps: int,
    loop_seconds: float,
    stopped_early: bool,
    metrics: MetricsLog | None,
    system: SystemSampler,
) -> None:
    """Write this rank's weights (the last, or with keep: best the best validated) and metrics (step
    and system); rank 0 writes train.json once every rank's files exist."""
    ctx, cfg, manifest, tracker = setup.ctx, setup.cfg, setup.manifest, plan.tracker
    seconds = torch.tensor([loop_seconds], dtype=torch.float64)
    torch_dist.all_reduce(seconds, op=torch_dist.ReduceOp.MAX)  # the slowest rank's time

    if plan.same_weights and setup.updates_buffers:
        publish_rank0_buffers(setup.model)  # consolidate checks that the ddp ranks are identical
    weights, published_step = storable_state(setup.model)[0], num_steps
    if tracker.keep_best and tracker.best_weights is not None:
        weights, published_step = tracker.best_weights, tracker.best_step
    num_rows = manifest["shards"][ctx.rank]["rows"]
    rank_meta = {**setup.meta, "rank": ctx.rank, "rows": num_rows, "num_steps": num_steps}
    if "adapter" in rank_meta:  # the frozen base it was trained on, by the sha256 of its one file
        base_sha256 = read_json(setup.out_dir / "base.json", "base sidecar")["sha256"]
        rank_meta["adapter"] = {**rank_meta["adapter"], "base_sha256": base_sha256}
    if published_step != num_steps:
        rank_meta["published_step"] = published_step
    save_weights(setup.out_dir / f"rank-{ctx.rank}.safetensors", weights, rank_meta)
    if metrics is not None:
        metrics.consolidate()
    system.consolidate()  # does nothing when sampling is off
    cuda = ctx.device.type == "cuda"
    peak_memory = int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else None
    best = None if math.isnan(tracker.best_score) else tracker.best_score
    facts: list[Any] = [None] * ctx.world_size
    # Also the barrier: every rank's files exist once this returns.
    torch_dist.all_gather_object(facts, (setup.meta["host"], published_step, best))
    hosts = [fact[0] for fact in facts]
    world_size, accum = ctx.world_size, plan.grad_accum_steps
    record = TrainRecord(
        run=setup.run,
        world_size=world_size,
        strategy=cfg.sync.strategy,
        mode=mode_of(cfg.sync.strategy, cfg.sync.sync_every),
        sync_every=plan.sync.sync_every,
        num_steps=num_steps,
        epochs=cfg.loop.epochs,
        steps_per_epoch=optimizer_steps(plan.num_batches, accum),
        grad_accum_steps=accum,
        effective_batch_size=cfg.loop.batch_size * accum * world_size,
        lr_schedule=cfg.optim.lr_schedule,
        warmup_steps=cfg.optim.warmup_steps,
        grad_clip_norm=plan.grad_clip_norm,
        bytes_all_reduced_per_rank=plan.sync.bytes_all_reduced,
        num_syncs=plan.sync.num_syncs,
        init=setup.meta.get("init", "shared"),
        keep=cfg.loop.keep,
        validation=(
            {"score": setup.task.score, "every": plan.eval_every} if plan.validator is not None else None
        ),
        stopped_early=stopped_early,
        train_seconds=float(seconds.item()),
        backend=ctx.backend,
        device=str(ctx.device),
        precision="fp32" if plan.dtype is None else "bf16",
        peak_gpu_memory_bytes=peak_memory,
        step_metrics=metrics is not None,
        hosts=hosts,
        slurm_job_id=os.environ.get("SLURM_JOB_ID"),
        torch_version=torch.__version__,
        shard_dir=str(setup.shard_dir),
        dataset_dir=str(setup.dataset_dir),
        task=setup.task.name,
        model=setup.spec,
        init_from=setup.meta["init_from"],
        adapter=rank_meta.get("adapter"),
        ranks=[
            {
                "rank": s["rank"],
                "rows": s["rows"],
                "host": hosts[s["rank"]],
                "checkpoint": f"rank-{s['rank']}.safetensors",
                "published_step": facts[s["rank"]][1],
                "best_val_score": facts[s["rank"]][2],
            }
            for s in manifest["shards"]
        ],
    )
    setup.gate.write_json(setup.out_dir / "train.json", record.to_json())
