"""How the ranks of a training keep in touch: DDP, local SGD, independent training and DiLoCo.

A library module for the train stage. Each strategy object is told about every optimiser step and
counts the bytes it all-reduces per rank (the payload of each collective on model state; the
ring algorithm's factor and the one-off broadcast of the initial weights are not counted), so the
communication each strategy costs is recorded next to what it achieves:

- ``ddp``: DistributedDataParallel all-reduces every gradient once per optimiser step (gradient
  accumulation runs the inner micro-steps under ``no_sync``).
- ``localsgd`` (Lin et al. 2020): every ``sync_every`` steps the ranks average their parameters;
  ``sync_every: 0`` never does (independent training, the "train on each shard, fuse" mode).
- ``diloco`` (Douillard et al. 2023, DiLoCo): each rank runs ``sync_every`` inner optimiser steps from
  the shared outer parameters; then the outer gradient (outer parameters minus the rank's, averaged
  over ranks) drives an outer SGD step with Nesterov momentum (``outer_lr``, ``outer_momentum``;
  the paper's 0.7 and 0.9), and every rank restarts from the new outer parameters. The inner
  optimiser keeps its state across rounds, as in the paper. A run whose step count is not a
  multiple of ``sync_every`` ends with one last outer step, so its ranks publish the same weights.
  The outer parameters and momentum are part of the checkpoint (``state_tensors``).

With ``fsdp: S`` (:mod:`shardfuse.rank.fsdp`) each strategy acts across the replicas on every rank's
local shards, over the mesh's ``replicate`` group: the counts are of those shards, per rank.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.experiment.run_config import SyncConfig
from shardfuse.rank.fsdp import local


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's trainable parameters (its local shards, under fsdp)."""
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters() if p.requires_grad)


class Sync:
    """The strategy's hook after every optimiser step; counts syncs and bytes all-reduced per rank.

    ``world_size`` ranks (replicas, under fsdp) take part, in ``group`` (None: the whole world)."""

    def __init__(self, model: torch.nn.Module, world_size: int, sync_every: int, group: Any = None) -> None:
        self.model, self.world_size, self.sync_every, self.group = model, world_size, sync_every, group
        self.num_syncs = 0
        self.payload_bytes = parameter_bytes(model) if world_size > 1 or group is None else 0

    @property
    def bytes_all_reduced(self) -> int:
        return self.num_syncs * self.payload_bytes

    def resume_at(self, step: int) -> None:
        """The syncs an uninterrupted run had made by ``step`` (the counters are not checkpointed)."""
        self.num_syncs = step // self.sync_every if self.sync_every else 0

    def after_step(self, step: int) -> None:
        if self.sync_every and step % self.sync_every == 0:
            self.sync()

    def finish(self, step: int) -> None:
        """After the last step (also an early stop)."""

    def sync(self) -> None:
        raise NotImplementedError

    # Checkpointed state beyond the model and inner optimiser (empty for the stateless strategies).
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        pass


class DDPSync(Sync):
    """DDP all-reduces the gradients inside backward; this only counts them, once per step."""

    def resume_at(self, step: int) -> None:
        self.num_syncs = step

    def after_step(self, step: int) -> None:
        self.num_syncs += 1


class LocalSGD(Sync):
    @torch.no_grad()
    def sync(self) -> None:
        for param in self.model.parameters():
            if not param.requires_grad:  # frozen (an adapter's base): the same on every rank
                continue
            shard = local(param)
            torch_dist.all_reduce(shard, op=torch_dist.ReduceOp.SUM, group=self.group)
            shard.div_(self.world_size)
        self.num_syncs += 1


class DiLoCo(Sync):
    def __init__(
        self,
        model: torch.nn.Module,
        world_size: int,
        sync_every: int,
        outer_lr: float,
        outer_momentum: float,
        group: Any = None,
    ) -> None:
        super().__init__(model, world_size, sync_every, group)
        self.names = [name for name, p in model.named_parameters() if p.requires_grad]
        params = dict(model.named_parameters())
        # The outer (global) parameters, on every rank (its shards, under fsdp), and the outer
        # optimiser over them.
        self.outer = [local(params[name]).detach().clone() for name in self.names]
        self.outer_optimizer = torch.optim.SGD(
            self.outer, lr=outer_lr, momentum=outer_momentum, nesterov=outer_momentum > 0
        )

    def finish(self, step: int) -> None:
        if step % self.sync_every != 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        params = dict(self.model.named_parameters())
        for name, outer in zip(self.names, self.outer, strict=True):
            delta = outer - local(params[name]).detach()  # the outer gradient: the inner steps, negated
            torch_dist.all_reduce(delta, op=torch_dist.ReduceOp.SUM, group=self.group)
            outer.grad = delta.div_(self.world_size)
        self.outer_optimizer.step()
        self.outer_optimizer.zero_grad(set_to_none=True)
        for name, outer in zip(self.names, self.outer, strict=True):
            local(params[name]).copy_(outer)
        self.num_syncs += 1

    def state_tensors(self) -> dict[str, torch.Tensor]:
        tensors = {
            f"outer.param.{name}": t.detach().clone() for name, t in zip(self.names, self.outer, strict=True)
        }
        state = self.outer_optimizer.state
        for name, outer in zip(self.names, self.outer, strict=True):
            buffer = state.get(outer, {}).get("momentum_buffer")
            if buffer is not None:
                tensors[f"outer.momentum.{name}"] = buffer.detach().clone()
        return tensors

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        with torch.no_grad():
            for name, outer in zip(self.names, self.outer, strict=True):
                outer.copy_(tensors[f"outer.param.{name}"])
                momentum = tensors.get(f"outer.momentum.{name}")
                if momentum is not None:
                    self.outer_optimizer.state[outer]["momentum_buffer"] = momentum.clone()


STRATEGIES = ("ddp", "localsgd", "diloco")  # the schema's strategy enum (tests/contracts)


def make_sync(model: torch.nn.Module, world_size: int, cfg: SyncConfig, mesh: Any = None) -> Sync:
    """The run's strategy; with an fsdp ``mesh``, across its replicas (the ``replicate`` group)."""
    strategy, sync_every = cfg.strategy, cfg.sync_every
    group = None
    if mesh is not None:
        group, world_size = mesh["replicate"].get_group(), mesh["replicate"].size()
    if strategy == "ddp":
        return DDPSync(model, world_size, 0, group)
    if strategy == "diloco":
        return DiLoCo(model, world_size, sync_every, cfg.outer_lr, cfg.outer_momentum, group)
    return LocalSGD(model, world_size, sync_every, group)
