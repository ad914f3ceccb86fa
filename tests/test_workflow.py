"""The whole DAG with real Snakemake, real torchrun processes and a real MLflow store (tiny config)."""

from __future__ import annotations

import csv
import hashlib
import json
import re
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.helpers import REPO, snakemake_failure, subprocess_env

pytestmark = pytest.mark.integration


def tiny_config(tmp_path: Path, independent_merge: str = "uniform") -> Path:
    config = {
        "runs": {
            "ddp": {"strategy": "ddp", "merge_method": "consolidate"},
            "independent": {"strategy": "localsgd", "sync_every": 0, "merge_method": independent_merge},
            # Same training as "independent": a merge sweep must not train twice.
            "independent_ties": {"strategy": "localsgd", "sync_every": 0, "merge_method": "ties"},
        },
        "datasets": {"digits": {"source": "digits", "test_fraction": 0.2, "seed": 0}},
        "run_defaults": {
            "dataset": "digits",
            "world_size": 2,
            "hidden_sizes": [16],
            "epochs": 2,
            "batch_size": 64,
        },
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tiny"},
    }
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def snakemake(workdir: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        [
            "snakemake",
            "--snakefile",
            str(REPO / "Snakefile"),
            "--directory",
            str(workdir),
            "--configfile",
            str(workdir / "config.yaml"),
            "--cores",
            "2",
            *args,
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    if check:
        assert proc.returncode == 0, snakemake_failure(workdir, proc)
    return proc


def file_state(directory: Path) -> dict[str, tuple[int, str]]:
    """mtime_ns and sha256 of every file below ``directory``."""
    return {
        str(p.relative_to(directory)): (p.stat().st_mtime_ns, hashlib.sha256(p.read_bytes()).hexdigest())
        for p in sorted(directory.rglob("*"))
        if p.is_file()
    }


def mlflow_state(workdir: Path) -> dict:
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("tiny")
    runs = client.search_runs([experiment.experiment_id], max_results=1000)
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    histories = {
        (r.info.run_name, "loss"): [
            (m.step, m.value) for m in client.get_metric_history(r.info.run_id, "loss")
        ]
        for r in children
    }
    return {"parents": parents, "children": children, "histories": histories}


def ranks_dir(workdir: Path, run: str) -> Path:
    """The trained ranks a run was fused from (runs that differ only in merge keys share them)."""
    training = json.loads((workdir / "results" / "runs" / run / "eval.json").read_text())["training"]
    return workdir / "results" / "trainings" / training / "ranks"


def planned_jobs(dry_run_stdout: str) -> dict[str, int]:
    """The 'Job stats' table of a dry run: rule -> number of jobs."""
    table = dry_run_stdout.split("Job stats:")[1].split("\n\n")[0]
    rows = (re.fullmatch(r"(\w+)\s+(\d+)", line.strip()) for line in table.splitlines())
    return {m.group(1): int(m.group(2)) for m in rows if m and m.group(1) != "total"}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("workflow")
    tiny_config(path)
    snakemake(path)
    return path


def test_full_run_writes_summary_row_per_run(workdir):
    rows = list(csv.DictReader((workdir / "results" / "summary.csv").open()))
    assert [r["run"] for r in rows] == ["ddp", "independent", "independent_ties"]
    for row in rows:
        assert row["dataset"] == "digits" and row["world_size"] == "2"
        assert 0.5 < float(row["test_accuracy_merged"]) <= 1.0
    ddp = rows[0]
    assert float(ddp["test_accuracy_merged"]) == float(ddp["test_accuracy_best_rank"])
    assert float(rows[1]["max_abs_diff_between_ranks"]) > 0
    assert rows[1]["test_accuracy_ddp_baseline"] == ddp["test_accuracy_merged"]


def test_runs_differing_only_in_merge_method_share_one_training(workdir):
    assert ranks_dir(workdir, "independent") == ranks_dir(workdir, "independent_ties")
    assert ranks_dir(workdir, "independent") != ranks_dir(workdir, "ddp")
    logs = sorted(log.name for log in (workdir / "logs" / "train").glob("*.log"))
    trainings = sorted(log.removesuffix(".log") for log in logs if ".attempt-" not in log)
    attempts = [f"{name}.attempt-1.log" for name in trainings]
    assert logs == sorted([f"{name}.log" for name in trainings] + attempts)
    assert len(trainings) == 2
    merges = [
        json.loads((workdir / f"results/runs/{r}/merge.json").read_text())
        for r in ("independent", "independent_ties")
    ]
    assert [m["method"] for m in merges] == ["uniform", "ties"]


def test_every_rule_wrote_its_log_and_expensive_rules_a_benchmark(workdir):
    for rule in ("prepare_dataset", "partition", "train", "gather", "merge", "evaluate", "track", "summary"):
        assert list((workdir / "logs" / rule).rglob("*.log")), rule
    for rule in ("prepare_dataset", "partition", "train", "merge", "evaluate"):
        assert list((workdir / "benchmarks" / rule).rglob("*.tsv")), rule


def test_mlflow_has_one_parent_per_run_with_world_size_children(workdir):
    state = mlflow_state(workdir)
    assert sorted(r.info.run_name for r in state["parents"]) == ["ddp", "independent", "independent_ties"]
    assert sorted(r.info.run_name for r in state["children"]) == [
        f"{run}/rank-{rank}" for run in ("ddp", "independent", "independent_ties") for rank in (0, 1)
    ]
    ddp = next(r for r in state["parents"] if r.info.run_name == "ddp")
    assert ddp.data.params["strategy"] == "ddp" and ddp.data.params["merge_method"] == "consolidate"
    assert ddp.data.params["dataset_spec.source"] == "digits"
    assert "test_accuracy_merged" in ddp.data.metrics and "train_seconds" in ddp.data.metrics
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    for parent in state["parents"]:
        artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
        assert artifacts == {"comparison/merge_methods.png", "comparison/communication.png"}, (
            parent.info.run_name
        )
    train = json.loads((ranks_dir(workdir, "ddp") / "train.json").read_text())
    assert len(state["histories"][("ddp/rank-0", "loss")]) == train["num_steps"]


def test_rerun_merge_never_retrains_and_track_twice_duplicates_nothing(workdir):
    train_before = file_state(ranks_dir(workdir, "ddp"))
    merge_before = (workdir / "results/runs/ddp/merge.json").stat().st_mtime_ns
    # One run's chain (merge, evaluate, plots, track): enough to show what -R merge re-runs and what not.
    target = "results/runs/ddp/mlflow.json"
    snakemake(workdir, target, "-R", "merge")
    assert file_state(ranks_dir(workdir, "ddp")) == train_before
    assert (workdir / "results/runs/ddp/merge.json").stat().st_mtime_ns > merge_before
    # The re-merge replaced each parent once; tracking the same results again must change nothing.
    mlflow_before = mlflow_state(workdir)
    assert len(mlflow_before["parents"]) == 3 and len(mlflow_before["children"]) == 6
    snakemake(workdir, target, "-R", "track")
    mlflow_after = mlflow_state(workdir)
    assert len(mlflow_after["parents"]) == 3 and len(mlflow_after["children"]) == 6
    assert mlflow_after["histories"] == mlflow_before["histories"]
    assert {r.info.run_id for r in mlflow_after["parents"]} == {
        r.info.run_id for r in mlflow_before["parents"]
    }


def test_changing_only_merge_method_reruns_merge_and_downstream_only(workdir):
    tiny_config(workdir, independent_merge="weighted")
    dry = snakemake(workdir, "--dry-run")
    assert planned_jobs(dry.stdout) == {
        "merge": 1,
        "evaluate": 1,
        "plots": 1,
        "track": 1,
        "summary": 1,
        "compare_merge_methods": 1,
        "compare_communication": 1,
        "track_comparison": 1,
        "all": 1,
    }
    train_before = file_state(ranks_dir(workdir, "independent"))
    snakemake(workdir)
    assert file_state(ranks_dir(workdir, "independent")) == train_before
    assert json.loads((workdir / "results/runs/independent/merge.json").read_text())["method"] == "weighted"
    state = mlflow_state(workdir)
    independent = [r for r in state["parents"] if r.info.run_name == "independent"]
    assert len(independent) == 1 and independent[0].data.params["merge_method"] == "weighted"


def test_until_partition_stops_before_training(tmp_path):
    tiny_config(tmp_path)
    snakemake(tmp_path, "--until", "partition")
    manifest = json.loads((tmp_path / "results/shards/digits/w2-seed0/manifest.json").read_text())
    assert manifest["world_size"] == 2
    assert not (tmp_path / "results" / "runs").exists()


def test_invalid_config_fails_before_any_job_with_one_clear_line(tmp_path):
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["runs"]["ddp"]["world_size"] = 0
    path.write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert "config error at runs[ddp].world_size: 0 is less than the minimum of 1" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_several_nodes_with_the_local_executor_fail_before_any_job(tmp_path):
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["runs"]["ddp"].update(nodes=2, nproc_per_node=1)
    path.write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert (
        "run(s) ddp ask for several nodes, which needs a SLURM allocation; run with --profile "
        "profiles/slurm or set nodes to 1" in proc.stderr
    )
    assert not (tmp_path / "results").exists()
