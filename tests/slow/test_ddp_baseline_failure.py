"""A ddp run that fails (DDP refuses a parameter no forward uses) with a sibling trained per shard, under
the default profile (it keeps going): the rank's exception is one line on the console, the sibling is
still merged and evaluated, one warning says it went without its baseline, and the report does not wait
for the failed run: summary.csv has the sibling's scores and the failed run's row with its error, MLflow
the sibling's finished parent and the failed run's FAILED parent with the same line, the comparison
figures the sibling. With find_unused_parameters the ddp run trains, only it is evaluated again, its
metrics reach the sibling's summary row as the baseline, and its finished parent replaces the FAILED one."""

from __future__ import annotations

import csv
import json

import yaml
from mlflow import MlflowClient

from tests.support.helpers import REPO, planned_jobs, snakemake

RUN_DEFAULTS = {
    "dataset": "tiny",
    "world_size": 2,
    "model": "tied_lm:build",
    "code_paths": [str(REPO / "tests/support/models")],
    "model_args": {"unused": True},
    "optimizer": "adamw",
    "lr": 0.01,
    "epochs": 1,
    "batch_size": 16,
    "checkpoint_every": 0,
}


def write_config(workdir, **ddp_keys) -> None:
    config = {
        "datasets": {
            "tiny": {"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 16, "max_tokens": 6000}
        },
        "runs": {
            "lm_ddp": {"strategy": "ddp", "merge_method": "consolidate", **ddp_keys},
            "lm_soup": {"strategy": "localsgd", "sync_every": 0, "merge_method": "uniform"},
        },
        "run_defaults": RUN_DEFAULTS,
        "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db", "experiment": "baseline"},
    }
    (workdir / "config.yaml").write_text(yaml.safe_dump(config))


def read_summary(workdir) -> dict[str, dict[str, str]]:
    with open(workdir / "results/experiments/baseline/summary.csv", newline="") as fh:
        return {row["run"]: row for row in csv.DictReader(fh)}


def parents(workdir) -> dict[str, object]:
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("baseline")
    runs = client.search_runs([experiment.experiment_id], "", max_results=100)
    found = [run for run in runs if "mlflow.parentRunId" not in run.data.tags]
    assert len(found) == len({run.info.run_name for run in found}), found  # one parent per run
    return {run.info.run_name: run for run in found}


def test_a_failed_ddp_baseline_leaves_its_sibling_evaluated_and_reported(tmp_path):
    write_config(tmp_path)
    failed = snakemake(tmp_path, check=False)  # no --keep-going: the default profile keeps going
    assert failed.returncode != 0
    errors = [line for line in failed.stderr.splitlines() if "shardfuse.launch: error: rank" in line]
    assert len(errors) == 1 and "RuntimeError" in errors[0], failed.stderr[-3000:]
    assert "find_unused_parameters" in errors[0] or "reduction" in errors[0]  # DDP's own words
    sibling = json.loads((tmp_path / "results/runs/lm_soup/eval.json").read_text())
    assert sibling["ddp_baseline"] is None and sibling["merged"]["loss"] > 0
    warning = "shardfuse: warning: ddp run lm_ddp failed, so lm_soup is evaluated without a ddp baseline"
    assert failed.stderr.count(warning) == 1, failed.stderr[-3000:]
    # The report of the finished run, the failed one marked.
    assert (
        "shardfuse: reported the 1 finished run(s) of 2 in results/experiments/baseline/summary.csv and "
        "MLflow; lm_ddp failed"
    ) in failed.stderr
    rows = read_summary(tmp_path)
    assert rows["lm_soup"]["error"] == "" and float(rows["lm_soup"]["test_loss_merged"]) > 0
    assert rows["lm_ddp"]["test_loss_merged"] == "" and rows["lm_ddp"]["error"] == errors[0].strip()
    tracked = parents(tmp_path)
    assert tracked["lm_soup"].info.status == "FINISHED"
    assert tracked["lm_ddp"].info.status == "FAILED"
    assert tracked["lm_ddp"].data.tags["shardfuse.error"] == rows["lm_ddp"]["error"]
    assert tracked["lm_ddp"].data.params["strategy"] == "ddp"
    comparison = json.loads(
        (tmp_path / "results/experiments/baseline/plots/comparison.mlflow.json").read_text()
    )
    assert comparison["parent_run_ids"] == [tracked["lm_soup"].info.run_id]
    assert not (tmp_path / "results/runs/lm_ddp/mlflow.json").exists()
    # Dropping the failed run instead of fixing it: the report is written again without it.
    config = yaml.safe_load((tmp_path / "config.yaml").read_text())
    del config["runs"]["lm_ddp"]
    (tmp_path / "dropped.yaml").write_text(yaml.safe_dump(config))
    dropped = planned_jobs(snakemake(tmp_path, "-n", "--configfile", str(tmp_path / "dropped.yaml")).stdout)
    assert dropped["summary"] == dropped["track"] == 1 and "train" not in dropped, dropped

    write_config(tmp_path, find_unused_parameters=True)
    dry = snakemake(tmp_path, "-n")
    assert planned_jobs(dry.stdout)["evaluate"] == 1  # the sibling's evaluation stands
    snakemake(tmp_path)
    rows = read_summary(tmp_path)
    assert rows["lm_soup"]["test_loss_ddp_baseline"] == rows["lm_ddp"]["test_loss_merged"] != ""
    assert "error" not in rows["lm_ddp"]  # a complete report: the header it always had
    tracked = parents(tmp_path)
    assert {run: parent.info.status for run, parent in tracked.items()} == {
        "lm_ddp": "FINISHED", "lm_soup": "FINISHED"
    }  # fmt: skip
    assert "shardfuse.error" not in tracked["lm_ddp"].data.tags
    assert "Nothing to be done" in snakemake(tmp_path, "-n").stdout
