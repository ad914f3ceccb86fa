"""Two track stages racing into one fresh SQLite store (its parent directory missing): both create,
migrate and write it, neither fails. A race of two whole processes, each importing MLflow; the other
track CLI tests: tests/stages/test_track_cli.py."""

from __future__ import annotations

import subprocess

from mlflow.tracking import MlflowClient

from tests.support.tracking import TRACK_EXPERIMENT, make_run_dir, track_cli_args, tracking_env


def test_two_concurrent_cli_tracks_into_one_fresh_sqlite_db_both_succeed(tmp_path):
    uri = f"sqlite:///{tmp_path}/db/mlflow.db"  # parent dir missing: the stage creates it
    procs = []
    for run_name in ("left", "right"):
        run_dir, manifest = make_run_dir(tmp_path, run_name)
        args = track_cli_args(run_name, run_dir, manifest, uri, run_dir / "mlflow.json")
        procs.append(
            subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                             env=tracking_env(), cwd=tmp_path)
        )  # fmt: skip
    for proc in procs:
        _, stderr = proc.communicate(timeout=240)
        assert proc.returncode == 0, stderr
    client = MlflowClient(tracking_uri=uri)
    experiment = client.get_experiment_by_name(TRACK_EXPERIMENT)
    parents = client.search_runs([experiment.experiment_id], "tags.`shardfuse.complete` = 'true'")
    assert sorted(p.info.run_name for p in parents) == ["left", "right"]
    assert all(p.data.tags["shardfuse.complete"] == "true" for p in parents)
