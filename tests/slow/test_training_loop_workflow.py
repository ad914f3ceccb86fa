"""The README's training-loop experiment, run exactly as it shows it: ddp, local SGD and DiLoCo at two
sync intervals and independent training + fusion, one epoch each at world size 4; what reaches
summary.csv, the communication plot and MLflow."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest

from tests.support.helpers import checkout_copy, readme_block, run_in, snakemake_failure

# A whole experiment in one fixture: 94 s alone on 2 cores, up to 300 s beside the other tests.
pytestmark = pytest.mark.timeout(1800)

# The MLP of config/examples/communication.yaml: 32 -> 128 -> 128 -> 10, float32.
PARAMETER_BYTES = (32 * 128 + 128 + 128 * 128 + 128 + 128 * 10 + 10) * 4


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    (line,) = [line for line in readme_block("examples-training").splitlines() if line.strip()]
    proc = run_in(checkout, shlex.split(line.split("#")[0]), timeout=1500)
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    return checkout


def summary_rows(checkout: Path) -> dict[str, dict[str, str]]:
    with open(
        checkout / "results" / "experiments" / "shardfuse-communication" / "summary.csv", newline=""
    ) as fh:
        return {row["run"]: row for row in csv.DictReader(fh)}


def test_every_strategy_sees_the_same_samples_and_records_its_communication(experiment):
    rows = summary_rows(experiment)
    modes = {run: row["mode"] for run, row in rows.items()}
    assert modes == {
        "comm_ddp": "ddp",
        "comm_localsgd_h16": "localsgd",
        "comm_localsgd_h64": "localsgd",
        "comm_diloco_h16": "diloco",
        "comm_diloco_h64": "diloco",
        "comm_independent_uniform": "independent",
        "comm_independent_greedy": "independent",
    }
    trainings = {}
    for path in (experiment / "results" / "trainings").glob("*/ranks/train.json"):
        info = json.loads(path.read_text())
        trainings[(info["mode"], info["sync_every"])] = info
    steps = {info["num_steps"] for info in trainings.values()}
    assert len(steps) == 1 and steps.pop() >= 1000  # one epoch of at least 1,000 steps per rank, for all
    num_steps = trainings[("ddp", 0)]["num_steps"]
    assert trainings[("ddp", 0)]["bytes_all_reduced_per_rank"] == num_steps * PARAMETER_BYTES
    for sync_every in (16, 64):
        syncs = num_steps // sync_every
        assert trainings[("localsgd", sync_every)]["bytes_all_reduced_per_rank"] == syncs * PARAMETER_BYTES
        # DiLoCo ends with an outer step when the run is not a whole number of rounds.
        diloco_syncs = syncs + (num_steps % sync_every != 0)
        assert (
            trainings[("diloco", sync_every)]["bytes_all_reduced_per_rank"] == diloco_syncs * PARAMETER_BYTES
        )
    assert trainings[("independent", 0)]["bytes_all_reduced_per_rank"] == 0
    assert all(int(row["bytes_all_reduced_per_rank"]) >= 0 for row in rows.values())
    assert all(info["effective_batch_size"] == 4 * 32 for info in trainings.values())


def test_diloco_learns_as_well_as_ddp_with_a_sixteenth_of_the_bytes(experiment):
    rows = summary_rows(experiment)
    accuracy = {run: float(row["test_accuracy_merged"]) for run, row in rows.items()}
    loss = {}
    for run in rows:
        loss[run] = json.loads((experiment / "results" / "runs" / run / "eval.json").read_text())["merged"][
            "loss"
        ]
    assert all(value > 0.45 for value in accuracy.values()), accuracy  # chance is 0.1
    # The outer momentum keeps what plain averaging loses: DiLoCo beats local SGD at equal bytes, and
    # every synchronised strategy beats training apart and fusing once.
    assert loss["comm_diloco_h16"] < loss["comm_localsgd_h16"] - 0.004
    # At H = 64 one epoch holds 18 outer steps: too few for DiLoCo's momentum (README, bench/RESULTS.md).
    assert loss["comm_diloco_h64"] > loss["comm_localsgd_h64"]
    assert loss["comm_diloco_h16"] < loss["comm_independent_uniform"]
    assert abs(loss["comm_diloco_h16"] - loss["comm_ddp"]) < 0.005


def test_the_communication_plot_reaches_the_report_and_mlflow(experiment):
    from mlflow.tracking import MlflowClient

    png = experiment / "results" / "experiments" / "shardfuse-communication" / "plots" / "communication.png"
    assert png.stat().st_size > 10_000
    client = MlflowClient(tracking_uri=f"sqlite:///{experiment}/mlflow.db")
    (experiment_id,) = [
        e.experiment_id for e in client.search_experiments() if e.name == "shardfuse-communication"
    ]
    parents = client.search_runs([experiment_id], filter_string="tags.`shardfuse.complete` = 'true'")
    assert {p.info.run_name for p in parents} == set(summary_rows(experiment))
    for parent in parents:
        assert parent.data.params["mode"] in {"ddp", "localsgd", "diloco", "independent"}
        assert "bytes_all_reduced_per_rank" in parent.data.metrics
        artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
        assert "comparison/communication.png" in artifacts
