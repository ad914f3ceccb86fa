"""The track stage's command line as the workflow runs it: one-line errors, an unreachable server, a shared
training, two tracks at once into one fresh SQLite track_store, no torch import, the parent's tags (a
store another program holds locked: tests/slow/test_stage_edges.py)."""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time

import pytest

from shardfuse import tracking
from shardfuse.console.errors import run_cli
from shardfuse.track import provenance as track_provenance
from shardfuse.track import sync as track_sync
from tests.support.tracking import (
    TRACK_EXPERIMENT,
    active_runs,
    git,
    make_run_dir,
    metric_history,
    run_config,
    track_cli_args,
    track_into,
    tracking_env,
)


def test_cli_exits_2_with_one_line_when_a_rank_metrics_file_is_missing(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "nometrics")
    (run_dir / "train" / "metrics" / "rank-1.parquet").unlink()
    uri = f"sqlite:///{tmp_path}/untouched.db"
    args = track_cli_args("nometrics", run_dir, manifest, uri, run_dir / "mlflow.json")
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), cwd=tmp_path)
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1
    assert "rank-1.parquet does not exist; re-run the train stage" in proc.stderr
    assert not (run_dir / "mlflow.json").exists()
    assert not (tmp_path / "untouched.db").exists()  # inputs are checked before MLflow is touched


def test_cli_reports_unreachable_tracking_server_in_one_line_quickly(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "offline")
    args = track_cli_args("offline", run_dir, manifest, "http://127.0.0.1:1", run_dir / "mlflow.json")
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), timeout=120)
    assert time.monotonic() - started < 30  # one probe, not MLflow's retries
    assert proc.returncode == 2
    line = proc.stderr.strip().splitlines()[-1]
    assert line.startswith("shardfuse.tracking: error: cannot use tracking URI http://127.0.0.1:1 (")
    assert "connection refused: no server listens on port 1" in line and "start the server" in line
    assert "Traceback" not in proc.stderr


def test_a_refused_database_store_is_one_line_in_seconds_naming_the_server(tmp_path):
    """MLflow retries a database it cannot open 10 times with a growing back-off (104 s for a refused
    port, with advice about sqlite files); one probe connection answers at once."""
    run_dir, manifest = make_run_dir(tmp_path, "nodb")
    uri = "postgresql://shardfuse@127.0.0.1:1/mlflow"
    args = track_cli_args("nodb", run_dir, manifest, uri, run_dir / "mlflow.json")
    started = time.monotonic()
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), timeout=120)
    assert time.monotonic() - started < 30
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert line.startswith("shardfuse.tracking: error: cannot use tracking URI postgresql://***@127.0.0.1:1")
    assert "port 1 failed: Connection refused" in line and "start the database server" in line
    assert "sqlite" not in line and not (run_dir / "mlflow.json").exists()


def test_a_runs_file_edited_since_the_workflow_wrote_it_is_refused(tmp_path):
    """The workflow names the track job's runs file by its content; a file edited by hand (another merge
    method, another run folder) was pushed to MLflow as the run's record."""
    from shardfuse.io import content_name

    run_dir, manifest = make_run_dir(tmp_path, "edited")
    entry = {"run": "edited", "run_dir": str(run_dir), "manifest": str(manifest),
             "config": run_config("edited"), "out": str(run_dir / "mlflow.json")}  # fmt: skip
    runs_file = tmp_path / content_name([entry])
    runs_file.write_text(json.dumps([{**entry, "config": {**entry["config"], "merge_method": "ties"}}]))
    args = [sys.executable, "-m", "shardfuse.tracking", "--runs-json", f"@{runs_file}",
            "--tracking-uri", f"sqlite:///{tmp_path}/mlflow.db", "--experiment", "e"]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), timeout=120)
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert f"--runs-json file {runs_file} is not what the workflow wrote" in line
    assert "is not what the workflow wrote (its name is the digest of its content" in line
    assert "delete it and re-run" in line
    assert not (run_dir / "mlflow.json").exists() and not (tmp_path / "mlflow.db").exists()


def test_a_merged_model_copied_over_after_evaluate_is_refused_before_anything_is_pushed(tmp_path):
    """evaluate checks the merged model against its merge.json; one copied over it afterwards was logged
    to MLflow as the run's model. The track stage checks it too, before it touches the store."""
    run_dir, manifest = make_run_dir(tmp_path, "r")
    other, _ = make_run_dir(tmp_path, "t")
    (run_dir / "merged.safetensors").write_bytes((other / "merged.safetensors").read_bytes())
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    proc = subprocess.run(
        track_cli_args("r", run_dir, manifest, uri, run_dir / "mlflow.json"),
        capture_output=True, text=True, env=tracking_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2
    (line,) = proc.stderr.strip().splitlines()
    assert (
        f"{run_dir / 'merged.safetensors'} is not the merged model its {run_dir / 'merge.json'} recorded"
        in line
    )
    assert not (tmp_path / "mlflow.db").exists() and not (run_dir / "mlflow.json").exists()


def test_cli_with_a_shared_training_dir_writes_out_file_with_run_ids(track_store, tmp_path):
    # Runs that differ only in how they merge share one training: ranks and gather.json live there.
    run_dir, manifest = make_run_dir(tmp_path, "viacli", training="shared")
    training = tmp_path / "results" / "trainings" / "shared"
    out = run_dir / "mlflow.json"
    args = track_cli_args("viacli", run_dir, manifest, track_store["uri"], out)
    args += ["--train-dir", str(training / "ranks"), "--gather", str(training / "gather.json")]
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    written = json.loads(out.read_text())
    assert set(written) == {
        "tracking_uri", "experiment_name", "experiment_id", "parent_run_id", "child_run_ids", "fingerprint",
        "action", "model_uri", "registered_model", "num_points_pushed",
    }  # fmt: skip
    assert written["action"] == "created"
    assert written["tracking_uri"] == track_store["uri"]
    (parent,), _ = active_runs(track_store, "viacli")
    assert written["parent_run_id"] == parent.info.run_id
    assert set(written["child_run_ids"]) == {"0", "1"}
    assert proc.stderr.strip().endswith("s)") and "created parent run" in proc.stderr

    other_dir, _ = make_run_dir(tmp_path, "viacli_ties", training="shared")
    other = track_sync.track_run(
        "viacli_ties", other_dir, manifest, run_config("viacli_ties"), track_store["uri"], TRACK_EXPERIMENT,
        train_dir=training / "ranks", gather_path=training / "gather.json",
    )  # fmt: skip
    assert other["parent_run_id"] != written["parent_run_id"]
    for rank in ("0", "1"):
        histories = [
            metric_history(track_store, ids[rank], "loss")
            for ids in (written["child_run_ids"], other["child_run_ids"])
        ]
        assert histories[0] == histories[1] and len(histories[0]) == 7


def test_cli_track_never_imports_torch_and_reads_the_model_spec_from_the_header(track_store, tmp_path):
    # The track job runs once per run on the submit host: torch alone took longer than the whole push.
    run_dir, manifest = make_run_dir(tmp_path, "torchless")
    out = run_dir / "mlflow.json"
    args = track_cli_args("torchless", run_dir, manifest, track_store["uri"], out)
    args[1:1] = ["-X", "importtime"]
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported = {
        line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")
    }
    assert "mlflow" in imported
    assert not [name for name in imported if name == "torch" or name.startswith("torch.")]
    written = json.loads(out.read_text())
    assert written["action"] == "created" and written["model_uri"]


def test_parent_tags_name_commit_tools_hosts_slurm_job_and_config_hash(track_store, tmp_path):
    result, _, _, config = track_into(track_store, tmp_path, "provenance", ddp_baseline=True)
    parent = track_store["client"].get_run(result["parent_run_id"])
    tags = parent.data.tags
    assert tags["shardfuse.git_commit"] == tags["mlflow.source.git.commit"] == git("rev-parse", "HEAD")
    assert tags["shardfuse.git_dirty"] in ("true", "false")
    assert tags["shardfuse.snakemake_version"] == importlib.metadata.version("snakemake")
    assert tags["shardfuse.torch_version"] == "2.13.0"  # from train.json, i.e. what the ranks ran
    assert tags["shardfuse.hosts"] == "node0,node1"
    assert tags["shardfuse.slurm_job_id"] == "4242"
    assert tags["shardfuse.config_hash"] == track_provenance.config_hash(config)
    for rank, child_id in result["child_run_ids"].items():
        assert track_store["client"].get_run(child_id).data.tags["shardfuse.host"] == f"node{rank}"
    assert parent.data.metrics["test_accuracy_initial"] == pytest.approx(0.34)
    assert parent.data.metrics["test_accuracy_ddp_baseline"] == pytest.approx(0.83)


def test_the_workflows_one_track_job_pushes_every_run_and_names_each_that_fails(track_store, tmp_path):
    # The workflow's track job: every run in one process; a broken run is its own error line, the
    # others are still pushed and recorded, and the job fails (Snakemake keeps none of its outputs).
    entries, outs = [], {}
    for name in ("batch_a", "batch_broken", "batch_b"):
        run_dir, manifest = make_run_dir(tmp_path, name)
        outs[name] = run_dir / "mlflow.json"
        entry = {"run": name, "run_dir": str(run_dir), "manifest": str(manifest), "config": run_config(name)}
        entries.append({**entry, "out": str(outs[name])})
    broken = tmp_path / "results/runs/batch_broken/train/metrics/rank-0.parquet"
    kept = broken.read_bytes()
    broken.unlink()
    args = [
        sys.executable, "-m", "shardfuse.tracking", "--runs-json", json.dumps(entries),
        "--tracking-uri", track_store["uri"], "--experiment", TRACK_EXPERIMENT,
    ]  # fmt: skip
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert [line.split(" parent run")[0] for line in lines if "parent run" in line] == [
        "shardfuse.tracking: created",
        "shardfuse.tracking: created",
    ]
    assert any(
        line.startswith("shardfuse.tracking: error: run batch_broken: ") and "rank-0.parquet" in line
        for line in lines
    )
    assert lines[-1].startswith("shardfuse.tracking: error: 1 of 3 runs were not tracked (batch_broken;")
    for name, tracked in (("batch_a", True), ("batch_broken", False), ("batch_b", True)):
        assert outs[name].exists() == tracked, name
        parents, _ = active_runs(track_store, name)
        assert len(parents) == int(tracked), name

    # Tracked again once fixed: the two pushed runs are unchanged, only the fixed one is created.
    broken.write_bytes(kept)
    proc = subprocess.run(args, capture_output=True, text=True, env=tracking_env(), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    actions = [json.loads(out.read_text())["action"] for out in outs.values()]
    assert actions == ["unchanged", "created", "unchanged"]


@pytest.mark.parametrize(
    ("runs_json", "fragment"),
    [
        ("{}", "--runs-json must be a non-empty JSON list of runs"),
        ("[1]", "--runs-json entry 0 is not a JSON object"),
        ('[{"run": "a"}]', "--runs-json entry 0 lacks run_dir, manifest, config, out"),
        ("@no-such-runs.json", "--runs-json file no-such-runs.json does not exist"),
        ('[{"run": "a", "run_dir": "d", "manifest": "m", "config": {}, "out": "o"}]', "entry 0 lacks config"),
        (
            '[{"run": "a", "run_dir": "d", "manifest": "m", "config": {"run": "a"}, "out": "o", "plot": 1}]',
            "unknown keys plot",
        ),
    ],
)
def test_a_malformed_runs_json_is_one_line_before_mlflow_is_touched(tmp_path, capsys, runs_json, fragment):
    uri = f"sqlite:///{tmp_path}/untouched.db"
    with pytest.raises(SystemExit) as exited:
        run_cli(tracking.main, ["--runs-json", runs_json, "--tracking-uri", uri])
    assert exited.value.code == 2
    assert fragment in capsys.readouterr().err
    assert not (tmp_path / "untouched.db").exists()
