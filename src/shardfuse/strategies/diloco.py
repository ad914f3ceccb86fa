"""``diloco`` (Douillard et al. 2023, DiLoCo): each rank runs ``sync_every`` inner optimiser steps from
the shared outer parameters; then the outer gradient (outer parameters minus the rank's, averaged over
ranks) drives an outer SGD step with Nesterov momentum (``outer_lr``, ``outer_momentum``; the paper's
0.7 and 0.9), and every rank restarts from the new outer parameters. The inner optimiser keeps its
state across rounds, as in the paper. A run whose step count is not a multiple of ``sync_every`` ends
with one last outer step, so its ranks publish the same weights. The outer parameters and momentum are
part of the checkpoint (``state_tensors``).
"""

from __future__ import annotations

from typing import Any

import torch

from shardfuse.strategies.sync import Sync, local


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

    @classmethod
    def from_settings(cls, model: torch.nn.Module, world_size: int, settings: Any, group: Any = None) -> Sync:
        return cls(model, world_size, settings.sync_every, settings.outer_lr, settings.outer_momentum, group)

    def finish(self, step: int) -> None:
        if step % self.sync_every != 0:
            self.sync()

    @torch.no_grad()
    def sync(self) -> None:
        params = dict(self.model.named_parameters())
        for name, outer in zip(self.names, self.outer, strict=True):
            delta = outer - local(params[name]).detach()  # the outer gradient: the inner steps, negated
            outer.grad = self.average(delta)
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
