"""What every strategy's hook shares: told about each optimiser step, it syncs when its cadence says and
counts the bytes it all-reduces per rank (the payload of each collective on model state; the ring
algorithm's factor and the one-off broadcast of the initial weights are not counted), so the
communication each strategy costs is recorded next to what it achieves (train.json's ``num_syncs`` and
``bytes_all_reduced_per_rank``).

With ``fsdp: S`` (:mod:`shardfuse.rank.fsdp`) each strategy acts across the replicas on every rank's
local shards, over the mesh's ``replicate`` group: the counts are of those shards, per rank. The
strategies themselves are one module each (ddp, localsgd, diloco), named by the records of
:mod:`shardfuse.strategies.registry`.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as torch_dist


def is_dtensor(tensor: Any) -> bool:
    from torch.distributed.tensor import DTensor

    return isinstance(tensor, DTensor)


def local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a sharded tensor (a DTensor); any other tensor as it is."""
    return tensor.to_local() if is_dtensor(tensor) else tensor


def parameter_bytes(model: torch.nn.Module) -> int:
    """Bytes of this rank's trainable parameters (its local shards, under fsdp)."""
    return sum(local(p).numel() * local(p).element_size() for p in model.parameters() if p.requires_grad)


class Sync:
    """The strategy's hook after every optimiser step; counts syncs and bytes all-reduced per rank.

    ``world_size`` ranks (replicas, under fsdp) take part, in ``group`` (None: the whole world).
    ``share`` (None: every rank the same, ``1 / world_size``) is this rank's weight in an average over
    the ranks: after a lost rank, the rows it holds over the rows the survivors hold
    (:meth:`shardfuse.cluster.membership.Membership.row_shares`)."""

    def __init__(self, model: torch.nn.Module, world_size: int, sync_every: int, group: Any = None) -> None:
        self.model, self.world_size, self.sync_every, self.group = model, world_size, sync_every, group
        self.num_syncs = 0
        self.share: float | None = None
        self.payload_bytes = parameter_bytes(model) if world_size > 1 or group is None else 0

    @classmethod
    def from_settings(cls, model: torch.nn.Module, world_size: int, settings: Any, group: Any = None) -> Sync:
        """Built from the run's sync settings (:class:`shardfuse.strategies.registry.SyncSettings`);
        a strategy with keys of its own reads them here."""
        return cls(model, world_size, settings.sync_every, group)

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

    def average(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` replaced in place by its average over the ranks: the mean, or with ``share`` the
        ranks' weighted sum."""
        if self.share is None:
            torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=self.group)
            return tensor.div_(self.world_size)
        tensor.mul_(self.share)
        torch_dist.all_reduce(tensor, op=torch_dist.ReduceOp.SUM, group=self.group)
        return tensor

    # Checkpointed state beyond the model and inner optimiser (empty for the stateless strategies).
    def state_tensors(self) -> dict[str, torch.Tensor]:
        return {}

    def load_state_tensors(self, tensors: dict[str, torch.Tensor]) -> None:
        pass
