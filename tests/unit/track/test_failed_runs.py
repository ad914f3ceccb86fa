"""A run that failed in the workflow: its FAILED parent in MLflow (config, error, description), updated by
a second failure, replaced by the finished run's first push; the track stage marks the failed runs and
pushes the others, without the baseline of a failed ddp run (shardfuse.experiment.outcome)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from shardfuse.experiment.outcome import FAILED_RUNS_ENV, failed_runs, write_failed_runs
from shardfuse.io import UserError
from shardfuse.track.failed import record_failed_run
from tests.support.tracking import (
    TRACK_EXPERIMENT,
    active_runs,
    make_run_dir,
    run_config,
    track_into,
    tracking_env,
)

SOURCE = {"mlflow.source.type": "LOCAL", "mlflow.source.name": "Snakefile"}
ERROR = "shardfuse.launch: error: rank 1 failed: RuntimeError: boom in forward (full traceback: logs/x.log)"


def test_a_failed_run_has_one_failed_parent_with_its_config_and_error_and_a_second_failure_updates_it(
    track_store,
):
    uri, client = track_store["uri"], track_store["client"]
    first = record_failed_run(uri, TRACK_EXPERIMENT, "broken", run_config("broken"), ERROR, SOURCE)
    second = record_failed_run(uri, TRACK_EXPERIMENT, "broken", run_config("broken"), "other error", SOURCE)

    assert (first.action, second.action) == ("created", "updated")
    assert first.parent_run_id == second.parent_run_id
    parents, children = active_runs(track_store, "broken")
    assert [p.info.run_id for p in parents] == [first.parent_run_id] and children == []
    run = client.get_run(first.parent_run_id)
    assert run.info.status == "FAILED"
    assert run.data.tags["shardfuse.error"] == "other error"
    assert "other error" in run.data.tags["mlflow.note.content"]
    assert run.data.tags["shardfuse.complete"] == "false"
    assert run.data.params["train.strategy"] == "ddp" and run.data.params["merge.method"] == "average"

    # Another config (params are immutable): a new parent in place of the old one.
    third = record_failed_run(
        uri, TRACK_EXPERIMENT, "broken", run_config("broken", merge_method="ties"), ERROR, SOURCE
    )
    assert third.action == "created" and third.parent_run_id != first.parent_run_id
    parents, _ = active_runs(track_store, "broken")
    assert [p.info.run_id for p in parents] == [third.parent_run_id]


def test_the_finished_runs_first_push_replaces_its_failed_parent(track_store, tmp_path):
    uri = track_store["uri"]
    marker = record_failed_run(uri, TRACK_EXPERIMENT, "fixed", run_config("fixed"), ERROR, SOURCE)
    result, *_ = track_into(track_store, tmp_path, "fixed")

    assert result["action"] == "replaced"
    parents, children = active_runs(track_store, "fixed")
    assert [p.info.run_id for p in parents] == [result["parent_run_id"]] != [marker.parent_run_id]
    assert parents[0].info.status == "FINISHED" and "shardfuse.error" not in parents[0].data.tags
    assert len(children) == 2
    assert track_store["client"].get_run(marker.parent_run_id).info.lifecycle_stage == "deleted"


def test_the_track_stage_marks_the_failed_runs_and_pushes_the_others_without_a_failed_baseline(
    track_store, tmp_path
):
    run_dir, manifest = make_run_dir(tmp_path, "soup")
    entries = [
        {
            "run": "soup", "run_dir": str(run_dir), "manifest": str(manifest), "config": run_config("soup"),
            "out": str(run_dir / "mlflow.json"), "ddp_baseline": str(tmp_path / "ddp" / "eval.json"),
        },
        {
            "run": "ddp", "run_dir": str(tmp_path / "ddp"), "manifest": str(manifest),
            "config": run_config("ddp"), "out": str(tmp_path / "ddp" / "mlflow.json"),
        },
    ]  # fmt: skip
    failed = write_failed_runs(tmp_path / "failed-runs.json", {"ddp": ERROR})
    command = [
        sys.executable, "-m", "shardfuse.tracking", "--runs-json", json.dumps(entries),
        "--tracking-uri", track_store["uri"], "--experiment", TRACK_EXPERIMENT,
    ]  # fmt: skip
    proc = subprocess.run(
        command, capture_output=True, text=True, env={**tracking_env(), FAILED_RUNS_ENV: str(failed)}
    )

    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "FAILED parent run" in proc.stderr and ERROR in proc.stderr
    record = json.loads((run_dir / "mlflow.json").read_text())
    assert track_store["client"].get_run(record["parent_run_id"]).info.status == "FINISHED"
    assert not (tmp_path / "ddp" / "mlflow.json").exists()  # not tracked: no record
    (parent,), _ = active_runs(track_store, "ddp")
    assert parent.info.status == "FAILED" and parent.data.tags["shardfuse.error"] == ERROR


def test_a_failed_runs_file_must_map_run_names_to_error_lines(tmp_path, monkeypatch):
    monkeypatch.delenv(FAILED_RUNS_ENV, raising=False)
    assert failed_runs() == {}
    path = write_failed_runs(tmp_path / "failed.json", {"b": "e2", "a": "e1"})
    monkeypatch.setenv(FAILED_RUNS_ENV, str(path))
    assert failed_runs() == {"a": "e1", "b": "e2"}
    path.write_text('["a"]')
    with pytest.raises(UserError, match="must be a JSON object of run names to their one-line errors"):
        failed_runs()
