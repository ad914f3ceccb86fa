"""Re-runs of a finished tiny experiment: -R merge re-runs merge and what follows, never training, and a
second track duplicates nothing; changing only a run's merge method re-runs its merge and what follows.
(The fast tier runs the same experiment once, tests/workflow/test_workflow.py.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.support.helpers import (
    file_state,
    mlflow_state,
    planned_jobs,
    ranks_dir,
    snakemake,
    tiny_config,
    tiny_experiment_run,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tiny_experiment_run(tmp_path_factory.mktemp("workflow"))


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
