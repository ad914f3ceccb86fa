"""orphans: reshard on a survivor: the lost rank's own seeded micro-batches, from its loss on, split among
the survivors in rank order and joined to each one's own (real shards, the reader the ranks use)."""

from __future__ import annotations

import torch

from shardfuse.cluster.membership import Member, Membership
from shardfuse.data.epoch_steps import plan_epochs
from shardfuse.data.manifest import read_manifest
from shardfuse.data.reader import ShardReader
from shardfuse.experiment.keys import rank_seed
from shardfuse.rank.orphans import OrphanRows, loss_slot, rows_dealt

SEED, BATCH = 3, 64


def batches(shards, shard: int, member: int, epoch: int, plan, start: int = 0) -> list:
    own = plan.shards[shard]
    with ShardReader(shards, shard, seed=rank_seed(SEED, member), cache=True) as reader:
        return list(reader.epoch(epoch, own.num_batches, start, own.rows))


def test_the_loss_slot_is_where_the_step_after_the_loss_begins():
    assert loss_slot(3, num_batches=10, grad_accum_steps=1) == (0, 3)
    assert loss_slot(10, num_batches=10, grad_accum_steps=1) == (1, 0)
    assert loss_slot(5, num_batches=10, grad_accum_steps=3) == (1, 3)  # 4 steps of 3, 3, 3, 1 an epoch


def test_two_survivors_split_each_lost_micro_batch_from_the_loss_on_and_nothing_before(digits_shards):
    rows = [shard["rows"] for shard in read_manifest(digits_shards)["shards"]]
    plan = plan_epochs(rows, BATCH, "min")
    # Three members over two shards: members 0 and 2 read shard 0, member 1 (lost at step 3) shard 1.
    lost = Member(1, 1, 1, alive=False, lost_at_step=3, steps_discarded=0, orphans="reshard")
    members = Membership(2, (Member(0, 0, 0), lost, Member(2, 2, 0))).members
    lost_batches = batches(digits_shards, 1, 1, 0, plan)
    parts = []
    for survivor in (0, 2):
        own = batches(digits_shards, 0, survivor, 0, plan)
        with (
            OrphanRows(members, survivor, plan, str(digits_shards), SEED, 1) as orphans,
            ShardReader(digits_shards, 0, seed=rank_seed(SEED, survivor), cache=True) as reader,
        ):
            dealt = list(orphans.deal(0, 0, reader.epoch(0, plan.num_batches, 0, plan.shards[0].rows)))
        assert len(dealt) == plan.num_batches
        for index in range(3):  # before the loss: its own batches, untouched
            assert torch.equal(dealt[index][0], own[index][0]) and torch.equal(dealt[index][1], own[index][1])
        parts.append([(x[len(o[0]) :], y[len(o[1]) :]) for (x, y), o in zip(dealt[3:], own[3:], strict=True)])
        for (x, _), o in zip(dealt[3:], own[3:], strict=True):
            assert torch.equal(x[: len(o[0])], o[0])  # its own rows first
        # train.json's rows_dealt, counted from the plan: the rows joined, to any point of the clock
        joined_rows = [len(x) - len(o[0]) for (x, _), o in zip(dealt, own, strict=True)]
        for stop in (0, 3, 5, plan.num_batches):
            assert rows_dealt(members, survivor, plan, 1, 0, stop) == sum(joined_rows[:stop])
        whole_epoch = sum(len(torch.tensor_split(batch[0], 2)[survivor // 2]) for batch in lost_batches)
        assert rows_dealt(members, survivor, plan, 1, 1, plan.num_batches) == sum(joined_rows) + whole_epoch
    for index, (first, second) in enumerate(zip(*parts, strict=True), start=3):
        assert abs(len(first[0]) - len(second[0])) <= 1  # tensor_split: sizes differ by one row at most
        assert torch.equal(torch.cat([first[0], second[0]]), lost_batches[index][0])  # every lost row, once
        assert torch.equal(torch.cat([first[1], second[1]]), lost_batches[index][1])
    # A later epoch is dealt from its first batch; a resume mid-epoch deals from where it resumes.
    with (
        OrphanRows(members, 0, plan, str(digits_shards), SEED, 1) as orphans,
        ShardReader(digits_shards, 0, seed=rank_seed(SEED, 0), cache=True) as reader,
    ):
        later = list(orphans.deal(1, 2, reader.epoch(1, plan.num_batches, 2, plan.shards[0].rows)))
    lost_later = batches(digits_shards, 1, 1, 1, plan, start=2)
    own_later = batches(digits_shards, 0, 0, 1, plan, start=2)
    assert len(later) == len(lost_later) == plan.num_batches - 2
    for (x, _), lost_batch, own in zip(later, lost_later, own_later, strict=True):
        assert torch.equal(x, torch.cat([own[0], torch.tensor_split(lost_batch[0], 2)[0]]))


def test_a_dropped_shard_is_not_read_and_the_own_batches_pass_through(digits_shards):
    rows = [shard["rows"] for shard in read_manifest(digits_shards)["shards"]]
    plan = plan_epochs(rows, BATCH, "min")
    dropped = Membership(2, (Member(0, 0, 0), Member(1, 1, 1, False, 3, 3, "drop"))).members
    own = iter([(torch.zeros(2, 3), torch.zeros(2))])
    with OrphanRows(dropped, 0, plan, str(digits_shards), SEED, 1) as orphans:
        assert orphans.orphans == [] and orphans.deal(0, 0, own) is own
