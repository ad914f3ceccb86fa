"""The track stage against a real ``mlflow server`` backed by a real PostgreSQL (scripts/*-up.sh).

Both run on free loopback ports in a private state dir for this session. In CI a missing database or
server fails these tests; elsewhere (no root, no PostgreSQL) they are skipped with the reason.
"""

from __future__ import annotations

import json
import secrets
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pandas as pd
import pytest
from mlflow.tracking import MlflowClient

from shardfuse import plots
from shardfuse.io import UserError
from shardfuse.track import series as track_series
from shardfuse.track import sync as track_sync
from shardfuse.track.push import ROWS_PER_BATCH
from tests.support.tracking import NUM_FEATURES, make_run_dir, mlflow_service, run_config, run_script

pytestmark = pytest.mark.server
EXPERIMENT = "shardfuse-server"
# What must never leak: the database password and the tracking credentials from MLflow's variables.
PG_PASSWORD = f"pg-{secrets.token_hex(12)}"
TRACKING_PASSWORD = f"ml-{secrets.token_hex(12)}"


@pytest.fixture(scope="module")
def server():
    with mlflow_service(postgres=True, SHARDFUSE_PG_PASSWORD=PG_PASSWORD) as service:
        service["client"] = MlflowClient(tracking_uri=service["uri"])
        service["outputs"] = []  # every stdout/stderr of the track CLI, scanned for secrets at the end
        yield service


def _track_cli(
    server, run_dir: Path, manifest: Path, run_name: str, *extra: str
) -> subprocess.CompletedProcess:
    env = {
        **server["env"],
        "MLFLOW_TRACKING_USERNAME": "shardfuse",
        "MLFLOW_TRACKING_PASSWORD": TRACKING_PASSWORD,
    }
    args = [
        sys.executable, "-m", "shardfuse.tracking", "--run", run_name, "--run-dir", str(run_dir),
        "--manifest", str(manifest), "--config-json", json.dumps(run_config(run_name)),
        "--tracking-uri", server["uri"], "--experiment", EXPERIMENT, "--out", str(run_dir / "mlflow.json"),
        *extra,
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=env, timeout=300)
    server["outputs"].append(proc.stdout + proc.stderr)
    return proc


def _parents(server, run_name):
    experiment = server["client"].get_experiment_by_name(EXPERIMENT)
    runs = server["client"].search_runs([experiment.experiment_id], f"tags.`shardfuse.run` = '{run_name}'")
    return [r for r in runs if "mlflow.parentRunId" not in r.data.tags], experiment


def _assert_complete(server, result: dict, num_steps: int) -> None:
    client = server["client"]
    parent = client.get_run(result["parent_run_id"])
    assert parent.data.tags["shardfuse.complete"] == "true" and parent.info.status == "FINISHED"
    for child_id in result["child_run_ids"].values():
        for key in track_series.STEP_METRICS:
            steps = sorted(m.step for m in client.get_metric_history(child_id, key))
            assert steps == list(range(num_steps))  # every point, none twice


def test_track_pushes_runs_artifacts_and_a_loadable_registered_model_through_the_server(server, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "served", num_steps=1200)
    proc = _track_cli(server, run_dir, manifest, "served", "--registered-model", "shardfuse-served")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((run_dir / "mlflow.json").read_text())
    assert result["action"] == "created" and result["registered_model"] == "shardfuse-served/1"
    _assert_complete(server, result, 1200)
    (parent,), experiment = _parents(server, "served")
    assert experiment.artifact_location.startswith("mlflow-artifacts:")  # uploaded through the server
    listed = {f.path for f in server["client"].list_artifacts(parent.info.run_id, "results")}
    assert "results/eval.json" in listed
    assert list((server["state"] / "mlflow" / "artifacts").rglob("eval.json"))  # on the server's disk

    mlflow.set_tracking_uri(server["uri"])
    try:
        model = mlflow.pyfunc.load_model("models:/shardfuse-served/1")
    finally:
        mlflow.set_tracking_uri(None)
    frame = pd.DataFrame([[0.5] * NUM_FEATURES], columns=[f"x{i}" for i in range(NUM_FEATURES)])
    assert list(model.predict(frame).columns[:2]) == ["prediction", "probability_0"]

    again = _track_cli(server, run_dir, manifest, "served", "--registered-model", "shardfuse-served")
    assert again.returncode == 0, again.stderr
    assert json.loads((run_dir / "mlflow.json").read_text())["action"] == "unchanged"


def test_server_down_fails_fast_with_rerun_hint_and_rerun_after_restart_loses_and_doubles_nothing(
    server, tmp_path, monkeypatch
):
    num_steps = 1000  # 4 batches per rank
    run_dir, manifest = make_run_dir(tmp_path, "outage", num_steps=num_steps)
    assert run_script("mlflow-server-down.sh", server["env"]).returncode == 0
    try:
        started = time.monotonic()
        proc = _track_cli(server, run_dir, manifest, "outage")
        assert time.monotonic() - started < 60
        assert proc.returncode == 2
        (line,) = proc.stderr.strip().splitlines()
        assert line.startswith(f"shardfuse.tracking: error: cannot use tracking URI {server['uri']} (")
        hint = "; start the server or fix mlflow.tracking_uri, then re-run `snakemake -R track`: the local "
        assert hint in line
        assert "re-run `snakemake -R track`" in line
        assert not (run_dir / "mlflow.json").exists()
    finally:
        assert run_script("mlflow-server-up.sh", server["env"]).returncode == 0

    # Now the server dies in the middle of the push, after rank 0's first batch went in.
    original = track_sync.sync_history
    stopped = []

    def server_dies_after_one_batch(client, run_id, rows, start):
        if stopped:
            return original(client, run_id, rows, start)
        original(client, run_id, rows[: start + ROWS_PER_BATCH], start)
        stopped.append(run_script("mlflow-server-down.sh", server["env"]).returncode)
        return original(client, run_id, rows, start + ROWS_PER_BATCH)

    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    monkeypatch.setattr(track_sync, "sync_history", server_dies_after_one_batch)
    try:
        with pytest.raises(UserError, match=r"re-run `snakemake -R track`"):
            track_sync.track_run("outage", run_dir, manifest, run_config("outage"), server["uri"], EXPERIMENT)
        assert stopped == [0]
    finally:
        monkeypatch.undo()
        assert run_script("mlflow-server-up.sh", server["env"]).returncode == 0

    (partial,), _ = _parents(server, "outage")
    assert partial.data.tags["shardfuse.complete"] == "false"
    proc = _track_cli(server, run_dir, manifest, "outage")
    assert proc.returncode == 0, proc.stderr
    result = json.loads((run_dir / "mlflow.json").read_text())
    assert (result["action"], result["parent_run_id"]) == ("updated", partial.info.run_id)
    # The rest of the histories, each rank's two test metrics, the parent's headline metrics (pushed
    # after the ranks: the interrupted push had none).
    (parent,), _ = _parents(server, "outage")
    expected = 3 * (2 * num_steps - ROWS_PER_BATCH) + 2 * 2 + len(parent.data.metrics)
    assert result["num_points_pushed"] == expected
    _assert_complete(server, result, num_steps)
    assert _track_cli(server, run_dir, manifest, "outage").returncode == 0
    assert json.loads((run_dir / "mlflow.json").read_text())["action"] == "unchanged"


def _pg_dump(server) -> str:
    env = server["env"]
    pg_bin = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_dump"))[-1]
    dump = subprocess.run(
        [str(pg_bin), "-h", "127.0.0.1", "-p", env["SHARDFUSE_PG_PORT"], "-U", "mlflow", "-d", "mlflow"],
        capture_output=True, text=True, timeout=120, check=True,
        env={**env, "PGPASSFILE": str(Path(env["SHARDFUSE_PG_DIR"]) / "pgpass")},
    )  # fmt: skip
    return dump.stdout


def test_passwords_never_reach_params_tags_metrics_artifacts_or_logs(server, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "audited")
    plots.plot_run(run_dir, run_dir / "plots", run_dir / "train")
    proc = _track_cli(server, run_dir, manifest, "audited", "--plots-dir", str(run_dir / "plots"))
    assert proc.returncode == 0, proc.stderr
    dump = _pg_dump(server)
    assert "audited" in dump and "shardfuse.config_hash" in dump  # the dump does hold runs, params, tags
    places = {"database dump": dump, "track output": "\n".join(server["outputs"])}
    places["mlflow.json"] = (run_dir / "mlflow.json").read_text()
    for log in (
        *Path(server["env"]["SHARDFUSE_PG_DIR"]).glob("log/*"),
        server["state"] / "mlflow/log/server.log",
    ):
        places[str(log)] = log.read_text(errors="replace")
    artifacts = [p for p in (server["state"] / "mlflow" / "artifacts").rglob("*") if p.is_file()]
    assert {"loss.png", "eval.json", "merged.safetensors"} <= {p.name for p in artifacts}
    for path in artifacts:
        places[str(path)] = path.read_bytes().decode("latin-1")
    for secret in (PG_PASSWORD, TRACKING_PASSWORD):
        leaks = [where for where, text in places.items() if secret in text]
        assert leaks == [], f"password found in {leaks}"
