"""``orphans: reshard``: the survivors of a rank lost for good take its rows.

A rank lost for good (:mod:`shardfuse.rank.loss`) leaves its shard behind. With ``orphans: reshard`` every
survivor reads the lost rank's shard too, in the lost rank's own seeded order and micro-batches (what it
would have taken: :class:`shardfuse.data.reader.ShardReader` gives the same batches to whoever asks with
its seed), and from the step the survivors resume at, each of the lost rank's micro-batches is split
``torch.tensor_split``-wise into as many parts as there are survivors, part ``j`` joining the ``j``-th
alive member's own micro-batch (members in rank order). So:

- the global batch (the rows of one step over all ranks) and the step count stay as planned, and so does
  the learning-rate schedule: ddp goes on as elastic data parallel, its all-reduce now over the survivors;
- its rows not yet taken in the current epoch and all of its later epochs are trained on;
- a re-run that resumes the survivors reproduces it bitwise (the rule depends on seeds and steps only),
  and train.json records it with the lost member (``orphans: reshard``; README "A rank lost for good").

Before the loss step nothing is dealt (the lost rank took its own batches then); a lost member whose
shard is dropped (``orphans: drop``) is not read at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from shardfuse.cluster.membership import Member
from shardfuse.data.epoch_steps import EpochPlan, ShardEpoch, optimizer_steps, split_sizes
from shardfuse.data.reader import ShardReader
from shardfuse.experiment.keys import rank_seed

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass
class _Orphan:
    member: Member
    reader: ShardReader
    epoch: ShardEpoch


def loss_slot(lost_at_step: int, num_batches: int, grad_accum_steps: int) -> tuple[int, int]:
    """(epoch, micro-batch) of the clock where the step after ``lost_at_step`` begins: the first
    micro-batch the lost rank did not take for a model anyone holds."""
    steps_per_epoch = optimizer_steps(num_batches, grad_accum_steps)
    epoch, within = divmod(lost_at_step, steps_per_epoch)
    return epoch, min(within * grad_accum_steps, num_batches)


def survivor_part(members: tuple[Member, ...], survivor_rank: int) -> tuple[int, int]:
    """(part, parts): which part of each dealt micro-batch survivor ``survivor_rank`` takes, of how many
    (the alive members in rank order)."""
    alive = [member.rank for member in members if member.alive]
    return alive.index(survivor_rank), len(alive)


def share(batch: Batch, part: int, parts: int) -> Batch:
    """Part ``part`` of ``parts`` of a micro-batch, cut as torch.tensor_split cuts it (sizes differ by at
    most one row)."""
    inputs, targets = batch
    return torch.tensor_split(inputs, parts)[part], torch.tensor_split(targets, parts)[part]


def joined(own: Batch, extra: list[Batch]) -> Batch:
    if not extra:
        return own
    return torch.cat([own[0], *(b[0] for b in extra)]), torch.cat([own[1], *(b[1] for b in extra)])


class OrphanRows:
    """On one survivor, the lost ranks' micro-batches it takes on (none: its own batches unchanged)::

        with OrphanRows(members, survivor_rank, plan, shard_dir, seed, grad_accum_steps) as orphans:
            batches = orphans.deal(epoch, start, reader.epoch(epoch, num_batches, start, rows))

    ``members``: the training's membership's members; ``survivor_rank``: this survivor's member rank."""

    def __init__(
        self,
        members: tuple[Member, ...],
        survivor_rank: int,
        plan: EpochPlan,
        shard_dir: str | Path,
        seed: int,
        grad_accum_steps: int,
    ) -> None:
        self.part, self.parts = survivor_part(members, survivor_rank)
        self.num_batches, self.grad_accum_steps = plan.num_batches, grad_accum_steps
        self._stack = contextlib.ExitStack()
        self.orphans: list[_Orphan] = []
        for member in members:
            if member.dealt:
                reader = ShardReader(
                    shard_dir, member.data_shard, seed=rank_seed(seed, member.rank), cache=True, verify=True
                )
                self._stack.enter_context(reader)
                self.orphans.append(_Orphan(member, reader, plan.shards[member.data_shard]))

    def __enter__(self) -> OrphanRows:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stack.close()

    def deal(self, epoch: int, start: int, own: Iterator[Batch]) -> Iterator[Batch]:
        """This survivor's micro-batches of ``epoch`` from ``start`` on: its own (``own``), each with its
        part of every dealt lost rank's micro-batch of the same slot from that rank's loss on."""
        if not self.orphans:
            return own
        return self._dealt(epoch, start, own)

    def _dealt(self, epoch: int, start: int, own: Iterator[Batch]) -> Iterator[Batch]:
        streams = []
        for orphan in self.orphans:
            lost_epoch, lost_batch = loss_slot(
                orphan.member.lost_at_step or 0, self.num_batches, self.grad_accum_steps
            )
            if (epoch, self.num_batches) <= (lost_epoch, lost_batch):
                continue  # the whole epoch before its loss: it took these itself
            first = start if epoch > lost_epoch else max(start, lost_batch)
            batches = orphan.reader.epoch(epoch, orphan.epoch.num_batches, first, orphan.epoch.rows)
            streams.append((first, batches))
        for index, batch in enumerate(own, start=start):
            extra = [share(next(stream), self.part, self.parts) for at, stream in streams if index >= at]
            yield joined(batch, extra)


def rows_dealt(
    members: tuple[Member, ...],
    survivor_rank: int,
    plan: EpochPlan,
    grad_accum_steps: int,
    epoch: int,
    batch: int,
) -> int:
    """The lost ranks' rows survivor ``survivor_rank`` took on before clock position (``epoch``, ``batch``):
    train.json's ``rows_dealt`` (what :meth:`OrphanRows.deal` joined to its batches, counted from the plan,
    so a resumed run counts the part before it too)."""
    part, parts = survivor_part(members, survivor_rank)
    total = 0
    for member in members:
        if not member.dealt:
            continue
        lost_epoch, lost_batch = loss_slot(member.lost_at_step or 0, plan.num_batches, grad_accum_steps)
        sizes = split_sizes(plan.shards[member.data_shard].rows, plan.num_batches)
        for each in range(lost_epoch, epoch + 1):
            first = lost_batch if each == lost_epoch else 0
            stop = batch if each == epoch else plan.num_batches
            total += sum(split_sizes(size, parts)[part] for size in sizes[first:stop])
    return total
