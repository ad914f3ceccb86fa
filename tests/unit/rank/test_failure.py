"""The first failing rank's record and the launcher's one line from it (real torchrun: tests/slow/
test_stage_edges.py, tests/workflow/test_ownership.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from shardfuse.io import UserError
from shardfuse.rank.failure import (
    MAX_MESSAGE_CHARS,
    failure_message,
    failures_recorded,
    rank_failure,
    read_failure,
    record_failure,
)

LOG = Path("logs/train/t.log")


def raise_in(staging: Path, rank: int, exc: Exception) -> None:
    with pytest.raises(type(exc)), failures_recorded(staging, rank):
        raise exc


def complete_checkpoint(staging: Path, step: int, complete: bool = True) -> None:
    step_dir = staging / "checkpoints" / f"step-{step}"
    step_dir.mkdir(parents=True)
    if complete:
        (step_dir / "COMPLETE").write_text(f"{step}\n")


def test_only_the_first_rank_to_fail_is_recorded(tmp_path):
    raise_in(tmp_path, 1, RuntimeError("boom in forward\nmore detail"))
    raise_in(tmp_path, 0, RuntimeError("Connection closed by peer"))  # the consequence, later
    failure = read_failure(tmp_path, attempt=0)
    assert (failure.rank, failure.describe()) == (1, "RuntimeError: boom in forward")
    assert not failure.user_error


def test_the_launchers_line_names_the_rank_the_exception_and_the_log_and_a_rerun_starts_over(tmp_path):
    raise_in(tmp_path, 1, RuntimeError("boom in forward"))
    complete_checkpoint(tmp_path, 2, complete=False)  # rank 0 never marked it: it does not count
    assert failure_message(1, tmp_path, 0, LOG) == (
        "rank 1 failed: RuntimeError: boom in forward (full traceback: logs/train/t.log); "
        "no checkpoint was complete, so a re-run starts over"
    )
    assert "(full traceback above)" in failure_message(1, tmp_path, 0, None)


def test_a_rerun_resumes_from_the_newest_complete_checkpoint(tmp_path):
    raise_in(tmp_path, 0, ValueError("bad value"))
    for step, complete in ((2, True), (4, True), (6, False)):
        complete_checkpoint(tmp_path, step, complete)
    assert failure_message(1, tmp_path, 0, LOG) == (
        "rank 0 failed: ValueError: bad value (full traceback: logs/train/t.log); a re-run with unchanged "
        f"config and code resumes from the checkpoint of step 4 in {tmp_path / 'checkpoints'}"
    )


def test_a_user_error_or_no_record_keeps_the_general_line(tmp_path):
    """A rank's UserError printed its own line (the console shows it); a rank killed by a signal
    records nothing."""
    assert failure_message(1, tmp_path, 0, LOG) == (
        "training failed: exit status 1; the failing rank's error is above in this log; "
        "no checkpoint was complete, so a re-run starts over"
    )
    raise_in(tmp_path, 1, UserError("warmup_steps 500 is longer than the run's 20 optimiser steps"))
    assert read_failure(tmp_path, 0).user_error
    assert failure_message(1, tmp_path, 0, LOG).startswith("training failed: exit status 1; ")


def test_the_last_attempts_failure_is_reported(tmp_path, monkeypatch):
    raise_in(tmp_path, 1, RuntimeError("first attempt"))
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", "1")
    raise_in(tmp_path, 0, RuntimeError("after the restart"))
    assert "rank 0 failed: RuntimeError: after the restart" in failure_message(1, tmp_path, 1, LOG)


def test_the_exception_is_named_with_its_module_and_its_message_shortened():
    class BrokenKernel(Exception):
        pass

    failure = rank_failure(3, BrokenKernel("x" * 1000), attempt=0)
    assert failure.exception.startswith(f"{__name__}.") and failure.exception.endswith(".BrokenKernel")
    assert len(failure.message) == MAX_MESSAGE_CHARS and failure.message.endswith("…")
    assert rank_failure(0, KeyError(), attempt=0).describe() == "KeyError"


def test_recording_never_raises_over_the_ranks_own_error(tmp_path):
    blocker = tmp_path / "staging"
    blocker.write_text("a file where the staging directory should be")
    assert not record_failure(blocker, rank_failure(0, RuntimeError("boom"), attempt=0))
    raise_in(blocker, 0, RuntimeError("boom"))  # the RuntimeError propagates, not an OSError


def test_a_peers_lost_connection_never_hides_the_rank_that_really_failed(tmp_path):
    raise_in(tmp_path, 0, RuntimeError("[gloo] Connection reset by peer"))  # first, but only an effect
    raise_in(tmp_path, 1, ValueError("bad batch"))  # the cause, recorded although it came later
    assert read_failure(tmp_path, attempt=0).describe() == "ValueError: bad batch"


def test_a_rank_killed_by_a_signal_is_named_not_the_peer_that_saw_the_connection_reset(tmp_path):
    """kill -9 of rank 1: it raises nothing; rank 0's gloo call fails with "Connection reset by peer"
    (recorded, as a peer's loss); the agent's line in the log names rank 1."""
    log = tmp_path / "t.log"
    log.write_text(
        "step 10/40 ...\n"
        "shardfuse.agent: rank 1 (pid 4242) was killed by signal 9 (SIGKILL; the kernel's out-of-memory "
        "killer sends it too)\n"
        "[rank0]: RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer\n"
    )
    raise_in(tmp_path, 0, RuntimeError("[../gloo/transport/tcp/pair.cc:534] Connection reset by peer"))
    line = failure_message(1, tmp_path, 0, log)
    assert line.startswith(
        "rank 1 was killed by signal 9 (SIGKILL; the kernel's out-of-memory killer sends it too); rank 0 "
        "then lost its connection to it (RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection "
        "reset by peer)"
    ), line
    assert line.endswith("no checkpoint was complete, so a re-run starts over")
    assert not line.startswith("rank 0")


def test_a_killed_rank_without_any_record_is_named_from_the_agents_line(tmp_path):
    log = tmp_path / "t.log"
    log.write_text("shardfuse.agent: rank 3 (pid 7) was killed by signal 15 (SIGTERM)\n")
    assert failure_message(1, tmp_path, 0, log).startswith(
        "rank 3 was killed by signal 15 (SIGTERM) (full log: "
    )
