"""Which checkpoint a resume takes: the newest complete one every rank can read, the newer ones passed
over by name (a file truncated by a full disk), or one error line when none can be read."""

from __future__ import annotations

import json

import pytest
import torch

from shardfuse.checkpoints.weights import write_safetensors
from shardfuse.rank.resume import checkpoint_problem, none_readable, passed_over, resume_step


def write_checkpoint(checkpoint_dir, step: int, rank: int):
    step_dir = checkpoint_dir / f"step-{step}"
    step_dir.mkdir(parents=True, exist_ok=True)
    write_safetensors({"model.w": torch.zeros(64)}, step_dir / f"rank-{rank}.safetensors")
    record = {"step": step, "epoch": 0, "next_batch": step, "param_groups": []}
    (step_dir / f"rank-{rank}.json").write_text(json.dumps(record))
    return step_dir


def test_a_readable_checkpoint_has_no_problem(tmp_path):
    write_checkpoint(tmp_path, 4, 0)
    assert checkpoint_problem(tmp_path, 4, 0) is None


@pytest.mark.parametrize(
    "damage, fragment",
    [
        (
            lambda d: (d / "rank-0.safetensors").write_bytes((d / "rank-0.safetensors").read_bytes()[:100]),
            "safetensors (",
        ),
        (lambda d: (d / "rank-0.json").write_text('{"step": 4,'), "rank-0.json ("),
        (lambda d: (d / "rank-0.json").write_text('{"step": 8}'), "not a checkpoint record of step 4"),
        (lambda d: (d / "rank-0.json").write_bytes(b"\xff\xfe"), "rank-0.json ("),
    ],
)
def test_a_truncated_or_malformed_checkpoint_is_a_problem_naming_its_file(tmp_path, damage, fragment):
    damage(write_checkpoint(tmp_path, 4, 0))
    problem = checkpoint_problem(tmp_path, 4, 0)
    assert problem is not None and str(tmp_path / "step-4") in problem and fragment in problem


def test_resume_takes_the_newest_checkpoint_every_rank_can_read():
    assert resume_step([4, 8], [{}, {}]) == (8, [])
    assert resume_step([4, 8], [{}, {8: "bad file"}]) == (4, [(8, "bad file")])
    assert resume_step([4, 8, 12], [{12: "a"}, {8: "b"}]) == (4, [(12, "a"), (8, "b")])
    assert resume_step([4, 8], [{4: "a", 8: "b"}, {}]) == (None, [(8, "b"), (4, "a")])


def test_the_warning_and_the_error_name_the_file_and_the_step():
    assert passed_over(8, "x/rank-1.safetensors (incomplete)", 4) == (
        "shardfuse.train: warning: checkpoint step 8 cannot be read: x/rank-1.safetensors (incomplete); "
        "resuming from step 4 instead"
    )
    line = none_readable("ck", [(8, "x/rank-1.safetensors (incomplete)"), (4, "y")])
    assert (
        "no checkpoint in ck can be read: the newest, step 8, has x/rank-1.safetensors (incomplete)" in line
    )
    assert line.endswith("delete ck to start afresh") and "\n" not in line
