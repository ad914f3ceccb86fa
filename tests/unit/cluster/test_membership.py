"""Membership: which replica trains which data shard and which ranks are alive, apart from torch's rank."""

from __future__ import annotations

import json

import pytest

from shardfuse.cluster.membership import Member, Membership, recorded_membership
from shardfuse.io import UserError


def test_a_full_membership_reads_shard_r_on_rank_r_in_replicas_of_consecutive_ranks():
    membership = Membership.full(4, ranks_per_replica=2)
    assert [membership.shard_of(rank) for rank in range(4)] == [0, 1, 2, 3]
    assert [membership.member(rank).replica for rank in range(4)] == [0, 0, 1, 1]
    assert membership.replicas == (0, 1) and membership.ranks_of(1) == [2, 3]
    assert membership.lost_ranks == () and membership.alive_replicas == (0, 1)
    assert membership.covered_shards == (0, 1, 2, 3) and membership.coverage == 1.0


def test_without_fsdp_every_rank_is_its_own_replica():
    membership = Membership.full(3)
    assert membership.replicas == (0, 1, 2) and membership.world_size == 3


def test_a_lost_rank_takes_its_replica_and_the_replicas_shards_out_of_coverage():
    membership = Membership.full(4, ranks_per_replica=2).without(3)
    assert membership.lost_ranks == (3,)
    assert membership.alive_replicas == (0,)  # replica 1 lost rank 3's slice of its model
    assert membership.covered_shards == (0, 1) and membership.coverage == 0.5
    assert Membership.full(4).without(0, 2).covered_shards == (1, 3)


def test_a_member_may_read_another_shard_than_its_torch_rank():
    """What survivors taking over a lost rank's shard would record: the data shard is not the rank."""
    membership = Membership(2, (Member(0, 0, 1), Member(1, 1, 0)))
    assert membership.shard_of(0) == 1 and membership.shard_of(1) == 0 and membership.coverage == 1.0


def test_the_json_form_round_trips_and_its_derived_fields_are_recomputed():
    membership = Membership.full(4, ranks_per_replica=2).without(2)
    data = json.loads(json.dumps(membership.to_json()))
    assert data["lost_ranks"] == [2] and data["alive_replicas"] == [0] and data["coverage"] == 0.5
    assert data["ranks"][2] == {"rank": 2, "replica": 1, "data_shard": 2, "alive": False}
    assert (
        Membership.from_json({**data, "coverage": 1.0, "lost_ranks": []}, "train.json", "fix") == membership
    )


@pytest.mark.parametrize(
    "data",
    [None, {}, {"num_shards": 2, "ranks": [{"rank": 0}]}, {"num_shards": 1, "ranks": [
        {"rank": 0, "replica": 0, "data_shard": 5, "alive": True}]}],
)  # fmt: skip
def test_a_malformed_membership_is_one_line_naming_the_file_and_the_fix(data):
    with pytest.raises(UserError, match=r"^t/train.json: 'membership' is malformed .*; re-run training$"):
        Membership.from_json(data, "t/train.json", "re-run training")


def test_ranks_must_be_listed_once_each_in_order_and_a_stranger_cannot_be_lost():
    with pytest.raises(UserError, match=r"ranks 0\.\.n-1 once each"):
        Membership(2, (Member(1, 0, 0), Member(0, 1, 1)))
    with pytest.raises(UserError, match="rank 5 is not a member"):
        Membership.full(2).without(5)
    with pytest.raises(UserError, match="do not split into replicas of 2"):
        Membership.full(3, ranks_per_replica=2)


def test_a_train_json_from_before_membership_reads_as_every_rank_alive_in_its_fsdp_replicas():
    assert recorded_membership({"fsdp": {"shards_per_replica": 2}}, 4, "t", "fix") == Membership.full(4, 2)
    assert recorded_membership({}, 3, "t", "fix") == Membership.full(3)
    recorded = {"membership": Membership.full(2).without(1).to_json()}
    assert recorded_membership(recorded, 2, "t", "fix").lost_ranks == (1,)
    with pytest.raises(UserError, match=r"^t: its membership lists 2 ranks, not 3; fix$"):
        recorded_membership(recorded, 3, "t", "fix")


def test_a_lost_rank_leaves_the_survivors_numbered_by_torch_and_says_what_it_took():
    membership = Membership.full(3).lose(1, at_step=40, steps_discarded=40)
    assert [m.rank for m in membership.alive_members] == [0, 2]
    assert membership.member_of_process(1).rank == 2 and membership.process_of(2) == 1
    assert membership.lost_ranks == (1,) and membership.steps_discarded == 40
    assert membership.covered_shards == (0, 2)
    data = membership.to_json()
    assert data["ranks"][1] == {
        "rank": 1, "replica": 1, "data_shard": 1, "alive": False, "lost_at_step": 40, "steps_discarded": 40,
        "orphans": "drop",
    }  # fmt: skip
    assert data["steps_discarded"] == 40
    assert Membership.from_json(data, "train.json", "fix") == membership
    assert "steps_discarded" not in Membership.full(3).to_json()  # a full membership's record is as it was
    with pytest.raises(
        UserError, match="torch rank 2 is not a member: 2 of the training's 3 ranks are alive"
    ):
        membership.member_of_process(2)
    with pytest.raises(UserError, match="rank 1 was lost already"):
        membership.lose(1, 50, 0)


def test_coverage_counts_a_lost_shards_rows_up_to_its_last_step_that_reached_the_others():
    rows = [300, 100, 100]  # shard 0 holds 60 % of the rows
    independent = Membership.full(3).lose(0, at_step=25, steps_discarded=25)  # never met the others
    assert independent.epoch_coverage(rows, steps_per_epoch=10, epochs=3) == pytest.approx([0.4, 0.4, 0.4])
    synced = Membership.full(3).lose(0, at_step=25, steps_discarded=5)  # its last sync at step 20
    assert synced.epoch_coverage(rows, steps_per_epoch=10, epochs=3) == pytest.approx([1.0, 1.0, 0.4])
    assert Membership.full(3).epoch_coverage(rows, 10, 2) == [1.0, 1.0]
    assert synced.row_coverage(rows) == pytest.approx(0.4)


def test_a_resharded_shard_counts_from_the_loss_on_and_its_policy_round_trips():
    rows = [300, 100, 100]
    dealt = Membership.full(3).lose(0, at_step=25, steps_discarded=25, orphans="reshard")
    # Epoch 2 (steps 20-30): its half before step 25 is lost with it, the half after is dealt.
    assert dealt.epoch_coverage(rows, steps_per_epoch=10, epochs=4) == pytest.approx([0.4, 0.4, 0.7, 1.0])
    ddp = Membership.full(3).lose(0, at_step=25, steps_discarded=0, orphans="reshard")  # nothing discarded
    assert ddp.epoch_coverage(rows, steps_per_epoch=10, epochs=3) == pytest.approx([1.0, 1.0, 1.0])
    assert dealt.covered_shards == (0, 1, 2) and dealt.member(0).dealt and not dealt.member(1).dealt
    assert Membership.from_json(dealt.to_json(), "train.json", "fix") == dealt
    old = dealt.to_json()
    del old["ranks"][0]["orphans"]  # a record from before the key: every loss then dropped its shard
    assert Membership.from_json(old, "train.json", "fix").member(0).orphans == "drop"
    with pytest.raises(UserError, match="orphans 'keep' is not one of drop, reshard"):
        Membership.full(3).lose(0, 25, 25, orphans="keep")


def test_survivors_weigh_by_the_rows_they_hold_their_own_shard_and_an_equal_part_of_a_dealt_one():
    rows = [300, 100, 60]
    assert Membership.full(3).row_shares(rows) == {}  # no loss: every rank weighs the same, as ever
    dropped = Membership.full(3).lose(1, at_step=40, steps_discarded=0)
    assert dropped.row_shares(rows) == {0: 300 / 360, 2: 60 / 360}  # the lost rank's rows are unseen
    dealt = Membership.full(3).lose(1, at_step=40, steps_discarded=0, orphans="reshard")
    assert dealt.row_shares(rows) == pytest.approx({0: 350 / 460, 2: 110 / 460})  # 50 of its 100 each
    twice = dealt.lose(2, at_step=60, steps_discarded=0, orphans="reshard")
    assert twice.row_shares(rows) == {0: 1.0}
