"""The end of a rank's training: its weights and sidecar, its metrics, and rank 0's ``train.json``, written
last (the launcher renames the staging directory into place only once it exists).
"""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as torch_dist

from shardfuse.checkpoints.weights import save_weights
from shardfuse.data.epoch_steps import optimizer_steps
from shardfuse.experiment.records import TrainRecord
from shardfuse.io import read_json
from shardfuse.metrics.steps import MetricsLog
from shardfuse.metrics.system import SystemSampler
from shardfuse.models.adapter import storable_state
from shardfuse.rank.fsdp import full_tensors
from shardfuse.rank.orphans import rows_dealt
from shardfuse.rank.resume import Position
from shardfuse.rank.setup import RankSetup, publish_rank0_buffers
from shardfuse.rank.step_plan import StepPlan
from shardfuse.strategies.registry import mode_of

if TYPE_CHECKING:
    from shardfuse.rank.loop import LoopEnd


def publish(
    setup: RankSetup,
    plan: StepPlan,
    end: LoopEnd,
    metrics: MetricsLog | None,
    system: SystemSampler,
) -> None:
    """Write this rank's weights (the last, or with keep: best the best validated) and metrics (step
    and system); rank 0 writes train.json once every rank's files exist. With fsdp > 1 a replica is
    what a rank is otherwise: its first rank writes the replica's whole weights as
    ``rank-<replica>.safetensors`` (gathered one tensor at a time) and its metrics."""
    ctx, cfg, tracker = setup.ctx, setup.cfg, plan.tracker
    layout, membership = plan.layout, setup.membership
    num_steps, stopped_early = end.step, end.stopped_early
    # The slowest rank's time in the loop, and the most any rank spent outside the step's own work.
    seconds = torch.tensor([end.seconds, end.seconds - end.compute_seconds], dtype=torch.float64)
    torch_dist.all_reduce(seconds, op=torch_dist.ReduceOp.MAX)

    if plan.same_weights and setup.updates_buffers:
        publish_rank0_buffers(setup.model)  # consolidate checks that the ddp ranks are identical
    if setup.sharded:
        weights, published_step = full_tensors(setup.model_state(), keep=layout.leader), num_steps
    else:
        weights, published_step = storable_state(setup.model)[0], num_steps
    if tracker.keep_best and tracker.best_weights is not None:
        weights, published_step = tracker.best_weights, tracker.best_step
    replica_ranks = membership.ranks_of(layout.replica)
    num_rows = replica_rows(setup, replica_ranks)
    rank_meta = {**setup.meta, "rank": layout.replica, "rows": num_rows, "num_steps": num_steps}
    if setup.sharded:
        rank_meta["fsdp"] = {**rank_meta["fsdp"], "ranks": replica_ranks}
    if "adapter" in rank_meta:  # the frozen base it was trained on, by the sha256 of its one file
        base_sha256 = read_json(setup.out_dir / "base.json", "base sidecar")["sha256"]
        rank_meta["adapter"] = {**rank_meta["adapter"], "base_sha256": base_sha256}
    if published_step != num_steps:
        rank_meta["published_step"] = published_step
    if layout.leader:
        save_weights(setup.out_dir / f"rank-{layout.replica}.safetensors", weights, rank_meta)
    if metrics is not None:
        metrics.consolidate()
    system.consolidate()  # does nothing when sampling is off
    cuda = ctx.device.type == "cuda"
    peak_memory = int(torch.cuda.max_memory_allocated(ctx.device)) if cuda else None
    best = None if math.isnan(tracker.best_score) else tracker.best_score
    facts: list[Any] = [None] * ctx.world_size
    # Also the barrier: every rank's files exist once this returns.
    torch_dist.all_gather_object(facts, (setup.meta["host"], published_step, best))
    hosts = [fact[0] for fact in facts]  # by torch's rank, as the other lists here
    world_size, accum = membership.world_size, plan.grad_accum_steps
    steps, rows_seen = rank_progress(setup, end.at)
    steps_per_epoch = optimizer_steps(plan.num_batches, accum)
    record = TrainRecord(
        run=setup.run,
        world_size=world_size,
        strategy=cfg.sync.strategy,
        mode=mode_of(cfg.sync.strategy, cfg.sync.sync_every),
        sync_every=plan.sync.sync_every,
        num_steps=num_steps,
        epochs=cfg.loop.epochs,
        steps_per_epoch=steps_per_epoch,
        epoch_steps=cfg.loop.epoch_steps,
        grad_accum_steps=accum,
        effective_batch_size=effective_batch(setup),
        rows_per_step=sum(rows / count for rows, count in zip(rows_seen, steps, strict=True) if count),
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
        train_seconds=float(seconds[0]),
        framework_seconds=float(seconds[1]),
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
        fsdp=fsdp_record(setup, plan, num_steps) if setup.sharded else None,
        ranks=[
            replica_entry(setup, replica, hosts, facts, (steps, rows_seen), end.at)
            for replica in membership.replicas
        ],
        membership=membership_record(setup, steps_per_epoch),
    )
    setup.gate.call(close_lost_logs, setup)
    setup.gate.write_json(setup.out_dir / "train.json", record.to_json())


def close_lost_logs(setup: RankSetup) -> None:
    """Rank 0: a lost rank's step and system metrics as the Parquet files every rank's end in, its steps
    up to the checkpoint it was lost at (those after it reached no model), so its curves stay tracked."""
    metrics_dir = setup.out_dir / "metrics"
    for member in setup.membership.members:
        if member.alive:
            continue
        if (metrics_dir / f"rank-{member.rank}.f64").is_file():
            MetricsLog(metrics_dir, member.rank, resume_step=member.lost_at_step or 0).consolidate()
        if (metrics_dir / f"system-rank-{member.rank}.f64").is_file():
            SystemSampler(metrics_dir, member.rank, interval_s=1.0).consolidate()


def membership_record(setup: RankSetup, steps_per_epoch: int) -> dict[str, Any]:
    """train.json's ``membership``; after a lost rank also the share of the training rows the published
    models hold, each epoch and over all of them (``coverage``, rows-weighted)."""
    membership = setup.membership
    record = membership.to_json()
    if membership.lost_ranks:
        rows = [shard["rows"] for shard in setup.manifest["shards"]]
        per_epoch = membership.epoch_coverage(rows, steps_per_epoch, setup.cfg.loop.epochs)
        record |= {"coverage": sum(per_epoch) / len(per_epoch), "coverage_per_epoch": per_epoch}
        record["min_ranks"] = setup.cfg.sync.min_ranks  # what merge holds the survivors to
    return record


def replica_rows(setup: RankSetup, ranks: list[int]) -> int:
    """The training rows of a replica: those of the data shards its ranks read."""
    return sum(setup.manifest["shards"][setup.membership.shard_of(rank)]["rows"] for rank in ranks)


def effective_batch(setup: RankSetup) -> int:
    """batch_size x grad_accum_steps summed over the (alive) ranks, each capped at its epoch's rows (an
    epoch of fewer rows than batch_size is one step of them)."""
    loop, epochs = setup.cfg.loop, setup.epochs
    shards = [member.data_shard for member in setup.membership.alive_members]
    return loop.grad_accum_steps * sum(min(loop.batch_size, epochs.shards[shard].rows) for shard in shards)


def rank_progress(setup: RankSetup, at: Position) -> tuple[list[int], list[int]]:
    """Every rank's optimiser steps and rows seen when the loop stopped at ``at`` (the shared clock's
    position, the same on every rank): functions of the epoch plan, so a resumed run counts the steps
    taken before it too."""
    accum = setup.cfg.loop.grad_accum_steps
    shards = [member.data_shard for member in setup.membership.alive_members]  # by torch's rank
    steps = [setup.epochs.steps_taken(shard, at.epoch, at.next_batch, accum) for shard in shards]
    rows_seen = [setup.epochs.rows_seen(shard, at.epoch, at.next_batch) for shard in shards]
    return steps, rows_seen


def replica_entry(
    setup: RankSetup,
    replica: int,
    hosts: list[str],
    facts: list[Any],
    progress: tuple[list[int], list[int]],
    at: Position,
) -> dict[str, Any]:
    """train.json's ``ranks`` entry of a replica (a rank, without fsdp), from its first rank's facts; its
    steps and rows seen from every rank's (a replica's ranks step together and each reads its shard). A
    lost replica publishes nothing: its entry says when it was lost. ``progress``: every rank's steps and
    rows seen (:func:`rank_progress` at ``at``, where the loop stopped)."""
    membership, (steps, rows_seen) = setup.membership, progress
    ranks = membership.ranks_of(replica)
    if replica not in membership.alive_replicas:
        lost = membership.member(ranks[0])
        return {
            "rank": replica, "rows": replica_rows(setup, ranks), "lost": True,
            "lost_at_step": lost.lost_at_step, "steps_discarded": lost.steps_discarded, "checkpoint": None,
        }  # fmt: skip
    leader = membership.process_of(ranks[0])  # the lists are by torch's rank
    processes = [membership.process_of(rank) for rank in ranks]
    entry = {
        "rank": replica,  # the replica: its checkpoint's number, as a rank's without fsdp
        "rows": replica_rows(setup, ranks),
        "num_steps": steps[leader],
        "rows_seen": sum(rows_seen[process] for process in processes),
        "host": hosts[leader],
        "checkpoint": f"rank-{replica}.safetensors",
        "published_step": facts[leader][1],
        "best_val_score": facts[leader][2],
    }
    if setup.sharded:
        entry["ranks"] = ranks
    if any(member.dealt for member in membership.members):  # orphans: reshard: its rows seen count them
        accum = setup.cfg.loop.grad_accum_steps
        entry["rows_dealt"] = sum(
            rows_dealt(membership.members, rank, setup.epochs, accum, at.epoch, at.next_batch)
            for rank in ranks
        )
        entry["rows_seen"] += entry["rows_dealt"]
    return entry


def fsdp_record(setup: RankSetup, plan: StepPlan, num_steps: int) -> dict[str, Any]:
    """train.json's ``fsdp``: the layout and the bytes moved inside each replica per rank: the payloads
    of every micro-batch's forward and backward all-gathers and of each step's reduce-scatter, whole
    parameter bytes each, as ``bytes_all_reduced_per_rank`` (which counts those across replicas)
    counts payloads. The root unit's parameters stay gathered between forward and backward, so this
    is an upper bound."""
    layout = plan.layout
    whole = sum(p.numel() * p.element_size() for p in setup.model.parameters() if p.requires_grad)
    micro_batches = sum(
        min(plan.grad_accum_steps, plan.num_batches - start)
        for start in range(0, plan.num_batches, plan.grad_accum_steps)
    )
    steps_per_epoch = optimizer_steps(plan.num_batches, plan.grad_accum_steps)
    epochs_done, last_steps = divmod(num_steps, steps_per_epoch)
    passes = epochs_done * micro_batches + min(last_steps * plan.grad_accum_steps, micro_batches)
    return {
        "shards_per_replica": layout.shards,
        "replicas": layout.replicas,
        "precision": setup.cfg.sync.fsdp_precision,
        "hsdp": plan.hsdp,
        "bytes_within_replica_per_rank": (2 * passes + num_steps) * whole,
    }
