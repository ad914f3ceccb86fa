"""The README's FSDP example (issue 31), run exactly as it shows it: two replicas of two FSDP ranks each
(world size 4, ``fsdp: 2``) trained with HSDP, local SGD, DiLoCo and apart, through the whole DAG:
one checkpoint per replica gathered, fused, evaluated, and one MLflow child run per replica."""

from __future__ import annotations

import csv
import json
import shlex
from pathlib import Path

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import checkout_copy, readme_block, run_in, snakemake_failure

pytestmark = pytest.mark.timeout(1200)

# The mlp of config/examples/fsdp.yaml: 64 -> 256 -> 256 -> 10, float32; a rank holds half of each
# tensor (torch shards dim 0 in equal chunks: 128 of 256 rows, 5 of 10).
WHOLE_BYTES = (64 * 256 + 256 + 256 * 256 + 256 + 256 * 10 + 10) * 4
SHARD_BYTES = WHOLE_BYTES // 2


@pytest.fixture(scope="module")
def experiment(tmp_path_factory) -> Path:
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    (line,) = [line for line in readme_block("examples-fsdp").splitlines() if line.strip()]
    proc = run_in(checkout, shlex.split(line.split("#")[0]), timeout=1100)
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    return checkout


def test_every_strategy_trains_two_sharded_replicas_and_fuses_them(experiment):
    with open(experiment / "results" / "experiments" / "shardfuse-fsdp" / "summary.csv", newline="") as fh:
        rows = {row["run"]: row for row in csv.DictReader(fh)}
    assert {run: row["mode"] for run, row in rows.items()} == {
        "fsdp_hsdp": "ddp",
        "fsdp_localsgd": "localsgd",
        "fsdp_diloco": "diloco",
        "fsdp_independent": "independent",
    }
    assert all(float(row["test_accuracy_merged"]) > 0.9 for row in rows.values()), rows  # chance: 0.1
    for run, row in rows.items():
        ranks = experiment / "results" / "trainings" / row["training"] / "ranks"
        train = json.loads((ranks / "train.json").read_text())
        assert train["world_size"] == 4 and train["validation"]["every"] == 20
        assert all(entry["best_val_score"] is not None for entry in train["ranks"]), run
        assert train["fsdp"]["shards_per_replica"] == 2 and train["fsdp"]["replicas"] == 2
        assert [entry["ranks"] for entry in train["ranks"]] == [[0, 1], [2, 3]]
        assert sorted(p.name for p in ranks.glob("rank-*.safetensors")) == [
            "rank-0.safetensors",
            "rank-1.safetensors",
        ]
        steps, syncs = train["num_steps"], train["num_syncs"]
        expected = {"fsdp_hsdp": steps, "fsdp_localsgd": steps // 8, "fsdp_diloco": -(-steps // 8)}
        assert syncs == expected.get(run, 0), run
        assert train["bytes_all_reduced_per_rank"] == syncs * SHARD_BYTES, run
        gather = json.loads((ranks.parent / "gather.json").read_text())
        assert gather["replicas"] == 2 and len(gather["ranks"]) == 2
        first, _ = load_weights(ranks / "rank-0.safetensors")
        second, _ = load_weights(ranks / "rank-1.safetensors")
        same = all(torch.equal(first[name], second[name]) for name in first)
        # HSDP and the synchronised strategies end with equal replicas; apart, they differ.
        assert same == (run != "fsdp_independent"), run
        evaluation = json.loads((experiment / "results" / "runs" / run / "eval.json").read_text())
        assert [entry["rank"] for entry in evaluation["ranks"]] == [0, 1]


def test_mlflow_has_one_child_run_per_replica_with_the_replicas_loss(experiment):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{experiment}/mlflow.db")
    found = client.get_experiment_by_name("shardfuse-fsdp")
    runs = client.search_runs([found.experiment_id], max_results=100)
    parents = {r.info.run_id: r for r in runs if "mlflow.parentRunId" not in r.data.tags}
    assert sorted(r.info.run_name for r in parents.values()) == sorted(
        ["fsdp_hsdp", "fsdp_localsgd", "fsdp_diloco", "fsdp_independent"]
    )
    for parent_id in parents:
        children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent_id]
        assert len(children) == 2
        for child in children:
            history = client.get_metric_history(child.info.run_id, "loss")
            assert len(history) >= 50 and history[-1].value < history[0].value
