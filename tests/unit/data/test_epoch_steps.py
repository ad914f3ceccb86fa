"""How ranks with unequal shards line up an epoch (epoch_steps): every choice's rows and micro-batches per
shard, the counts of steps and rows a rank has taken at a point of the shared clock, the warning at the
default, and which strategies may let their ranks take their own step counts."""

from __future__ import annotations

import math

import pytest

from shardfuse.data.epoch_steps import DEFAULT, alignment_problem, names, plan_epochs, split_sizes
from shardfuse.io import UserError
from shardfuse.strategies.registry import apart_runs, find_strategy

# The shards of the issue: a Dirichlet(0.1) split made by hand.
HAND_MADE = [318, 256, 13, 672]


def epoch_of(plan, shard: int) -> tuple[int, int]:
    return plan.shards[shard].rows, plan.shards[shard].num_batches


@pytest.mark.parametrize(
    ("mode", "rows", "num_batches"),
    [
        ("min", [13, 13, 13, 13], [1, 1, 1, 1]),  # larger shards stop early
        ("max", [672, 672, 672, 672], [21, 21, 21, 21]),  # smaller shards cycle
        ("mean", [314, 314, 314, 314], [10, 10, 10, 10]),  # (318 + 256 + 13 + 672) // 4: both
        ("own", [318, 256, 13, 672], [10, 8, 1, 21]),  # each its own: FedAvg's local epoch
    ],
)
def test_each_choice_gives_every_shard_its_epoch_rows_and_batch_size_rows_per_step(mode, rows, num_batches):
    plan = plan_epochs(HAND_MADE, 32, mode)
    assert [epoch_of(plan, shard) for shard in range(4)] == list(zip(rows, num_batches, strict=True))
    for shard in plan.shards:
        sizes = split_sizes(shard.rows, shard.num_batches)
        assert sum(sizes) == shard.rows and max(sizes) <= 32  # batch_size is the rows of a step
    assert plan.num_batches == max(num_batches)  # the shared clock: the longest epoch's
    assert plan.aligned == (mode != "own")


def test_a_synchronising_choice_gives_every_rank_the_same_steps_and_rows_a_step():
    for mode in ("min", "max", "mean"):
        plan = plan_epochs(HAND_MADE, 32, mode)
        assert len({shard.num_batches for shard in plan.shards}) == 1
        assert len({tuple(split_sizes(s.rows, s.num_batches)) for s in plan.shards}) == 1


@pytest.mark.parametrize("batch_size", [32, 37, 64, 629, 1000])
def test_iid_shards_train_as_before_every_shard_spread_over_the_smallest_shards_steps(batch_size):
    # iid: sizes differ by at most one row. Before epoch_steps every rank took ceil(smallest / batch_size)
    # micro-batches and cut its whole shard into them; the default must give exactly that.
    plan = plan_epochs([630, 629], batch_size, DEFAULT)
    legacy = max(1, math.ceil(629 / batch_size))
    assert [epoch_of(plan, shard) for shard in range(2)] == [(630, legacy), (629, legacy)]
    assert plan.warning() is None


def test_a_shard_one_row_over_the_target_keeps_it_and_others_are_cut_or_cycled_to_it():
    plan = plan_epochs([101, 100, 99, 40], 10, "mean")  # mean 85
    assert [shard.rows for shard in plan.shards] == [85, 85, 85, 85]
    plan = plan_epochs([101, 100, 99], 10, "min")
    assert [shard.rows for shard in plan.shards] == [99, 100, 99]  # 100 keeps its row, 101 stops at 99


def test_rows_seen_and_steps_taken_follow_the_shared_clock():
    plan = plan_epochs(HAND_MADE, 32, "own")
    accum = 3
    # Rank 2 (13 rows, one micro-batch an epoch) waits out the other slots: done after slot 1.
    assert plan.rows_seen(2, 0, 1) == 13 and plan.rows_seen(2, 0, 21) == 13
    assert plan.steps_taken(2, 0, 21, accum) == 1
    assert plan.rows_seen(2, 3, 6) == 4 * 13 and plan.steps_taken(2, 3, 6, accum) == 4
    # Rank 3 (672 rows in 21 slots of 32): mid-epoch, then whole epochs.
    assert plan.rows_seen(3, 0, 6) == 6 * 32 and plan.steps_taken(3, 0, 6, accum) == 2
    assert plan.rows_seen(3, 2, 21) == 3 * 672 and plan.steps_taken(3, 2, 21, accum) == 3 * 7
    # An epoch's split: the first micro-batches take the extra rows.
    mean = plan_epochs(HAND_MADE, 32, "mean")  # 314 rows in 10: four of 32, six of 31
    assert [mean.rows_seen(0, 0, k) for k in (1, 4, 5, 10)] == [32, 128, 159, 314]


def test_the_warning_is_one_line_at_the_default_only_when_shards_are_over_twice_apart():
    warning = plan_epochs(HAND_MADE, 32, DEFAULT).warning()
    assert warning.startswith("warning: shards of 13 to 672 rows (more than 2x apart): epoch_steps min")
    assert "set epoch_steps (max, mean, own)" in warning and "\n" not in warning
    assert plan_epochs(HAND_MADE, 32, "max").warning() is None  # a choice was made
    assert plan_epochs([200, 100], 32, DEFAULT).warning() is None  # 2x: not over


@pytest.mark.parametrize(
    ("strategy", "sync_every", "fsdp", "refused"),
    [
        ("localsgd", 0, 1, None),
        ("localsgd", 8, 1, "strategy localsgd with sync_every 8 keeps the ranks in step"),
        ("ddp", 0, 1, "strategy ddp keeps the ranks in step"),
        ("diloco", 4, 1, "strategy diloco with sync_every 4 keeps the ranks in step"),
        ("localsgd", 0, 2, "with fsdp 2 the ranks of a replica share one model"),
    ],
)
def test_own_steps_are_only_for_ranks_that_never_meet_while_training(strategy, sync_every, fsdp, refused):
    problem = alignment_problem("own", find_strategy(strategy), sync_every, fsdp, apart_runs())
    if refused is None:
        assert problem is None
    else:
        assert problem.startswith("epoch_steps: own lets each rank take its own number of steps")
        assert refused in problem
    for mode in ("min", "max", "mean"):  # the same step counts everywhere: any strategy
        assert alignment_problem(mode, find_strategy(strategy), sync_every, fsdp, apart_runs()) is None


def test_an_unknown_choice_is_one_line_naming_the_known():
    assert names() == ("min", "max", "mean", "own") and DEFAULT == "min"
    with pytest.raises(UserError, match="unknown epoch_steps 'longest'; use one of min, max, mean, own"):
        plan_epochs(HAND_MADE, 32, "longest")


def test_epoch_steps_joins_a_trainings_name_only_off_its_default():
    from shardfuse.experiment.load import load_experiment
    from tests.support.helpers import base_config

    runs = {
        "plain": {},
        "min": {"epoch_steps": "min"},
        "max": {"epoch_steps": "max"},
        "mean": {"epoch_steps": "mean"},
    }
    experiment = load_experiment(base_config(runs), environ={})
    names = {run: experiment.training(run) for run in runs}
    assert names["plain"] == names["min"] and len({names["plain"], names["max"], names["mean"]}) == 3
