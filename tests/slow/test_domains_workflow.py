"""One domain per rank through the whole workflow, as a user runs it: two parts of scikit-learn's digits
(the digits 0-4 and 5-9, each its own prepared dataset), joined by a domains dataset, one part a rank
(`partition: domain`), each rank trained on its own and fused by uniform averaging and TIES, beside ddp
on the union; every model scored on each domain's test rows, read back from eval.json, summary.csv and
the MLflow store."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.helpers import snakemake

pytestmark = pytest.mark.timeout(900)
PER_DOMAIN = ("per_domain_uniform", "per_domain_ties")


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("domains")
    config = {
        "datasets": {
            "low": {"source": "digits", "classes": [0, 1, 2, 3, 4]},
            "high": {"source": "digits", "classes": [5, 6, 7, 8, 9]},
            "mix": {"source": "domains", "parts": ["low", "high"]},
        },
        "runs": {
            "per_domain_uniform": {"strategy": "localsgd", "merge_method": "uniform", "partition": "domain"},
            "per_domain_ties": {"strategy": "localsgd", "merge_method": "ties", "partition": "domain"},
            "union_ddp": {"strategy": "ddp", "merge_method": "consolidate"},
            "low_split": {  # part 0 split IID over ranks 0 and 1, part 1 on rank 2
                "strategy": "localsgd",
                "merge_method": "uniform",
                "partition": "domain",
                "world_size": 3,
                "partition_groups": [[0], [0], [1]],
            },
        },
        "run_defaults": {"dataset": "mix", "world_size": 2, "epochs": 10},
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db", "experiment": "domains"},
    }
    (path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(path)
    return path


def evaluation(workdir: Path, run: str) -> dict:
    return json.loads((workdir / "results" / "runs" / run / "eval.json").read_text())


@pytest.mark.parametrize("run", PER_DOMAIN)
def test_each_rank_knows_its_own_domain_only_and_the_fusion_is_scored_per_domain(workdir, run):
    found = evaluation(workdir, run)
    for domain in (0, 1):
        scored = found["sets"][f"local_rank_{domain}"]
        assert scored["trained_by"] == domain
        own, other = scored["ranks"][domain]["accuracy"], scored["ranks"][1 - domain]["accuracy"]
        assert own > 0.9 and other < 0.1  # a rank never saw the other domain's classes
        assert found[f"local_accuracy_merged_rank_{domain}"] == scored["merged"]["accuracy"]
    local = [found[f"local_accuracy_merged_rank_{domain}"] for domain in (0, 1)]
    assert found["local_accuracy_merged_worst"] == min(local)
    own = [found["sets"][f"local_rank_{d}"]["ranks"][d]["accuracy"] for d in (0, 1)]
    assert found["normalized_accuracy"] == pytest.approx(
        sum(m / o for m, o in zip(local, own, strict=True)) / 2
    )
    # One-shot fusion keeps much of both domains, far above either rank alone on the joint test set.
    assert found["merged"]["accuracy"] > 0.8 > 0.6 > max(rank["accuracy"] for rank in found["ranks"])
    assert not [key for key in found if key.startswith("domain_")]  # its local sets are the parts


def test_ddp_on_the_union_is_scored_per_domain_too(workdir):
    found = evaluation(workdir, "union_ddp")
    # The same test rows as the per-domain runs' local sets: part r's are rank r's there.
    local = evaluation(workdir, "per_domain_ties")["sets"]
    for domain, part in enumerate(("low", "high")):
        assert found["sets"][f"domain_{part}"]["rows"] == local[f"local_rank_{domain}"]["rows"]
    parts = {part: found[f"domain_accuracy_merged_{part}"] for part in ("low", "high")}
    assert all(score > 0.9 for score in parts.values())
    assert found["domain_accuracy_merged_worst"] == min(parts.values())
    assert found["domain_accuracy_merged_mean"] == pytest.approx(sum(parts.values()) / 2)
    rows = [found["sets"][f"domain_{part}"]["rows"] for part in ("low", "high")]
    assert sum(rows) == found["test_rows"]


def test_summary_and_mlflow_carry_the_per_domain_scores_and_ddp_on_the_union_leads(workdir):
    with open(workdir / "results" / "experiments" / "domains" / "summary.csv") as file:
        rows = {row["run"]: row for row in csv.DictReader(file)}
    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("domains")
    for run in PER_DOMAIN:
        found = evaluation(workdir, run)
        assert float(rows[run]["normalized_accuracy"]) == pytest.approx(found["normalized_accuracy"])
        (parent,) = client.search_runs(
            [experiment.experiment_id], f"tags.mlflow.runName = '{run}'", max_results=1
        )
        assert parent.data.metrics["normalized_accuracy"] == pytest.approx(found["normalized_accuracy"])
    assert rows["union_ddp"]["normalized_accuracy"] == ""  # iid shards: no rank owns a domain
    union_found = evaluation(workdir, "union_ddp")
    assert float(rows["union_ddp"]["domain_accuracy_merged_worst"]) == pytest.approx(
        union_found["domain_accuracy_merged_worst"]
    )
    (union_parent,) = client.search_runs(
        [experiment.experiment_id], "tags.mlflow.runName = 'union_ddp'", max_results=1
    )
    assert union_parent.data.metrics["domain_accuracy_merged_low"] == pytest.approx(
        union_found["domain_accuracy_merged_low"]
    )
    union = float(rows["union_ddp"]["test_accuracy_merged"])
    assert union > max(float(rows[run]["test_accuracy_merged"]) for run in PER_DOMAIN)


def test_a_part_split_over_two_ranks_is_each_ranks_own_ground(workdir):
    found = evaluation(workdir, "low_split")
    sets = [found["sets"][f"local_rank_{rank}"] for rank in range(3)]
    # Ranks 0 and 1 hold halves of the digits 0-4: their local set is that part's test rows, the same
    # rows as rank 0's set of the runs with one part a rank.
    assert (
        sets[0]["rows"]
        == sets[1]["rows"]
        == evaluation(workdir, "per_domain_ties")["sets"]["local_rank_0"]["rows"]
    )
    for rank in range(3):
        accuracies = [model["accuracy"] for model in sets[rank]["ranks"]]
        assert accuracies[rank] > 0.9 and accuracies[2 if rank < 2 else 0] < 0.1
    assert found["local_accuracy_merged_worst"] == min(
        found[f"local_accuracy_merged_rank_{r}"] for r in range(3)
    )
