"""The training loop of one rank: accumulate gradients, step, sync as the strategy says, validate,
checkpoint.
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from typing import NamedTuple

import torch
import torch.distributed as torch_dist
from torch.nn.parallel import DistributedDataParallel

from shardfuse.data.epoch_steps import optimizer_steps
from shardfuse.data.reader import ShardReader
from shardfuse.metrics.steps import MetricsLog
from shardfuse.rank.dist import autocast
from shardfuse.rank.fsdp import all_reduce_mean
from shardfuse.rank.optim import clip_gradients, lr_at, set_lr
from shardfuse.rank.orphans import OrphanRows
from shardfuse.rank.resume import (
    Position,
    mark_complete,
    save_rank_state,
)
from shardfuse.rank.setup import RankSetup, check_finite, publish_rank0_buffers
from shardfuse.rank.step_plan import StepPlan
from shardfuse.rank.stop import StopRequest
from shardfuse.rank.validation import all_out_of_patience, shared_score
from shardfuse.strategies.registry import mode_of
from shardfuse.track.live import LiveLogger


class StepResult(NamedTuple):
    loss: float  # mean of the micro-batches' losses
    rows: int
    applied: bool  # whether the optimiser may step (a finite loss reached the gradients)
    compute_seconds: float  # in forward, loss and backward (DDP's all-reduce included), not the data


def score_name(plan: StepPlan) -> str:
    """The validation score's name in the progress line (``accuracy``, ``loss``...)."""
    return plan.validator.task.score if plan.validator is not None else "score"


def accumulate_gradients(
    setup: RankSetup,
    plan: StepPlan,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    group_size: int,
    step: int,
) -> StepResult:
    """Forward and backward over ``group_size`` micro-batches, each loss scaled by 1/group_size, so the
    gradient is the mean over the group (the large batch's, for equal micro-batches). DDP all-reduces
    once, in the last backward: the others run under ``no_sync`` (FSDP: without gradient sync)."""
    ctx, task = setup.ctx, setup.task
    ddp = isinstance(plan.net, DistributedDataParallel)
    fsdp = plan.mesh is not None
    total_loss, rows, applied, compute = 0.0, 0, False, 0.0
    for micro in range(group_size):
        inputs, targets = next(batches)
        started = time.perf_counter()
        inputs = inputs.to(ctx.device, non_blocking=True)
        targets = targets.to(ctx.device, non_blocking=True)
        inputs, targets = task.batch(inputs, targets)
        last = micro == group_size - 1
        if fsdp and group_size > 1:
            plan.net.set_requires_gradient_sync(last)
        with plan.net.no_sync() if ddp and not last else contextlib.nullcontext():
            with autocast(ctx.device, plan.dtype):
                loss = task.loss(plan.net(inputs), targets)
            loss_value = loss.item()  # one host sync a micro-step: the finite check and metrics share it
            # Ranks that step apart (epoch_steps own) skip alone: they never meet mid-step.
            if check_finite(loss_value, ctx, step, plan.nonfinite_policy, agree=setup.epochs.aligned):
                (loss / group_size if group_size > 1 else loss).backward()
                # Under DDP only the last backward syncs the accumulated gradients: without it the
                # ranks' gradients differ, so the whole step is skipped.
                applied = last or (applied and not (ddp or fsdp))
        compute += time.perf_counter() - started
        total_loss += loss_value
        rows += len(targets)
    return StepResult(total_loss / group_size, rows, applied, compute)


def validate(setup: RankSetup, plan: StepPlan, step: int) -> float:
    """Score the validation split (a collective when all ranks hold the same weights)."""
    if plan.same_weights and setup.updates_buffers:
        publish_rank0_buffers(setup.model)
    score = shared_score(plan.validator.score(setup.model), plan.same_weights, setup.ctx.device)
    plan.tracker.update(score, step, setup.model)
    return score


def all_stop(plan: StepPlan, device) -> bool:
    """Whether every rank is now out of patience (a collective on every rank's validation steps)."""
    return plan.tracker.patience is not None and all_out_of_patience(plan.tracker, device)


class LoopEnd(NamedTuple):
    step: int  # the last step taken
    seconds: float  # this rank's time in the loop
    compute_seconds: float  # of which in the training step's own work (bench/peers.py: the rest is
    # the framework's: reading batches, metrics, schedule, stop checks, validation, checkpoints)
    stopped_early: bool  # validation stopped the run (it is finished)
    interrupted: str | None  # why the ranks stopped before the end, with a checkpoint of ``step``
    at: Position  # where the loop stopped on the shared clock (each rank's rows seen and steps follow)


def train_loop(
    setup: RankSetup, plan: StepPlan, position: Position, metrics: MetricsLog | None, live: LiveLogger | None
) -> LoopEnd:
    """Run the remaining optimiser steps, or stop at a step boundary with a checkpoint when asked to
    (:mod:`shardfuse.rank.stop`).

    Steps count on the ranks' shared clock (plan.num_batches slots an epoch). With epoch_steps own a
    rank whose epoch has fewer micro-batches waits out the epoch's last slots: it takes no step there
    but still joins what every rank joins (stop checks, checkpoints, validations' patience)."""
    ctx, cfg, run, gate = setup.ctx, setup.cfg, setup.run, setup.gate
    model, optimizer, num_batches = setup.model, setup.optimizer, plan.num_batches
    accum, own_batches, shard = plan.grad_accum_steps, plan.own.num_batches, setup.data_shard
    gate.log(
        f"[{run}] {mode_of(cfg.sync.strategy, cfg.sync.sync_every)} on {ctx.world_size} ranks "
        f"({ctx.backend}, {'fp32' if plan.dtype is None else 'bf16 autocast'}): {cfg.loop.epochs} epochs x "
        f"{optimizer_steps(num_batches, accum)} steps" + (f" of {accum} micro-batches" if accum > 1 else "")
    )
    model.train()
    # The ranks start the timed loop together. Without this, the start-up that one rank finishes
    # later than another (imports, rank 0's base.safetensors) lands in the other's loop time at their
    # first collective (a checkpoint's barrier, a sync), and train_seconds (the slowest rank's loop)
    # charges the loop with it: bench/scaling.py, figures in bench/RESULTS.md.
    torch_dist.barrier()
    started = time.perf_counter()
    step = position.step
    own_step = setup.epochs.steps_taken(shard, position.epoch, position.next_batch, accum)  # its schedule's
    here = position
    loss_value = float("nan")  # a resume at an epoch's end runs no batch in that epoch
    stop = False
    interrupted = None
    compute = 0.0  # forward, backward, clipping, the optimiser's step and the strategy's sync
    # The reader streams the shard (first batch after one row group; sha256 checked alongside, a
    # mismatch stops the run when the first epoch ends) and keeps it in memory for later epochs.
    with (
        StopRequest(setup.out_dir, ctx.device, step) as stop_request,
        ShardReader(
            setup.shard_dir, setup.data_shard, seed=setup.rank_seed, cache=True, verify=True
        ) as reader,
        OrphanRows(
            setup.membership.members, setup.member_rank, setup.epochs, setup.shard_dir, cfg.loop.seed, accum
        ) as orphans,
        gate.progress(plan.clock_steps, step, run, score_name(plan)) as progress,
    ):
        for epoch in range(position.epoch, cfg.loop.epochs):
            first = position.next_batch if epoch == position.epoch else 0
            start = min(first, own_batches)
            batches = orphans.deal(epoch, start, reader.epoch(epoch, own_batches, start, plan.own.rows))
            tick = time.perf_counter()  # samples/s covers the whole step: waiting for data included
            for group_start in range(first, num_batches, accum):
                group_size = min(accum, num_batches - group_start)
                own_size = min(group_size, own_batches - group_start)  # < 1: waiting out the epoch
                end_of_epoch = group_start + group_size == num_batches
                here = Position(step + 1, epoch, group_start + group_size)
                validates = plan.validator is not None and ((step + 1) % plan.eval_every == 0 or end_of_epoch)
                if own_size < 1:
                    step += 1
                    stop = validates and all_stop(plan, ctx.device)
                else:
                    optimizer.zero_grad(set_to_none=True)
                    result = accumulate_gradients(setup, plan, batches, own_size, step + 1)
                    lr = lr_at(own_step, plan.total_steps, cfg.optim)  # a function of the (own) step
                    step, own_step = step + 1, own_step + 1
                    loss_value, grad_norm = result.loss, math.nan
                    if plan.mesh is not None:  # the replica's loss: the mean of its ranks' (one collective)
                        shards = plan.layout.shards
                        loss_value = all_reduce_mean(
                            loss_value, plan.mesh["shard"].get_group(), shards, ctx.device
                        )
                    started_update = time.perf_counter()
                    if result.applied:
                        set_lr(optimizer, lr)
                        grad_norm = clip_gradients(model.parameters(), plan.grad_clip_norm)
                        optimizer.step()
                    plan.sync.after_step(own_step)
                    compute += result.compute_seconds + time.perf_counter() - started_update
                    # A rank's own epoch end (own: before the clock's) is validated too: it waits unchanged.
                    own_end = group_start + own_size == own_batches
                    val_score = math.nan
                    if plan.validator is not None and (validates or own_end):
                        val_score = validate(setup, plan, step)
                    stop = validates and all_stop(plan, ctx.device)
                if metrics is not None and own_size > 0:
                    now = time.perf_counter()
                    throughput = result.rows * plan.layout.shards / max(now - tick, 1e-9)
                    tick = now
                    metrics.append(step, epoch, loss_value, throughput, lr, now, grad_norm, val_score)
                    progress.update(step, loss=loss_value, samples_per_second=throughput, val_score=val_score)
                    if live is not None:
                        live.log(step, {"loss": loss_value, "samples_per_second": throughput})
                # No checkpoint at the stopping step: a run resumed from an earlier one stops here again.
                saved = plan.checkpoint_every and step % plan.checkpoint_every == 0 and not stop
                if saved:
                    save_checkpoint(setup, plan, here, metrics)
                if stop:
                    break
                if stop_request.due(step):
                    interrupted = stop_request.reason
                    if not saved:
                        save_checkpoint(setup, plan, here, metrics)
                    gate.log(
                        f"[{run}] stopped after step {step} ({interrupted}): checkpoint of step {step} saved"
                    )
                    break
            if interrupted:
                break
            gate.log(f"[{run}] epoch {epoch + 1}/{cfg.loop.epochs} step {step} rank-0 loss {loss_value:.4f}")
            if stop:
                gate.log(
                    f"[{run}] early stop at step {step}: no rank improved for "
                    f"{plan.tracker.patience} validations"
                )
                break
    seconds = time.perf_counter() - started
    if interrupted:
        return LoopEnd(step, seconds, compute, False, interrupted, here)
    plan.sync.finish(own_step)
    return LoopEnd(step, seconds, compute, stop, None, here)


def save_checkpoint(setup: RankSetup, plan: StepPlan, position: Position, metrics: MetricsLog | None) -> None:
    """Every rank saves its state; the checkpoint counts (rank 0 marks it complete) once all have."""
    if metrics is not None:
        metrics.flush()  # every row up to the checkpoint survives a restart from it
    save_rank_state(
        setup.checkpoint_dir,
        setup.member_rank,
        setup.model,
        setup.optimizer,
        position,
        setup.identity,
        state_tensors={**plan.sync.state_tensors(), **plan.tracker.state_tensors()},
        state={"validation": plan.tracker.state()},
        sharded=setup.model_state() if setup.sharded else None,
    )
    torch_dist.barrier()  # every rank saved before the checkpoint counts
    setup.gate.call(mark_complete, setup.checkpoint_dir, position.step, setup.cfg.loop.keep_checkpoints)
