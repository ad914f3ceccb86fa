"""The launch stage's command line: every attempt logged, the earlier ones named (a failed rank's
exception in one line: tests/slow/test_stage_edges.py and, through the workflow, tests/workflow/
test_ownership.py)."""

from __future__ import annotations

from tests.support.helpers import run_stage


def test_launch_logs_every_attempt_and_names_the_earlier_ones(tmp_path):
    log = tmp_path / "train.log"
    for number in (1, 2):
        log.unlink(missing_ok=True)
        proc = run_stage("launch", "--nproc-per-node", "1", "--max-restarts", "-1", "--log", log)
        # By hand the console still shows the one line, and where the whole output is.
        assert proc.returncode == 2 and proc.stderr == (
            "shardfuse.launch: error: --max-restarts -1 must be >= 0 (the whole output: "
            f"{tmp_path / f'train.attempt-{number}.log'})\n"
        )
    first = (tmp_path / "train.attempt-1.log").read_text()
    assert "--max-restarts -1 must be >= 0" in first and "attempt" not in first
    second = log.read_text()
    assert "attempt 2; earlier attempts' logs: train.attempt-1.log" in second
    assert second == (tmp_path / "train.attempt-2.log").read_text()
