"""When the launcher takes a rank for lost for good (shardfuse.rank.loss): the same rank failed in every
torchrun attempt (its own exception, or a signal the agent saw; not the agent's SIGTERM to the others),
and no restart got past the newest checkpoint. Then the survivors' membership, their command, the line;
fewer than min_ranks left is one line, anything else the failure as it always was."""

from __future__ import annotations

import json

import pytest

from shardfuse.cluster.agent import KILLED_RECORD, member_rank
from shardfuse.cluster.membership import Membership
from shardfuse.io import UserError
from shardfuse.rank.failure import RankFailure, record_failure
from shardfuse.rank.loss import (
    MEMBERSHIP_FILE,
    attempt_culprits,
    killed_ranks,
    lost_member,
    read_membership,
    steps_discarded,
    survivors_after_loss,
    survivors_command,
)
from shardfuse.strategies.registry import rank_loss_problem

CONFIG = ["--config-json", json.dumps({"strategy": "localsgd", "sync_every": 5})]


def killed(staging, *kills) -> None:
    path = staging / KILLED_RECORD
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(
        "".join(json.dumps({"rank": r, "pid": 100 + i, "signal": s}) + "\n" for i, (r, s) in enumerate(kills))
    )


def started(staging, attempt: int, step: int) -> None:
    (staging / "failures").mkdir(parents=True, exist_ok=True)
    (staging / "failures" / f"attempt-{attempt}.start.json").write_text(json.dumps({"step": step}))


def checkpoint(staging, step: int) -> None:
    (staging / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (staging / "checkpoints" / f"step-{step}" / "COMPLETE").write_text(f"{step}\n")


def raised(staging, rank: int, attempt: int, peer_lost: bool = False) -> None:
    record_failure(staging, RankFailure(rank, attempt, "RuntimeError", "boom", False, peer_lost))


def test_each_attempts_culprit_is_its_own_exception_else_the_next_rank_a_signal_killed(tmp_path):
    raised(tmp_path, 2, 0)  # attempt 0: rank 2 raised
    raised(tmp_path, 0, 1, peer_lost=True)  # attempt 1: rank 0 lost its peer, rank 1 was killed
    killed(tmp_path, (1, 9), (0, 15), (2, 15))  # the agent's SIGTERMs to the others are no culprits
    assert killed_ranks(tmp_path) == [1]
    assert attempt_culprits(tmp_path, 2, killed_ranks(tmp_path)) == [2, 1, None]
    raised(tmp_path, 0, 2, peer_lost=True)  # attempt 2: only a peer's lost connection, no kill seen
    assert attempt_culprits(tmp_path, 2, killed_ranks(tmp_path)) == [2, 1, None]


def test_a_rank_is_lost_only_when_it_failed_every_attempt_and_no_restart_got_past_the_checkpoint():
    membership = Membership.full(3)
    assert lost_member(membership, [1, 1], [40], 40).rank == 1
    assert lost_member(membership, [1, 1], [None], 40).rank == 1  # died before agreeing where to resume
    assert lost_member(membership, [1], [], 0).rank == 1  # max_restarts 0: one failure is the last
    assert lost_member(membership, [1, 2], [40], 40) is None  # two ranks: no one rank is gone
    assert lost_member(membership, [1, None], [40], 40) is None  # an attempt without a culprit
    assert lost_member(membership, [1, 1], [20], 40) is None  # the restart got from 20 to 40: progress
    assert lost_member(membership.lose(1, 40, 0), [1, 1], [40], 40) is None  # lost already


def test_steps_discarded_are_all_of_an_independent_ranks_and_those_since_the_last_sync_otherwise():
    assert steps_discarded("localsgd", 0, 42) == 42
    assert steps_discarded("localsgd", 5, 42) == 2
    assert steps_discarded("diloco", 16, 48) == 0
    assert steps_discarded("ddp", 0, 42) == 0  # every step's gradients reached the others


def test_the_survivors_go_on_from_the_checkpoint_with_their_membership_written_for_a_rerun(tmp_path, capsys):
    checkpoint(tmp_path, 40)
    started(tmp_path, 1, 40)
    killed(tmp_path, (1, 9), (0, 15), (2, 15), (1, 9))
    survivors = survivors_after_loss(Membership.full(3), tmp_path, CONFIG, max_restarts=1, min_ranks=2)
    assert survivors is not None and survivors.lost_ranks == (1,)
    assert survivors.member(1).lost_at_step == 40 and survivors.member(1).steps_discarded == 0
    assert read_membership(tmp_path) == survivors
    assert not (tmp_path / "failures").exists()  # the next torchrun counts its attempts anew
    assert (
        "launch: rank 1 was lost for good: it failed 2 time(s) in a row at step 40 (max_restarts 1); the "
        "other 2 of 3 ranks go on from step 40 without it (min_ranks 2); its shard 1 is left unseen"
    ) in capsys.readouterr().err
    geometry, command = survivors_command(survivors, tmp_path, CONFIG, {}, 1)
    assert geometry.world_size == 2
    assert command[-2:] == ["--membership", str(tmp_path / MEMBERSHIP_FILE)]
    # The agent names each forked rank after its member, so a kill record names the member.
    assert member_rank(command, "1") == "2" and member_rank(command, "0") == "0"
    assert member_rank(CONFIG, "1") == "1"  # no membership: torch's rank

    # A second loss would leave one rank: fewer than min_ranks is one line, nothing relaunched.
    started(tmp_path, 1, 40)
    killed(tmp_path, (2, 9), (2, 9))
    with pytest.raises(
        UserError, match=r"rank 2 was lost for good .* only 1 of 3 ranks are left, fewer than min_ranks 2"
    ):
        survivors_after_loss(survivors, tmp_path, CONFIG, max_restarts=1, min_ranks=2)


def test_without_min_ranks_below_the_world_size_a_failure_stays_a_failure(tmp_path):
    checkpoint(tmp_path, 40)
    killed(tmp_path, (1, 9), (1, 9))
    assert survivors_after_loss(Membership.full(3), tmp_path, CONFIG, 1, min_ranks=None) is None
    assert survivors_after_loss(Membership.full(3), tmp_path, CONFIG, 1, min_ranks=3) is None
    assert not (tmp_path / MEMBERSHIP_FILE).exists()


def test_a_ddp_training_with_reshard_loses_nothing_and_says_its_shard_is_dealt(tmp_path, capsys):
    config = ["--config-json", json.dumps({"strategy": "ddp", "orphans": "reshard"})]
    checkpoint(tmp_path, 40)
    started(tmp_path, 1, 40)
    killed(tmp_path, (1, 9), (1, 9))
    survivors = survivors_after_loss(Membership.full(3), tmp_path, config, max_restarts=1, min_ranks=2)
    assert survivors is not None and survivors.member(1).dealt and survivors.steps_discarded == 0
    assert (
        "its shard 1 is dealt to them, each of its micro-batches split 2 ways (orphans: reshard)"
        in capsys.readouterr().err
    )


@pytest.mark.parametrize(
    ("strategy", "orphans", "unaligned", "problem"),
    [
        ("localsgd", "drop", None, None),
        ("localsgd", "reshard", None, None),
        ("diloco", "reshard", None, None),
        ("ddp", "reshard", None, None),
        ("ddp", "drop", None, "min_ranks 2 with strategy ddp and orphans drop: its ranks train one model"),
        ("localsgd", "reshard", "own", "orphans: reshard deals each of the lost rank's micro-batches"),
        ("localsgd", "drop", "own", None),  # nothing to deal: each rank its own steps is fine
    ],
)
def test_which_strategies_and_orphans_go_on_without_a_rank(strategy, orphans, unaligned, problem):
    found = rank_loss_problem(2, 3, strategy, 1, 1, orphans, unaligned)
    assert found == problem if problem is None else problem in found
    assert rank_loss_problem(None, 3, strategy, 1, 1, "drop") is None  # today's behaviour: every rank needed
    assert "so no rank may be lost" in rank_loss_problem(3, 3, strategy, 1, 1, "reshard")


def test_a_rank_waiting_in_vain_for_another_to_join_is_not_the_culprit(tmp_path):
    from shardfuse.rank.dist import RanksDidNotJoin
    from shardfuse.rank.failure import rank_failure

    for attempt in (0, 1):  # rank 0 records that rank 1 never joined; the agent SIGTERMs the hung rank 1
        record_failure(tmp_path, rank_failure(0, RanksDidNotJoin("not every rank joined"), attempt))
    killed(tmp_path, (1, 15), (1, 15))
    assert attempt_culprits(tmp_path, 1, killed_ranks(tmp_path)) == [None, None]  # so no rank is lost


def test_on_several_nodes_min_ranks_must_let_a_whole_node_go():
    assert rank_loss_problem(2, 4, "localsgd", 1, 2, "drop") is None  # a node of 2 ranks may go
    assert rank_loss_problem(1, 4, "diloco", 1, 2, "drop") is None
    found = rank_loss_problem(3, 4, "localsgd", 1, 2, "drop")
    assert "the unit of loss is a node, which takes its 2 rank(s) with it" in found
    assert "set min_ranks to at most 2, or to 4" in found
