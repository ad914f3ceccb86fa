"""A ddp run that fails (DDP refuses a parameter no forward uses) with a sibling trained per shard: the
rank's exception is one line on the console, the sibling is still merged and evaluated, and one warning
says it went without its baseline; with find_unused_parameters the ddp run trains, and only it is
evaluated again, its metrics reaching the sibling's summary row as the baseline."""

from __future__ import annotations

import csv
import json

import yaml

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


def test_a_failed_ddp_baseline_leaves_its_sibling_evaluated(tmp_path):
    write_config(tmp_path)
    failed = snakemake(tmp_path, "--keep-going", check=False)
    assert failed.returncode != 0
    errors = [line for line in failed.stderr.splitlines() if "shardfuse.launch: error: rank" in line]
    assert len(errors) == 1 and "RuntimeError" in errors[0], failed.stderr[-3000:]
    assert "find_unused_parameters" in errors[0] or "reduction" in errors[0]  # DDP's own words
    sibling = json.loads((tmp_path / "results/runs/lm_soup/eval.json").read_text())
    assert sibling["ddp_baseline"] is None and sibling["merged"]["loss"] > 0
    warning = "shardfuse: warning: ddp run lm_ddp failed, so lm_soup is evaluated without a ddp baseline"
    assert failed.stderr.count(warning) == 1, failed.stderr[-3000:]

    write_config(tmp_path, find_unused_parameters=True)
    dry = snakemake(tmp_path, "-n")
    assert planned_jobs(dry.stdout)["evaluate"] == 1  # the sibling's evaluation stands
    snakemake(tmp_path)
    with open(tmp_path / "results/experiments/baseline/summary.csv", newline="") as fh:
        rows = {row["run"]: row for row in csv.DictReader(fh)}
    assert rows["lm_soup"]["test_loss_ddp_baseline"] == rows["lm_ddp"]["test_loss_merged"] != ""
