"""How every step of a rank runs, fixed after resume-or-start: precision, the DDP wrapper, the
strategy's hook, validation and the step counts (the training's third phase, after
:func:`shardfuse.rank.setup.set_up` and :func:`shardfuse.rank.start.resume_or_start`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch.nn.parallel import DistributedDataParallel

from shardfuse.data.epoch_steps import ShardEpoch, optimizer_steps
from shardfuse.rank.dist import step_dtype
from shardfuse.rank.fsdp import Layout, layout_of
from shardfuse.rank.resume import Position, load_rank_extras
from shardfuse.rank.setup import RankSetup
from shardfuse.rank.validation import BestTracker, Validator
from shardfuse.strategies.registry import find_strategy, make_sync
from shardfuse.strategies.sync import Sync


class StepPlan(NamedTuple):
    """How every step runs, fixed after resume-or-start (DDP wraps the model as it was loaded)."""

    net: torch.nn.Module  # the model, or its DDP wrapper (a strategy that reduces gradients: ddp)
    dtype: torch.dtype | None  # autocast dtype; None: fp32
    # Micro-batch slots per epoch, the same on every rank: the ranks' shared clock. A step is a group of
    # grad_accum_steps slots; checkpoints, stop checks, validations and metrics count these steps.
    num_batches: int
    grad_accum_steps: int  # micro-batches per optimiser step (an epoch's last step takes the rest)
    # This rank's epoch: its rows and micro-batches (as many as the clock's, except with epoch_steps own,
    # where a rank with fewer waits out the epoch's other slots)
    own: ShardEpoch
    total_steps: int  # this rank's optimiser steps of the whole run (its schedule's length)
    clock_steps: int  # steps of the whole run on the shared clock (the progress bar's)
    sync: Sync  # the strategy's hook after every optimiser step (local SGD, DiLoCo), bytes counted
    layout: Layout  # replicas x shards (fsdp; shards 1 without)
    mesh: Any  # fsdp > 1: the (replicate, shard) mesh; else None
    checkpoint_every: int  # 0: no checkpoints
    nonfinite_policy: str  # error | skip
    grad_clip_norm: float | None
    eval_every: int  # 0: no validation while training
    validator: Validator | None
    tracker: BestTracker
    hsdp: bool = False  # fsdp > 1 with a strategy that reduces gradients (ddp): across replicas too

    @property
    def same_weights(self) -> bool:
        """All ranks hold the same weights at every step (DDP, or HSDP: fsdp with strategy ddp): one
        validation decision for all."""
        return isinstance(self.net, DistributedDataParallel) or self.hsdp


def plan_steps(setup: RankSetup, position: Position) -> StepPlan:
    """Precision, the DDP wrapper, the strategy, validation and the step counts; a resumed run's
    strategy and validation state come back from its checkpoint. Peak GPU memory counts from here."""
    device, cfg, model = setup.ctx.device, setup.cfg, setup.model
    cuda = device.type == "cuda"
    dtype = step_dtype(cfg.loop.precision, device, cuda and torch.cuda.is_bf16_supported())
    if cuda:
        torch.cuda.reset_peak_memory_stats(device)
    device_ids = [device.index] if cuda else None
    sharded = setup.sharded  # FSDP's own wrapping, done at set-up, is the whole story: no DDP
    reduces_gradients = find_strategy(cfg.sync.strategy).reduces_gradients
    net = (
        DistributedDataParallel(
            model,
            device_ids=device_ids,
            broadcast_buffers=setup.updates_buffers,
            find_unused_parameters=cfg.sync.find_unused_parameters,
            static_graph=cfg.sync.static_graph,
        )
        if reduces_gradients and not sharded
        else model
    )
    num_batches, own = setup.epochs.num_batches, setup.epochs.shards[setup.data_shard]
    grad_accum_steps = cfg.loop.grad_accum_steps
    eval_every = cfg.loop.eval_every
    layout = setup.layout or layout_of(setup.member_rank, setup.membership.world_size, 1)
    sync = make_sync(model, setup.ctx.world_size, cfg.sync, setup.mesh)
    # After a lost rank the survivors' averages weigh each by the rows it holds (none lost: None, the mean).
    sync.share = setup.membership.row_shares([shard["rows"] for shard in setup.manifest["shards"]]).get(
        setup.member_rank
    )
    tracker = BestTracker(setup.task, cfg.loop.keep == "best", cfg.loop.patience)
    if position.step:
        tensors, state = load_rank_extras(setup.checkpoint_dir, position.step, setup.member_rank)
        sync.resume_at(position.step)
        sync.load_state_tensors(tensors)
        tracker.load(state.get("validation", {}), tensors)
    validator = (
        Validator(setup.dataset_dir, setup.task, 4 * cfg.loop.batch_size, device) if eval_every else None
    )
    return StepPlan(
        net=net,
        dtype=dtype,
        num_batches=num_batches,
        grad_accum_steps=grad_accum_steps,
        own=own,
        total_steps=cfg.loop.epochs * optimizer_steps(own.num_batches, grad_accum_steps),
        clock_steps=cfg.loop.epochs * optimizer_steps(num_batches, grad_accum_steps),
        sync=sync,
        layout=layout,
        mesh=setup.mesh,
        checkpoint_every=cfg.loop.checkpoint_every,
        nonfinite_policy=cfg.loop.nonfinite_loss,
        grad_clip_norm=cfg.optim.grad_clip_norm,
        eval_every=eval_every,
        validator=validator,
        tracker=tracker,
        hsdp=sharded and reduces_gradients,
    )
