"""Re-runs of a finished tiny experiment: -R merge re-runs merge and what follows, never training, and a
second track duplicates nothing; changing only a run's merge method re-runs its merge and what follows.
(The fast tier runs the same experiment once, tests/workflow/test_workflow.py.)"""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml

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


def test_a_second_experiment_in_the_same_checkout_keeps_both_summaries_and_refuses_a_shared_run(workdir):
    """A second configfile (another mlflow.experiment) writes its summary and comparison figures under
    results/experiments/<experiment>/: the first one's stay byte for byte. Its trainings are shared
    (content-addressed); a run name the first experiment tracked is refused before any job."""
    first = workdir / "results" / "experiments" / "tiny"
    before = file_state(first)
    assert {"summary.csv", "plots/merge_methods.png", "plots/comparison.mlflow.json"} <= set(before)
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    config["runs"] = {"sweep_ties.d0.2": {"strategy": "localsgd", "sync_every": 0, "merge_method": "ties",
                                          "merge_density": 0.2}}  # fmt: skip
    config["mlflow"]["experiment"] = "tiny sweep/2"  # not a folder name as it is
    second_config = workdir / "second.yaml"
    second_config.write_text(yaml.safe_dump(config))
    proc = snakemake(workdir, "--configfile", str(second_config))
    assert "train" not in planned_jobs(proc.stdout + proc.stderr)  # the training of 'independent', reused
    (second,) = (workdir / "results" / "experiments").glob("tiny_sweep_2-*")
    rows = list(csv.DictReader((second / "summary.csv").open()))
    assert [row["run"] for row in rows] == ["sweep_ties.d0.2"]
    assert (second / "plots" / "merge_methods.png").stat().st_size > 10_000
    assert file_state(first) == before
    records = json.loads((workdir / "results/runs/sweep_ties.d0.2/mlflow.json").read_text())
    assert records["experiment_name"] == "tiny sweep/2"  # a dotted run name tracks
    # A run of the first experiment, asked for by the second: refused, nothing planned.
    config["runs"]["ddp"] = {"strategy": "ddp", "merge_method": "consolidate"}
    second_config.write_text(yaml.safe_dump(config))
    refused = snakemake(workdir, "--configfile", str(second_config), "--dry-run", check=False)
    assert refused.returncode != 0
    assert (
        "config error at runs[ddp]: results/runs/ddp holds run 'ddp' of experiment 'tiny' (its mlflow.json)"
    ) in refused.stdout + refused.stderr
    assert file_state(first) == before
