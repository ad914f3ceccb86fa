"""Stopping with a checkpoint: how often the ranks agree, the margin before a SLURM time limit, and the
records the launcher reads (the stops themselves: tests/slow/test_stop_with_a_checkpoint.py and
tests/services/test_slurm_jobs.py)."""

from __future__ import annotations

import pytest

from shardfuse.io import UserError
from shardfuse.launch import DEFAULT_STOP_BEFORE, STOP_BEFORE_ENV, stop_before_limit
from shardfuse.rank.stop import MAX_CHECK_STEPS, steps_between_checks
from shardfuse.rank.stop_files import read_stop, record_stop


@pytest.mark.parametrize(
    ("seconds_per_step", "steps"),
    [
        (2.0, 1),
        (0.5, 2),
        (0.01, 100),
        (1e-6, MAX_CHECK_STEPS),
        (0.0, 1),
        (float("nan"), 1),
        (float("inf"), 1),
    ],
)
def test_the_ranks_agree_about_once_a_second_of_training(seconds_per_step, steps):
    assert steps_between_checks(seconds_per_step) == steps


def test_the_margin_is_the_flag_else_the_environment_else_the_default():
    assert stop_before_limit(None, {}) == DEFAULT_STOP_BEFORE
    assert stop_before_limit(None, {STOP_BEFORE_ENV: "40"}) == 40
    assert stop_before_limit(0, {STOP_BEFORE_ENV: "40"}) == 0


@pytest.mark.parametrize(("flag", "env", "fragment"), [
    (None, "soon", "SHARDFUSE_STOP_BEFORE_LIMIT is 'soon', not a number of seconds"),
    (-5.0, "", "--stop-before-limit is -5; give the seconds before the time limit"),
    (None, "inf", "SHARDFUSE_STOP_BEFORE_LIMIT is inf"),
])  # fmt: skip
def test_a_bad_margin_is_one_line_naming_where_it_came_from(flag, env, fragment):
    with pytest.raises(UserError, match=fragment.replace("(", r"\(")):
        stop_before_limit(flag, {STOP_BEFORE_ENV: env})


def test_the_stop_record_round_trips_and_a_broken_one_reads_as_none(tmp_path):
    assert read_stop(tmp_path) is None
    record_stop(tmp_path, 17, "SIGINT")
    assert read_stop(tmp_path) == {"step": 17, "reason": "SIGINT"}
    (tmp_path / "STOPPED.json").write_text('{"step": "17"}')
    assert read_stop(tmp_path) is None
