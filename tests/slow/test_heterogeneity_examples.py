"""The README's three heterogeneity examples (disjoint labels, label skew against alpha, natural groups),
run exactly as it shows them, one after the other in a copy of the checkout; then each rank's local
scores read back from eval.json, summary.csv, the fusion plot and the MLflow store (the evaluate rule
passes a non-iid run's shard manifest), and the heterogeneity figure."""

from __future__ import annotations

import json

import matplotlib.image
import pytest
from mlflow.tracking import MlflowClient

from tests.support.helpers import checkout_copy, results_dir, run_readme_examples

# Three whole experiments (20 runs, 17 trainings) in one fixture: about 4 min on 2 cores.
pytestmark = pytest.mark.timeout(1800)
LOCAL = ("local_accuracy_merged_mean", "local_accuracy_merged_worst", "normalized_accuracy")
ALPHAS = ("a100", "a1", "a0.1")
MODES = ("independent", "localsgd", "diloco", "ddp")


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict:
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    return {**run_readme_examples(checkout, "examples-heterogeneity"), "checkout": checkout}


def number(row: dict, column: str) -> float:
    return float(row[column])


def test_disjoint_labels_cap_each_rank_near_half_and_every_fusion_beats_the_better_rank(examples):
    rows = examples["disjoint"]
    for run, row in rows.items():
        assert 0.25 < number(row, "shard_label_jsd_mean") < 0.35  # halves of 5 classes: 0.311 bits
        if run != "split_ddp":
            assert number(row, "test_accuracy_best_rank") < 0.55  # a rank knows half the classes
            assert number(row, "test_accuracy_merged") > number(row, "test_accuracy_best_rank")
            assert number(row, "test_accuracy_ensemble") > number(row, "test_accuracy_merged")
            assert number(row, "normalized_accuracy") < 1.0  # each half is lost in part
    assert number(rows["split_ddp"], "test_accuracy_merged") > 0.9  # the union


def test_label_skew_grows_as_alpha_falls_and_hurts_one_shot_fusion_most(examples):
    rows = examples["label_skew"]
    assert set(rows) == {f"{alpha}_{mode}" for alpha in ALPHAS for mode in MODES}
    skew = {alpha: number(rows[f"{alpha}_ddp"], "shard_label_jsd_mean") for alpha in ALPHAS}
    assert skew["a100"] < 0.01 < skew["a1"] and max(skew.values()) == skew["a0.1"]
    for alpha in ALPHAS:  # one shard set per alpha: every strategy saw the same shards
        assert {rows[f"{alpha}_{mode}"]["shard_label_jsd_mean"] for mode in MODES} == {
            rows[f"{alpha}_ddp"]["shard_label_jsd_mean"]
        }
        assert number(rows[f"{alpha}_ddp"], "test_accuracy_merged") > 0.9
    independent = [number(rows[f"{alpha}_independent"], "test_accuracy_merged") for alpha in ("a100", "a0.1")]
    assert independent[1] < independent[0] - 0.1  # one-shot fusion falls with the skew
    assert number(rows["a0.1_diloco"], "test_accuracy_merged") > independent[1] + 0.1
    skew_dir = results_dir(examples["checkout"], "config/examples/label_skew.yaml")
    assert skew_dir.name == "shardfuse-label-skew"  # each experiment its own figures
    figure = matplotlib.image.imread(skew_dir / "plots" / "heterogeneity.png")
    assert figure.shape[0] > 300 and figure.shape[1] > 600


def test_local_scores_of_a_skewed_run_reach_eval_json_summary_csv_the_fusion_plot_and_mlflow(examples):
    checkout, run = examples["checkout"], "a0.1_independent"
    evaluation = json.loads((checkout / "results" / "runs" / run / "eval.json").read_text())
    local = {key: value for key, value in evaluation.items() if key.startswith(("local_", "normalized_"))}
    ranks = range(4)
    assert sorted(local) == sorted(
        [*LOCAL, *(f"local_accuracy_{who}rank_{r}" for who in ("", "merged_") for r in ranks)]
    )
    manifest = evaluation["sets"]["local_rank_0"]["path"]
    assert manifest.startswith("results/shards/digits/w4-seed0-dirichlet-") and manifest.endswith(
        "manifest.json"
    )
    # Label skew: each rank's own model does better on its own label mix than on the global test split.
    for rank in ranks:
        assert local[f"local_accuracy_rank_{rank}"] > evaluation["ranks"][rank]["accuracy"]
    row = examples["label_skew"][run]
    assert [float(row[column]) for column in LOCAL] == [local[column] for column in LOCAL]
    fusion = matplotlib.image.imread(checkout / "results" / "runs" / run / "plots" / "fusion.png")
    assert fusion.shape[1] > 900  # the local panel beside the global one

    client = MlflowClient(tracking_uri=f"sqlite:///{checkout}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse-label-skew")
    (parent,) = client.search_runs([experiment.experiment_id], f"attributes.run_name = '{run}'")
    assert {key: parent.data.metrics[key] for key in local} == local
    assert parent.data.params["partition"] == "dirichlet" and parent.data.params["partition_alpha"] == "0.1"
    children = client.search_runs(
        [experiment.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'"
    )
    assert len(children) == 4
    for child in children:
        rank = int(child.info.run_name.rsplit("-", 1)[1])
        assert child.data.metrics["local_accuracy"] == local[f"local_accuracy_rank_{rank}"]
        assert child.data.metrics["local_accuracy_merged"] == local[f"local_accuracy_merged_rank_{rank}"]


def test_natural_groups_put_each_writer_on_one_rank_and_score_each_rank_on_its_writers(examples):
    rows = examples["natural_groups"]
    assert number(rows["groups_ddp"], "test_accuracy_merged") > 0.9
    for row in rows.values():
        assert number(row, "shard_label_jsd_mean") < 0.01  # writer blocks hold every digit alike
        assert all(row[column] != "" for column in LOCAL)
    evaluation = json.loads(
        (examples["checkout"] / "results" / "runs" / "groups_uniform" / "eval.json").read_text()
    )
    manifest = json.loads((examples["checkout"] / evaluation["sets"]["local_rank_0"]["path"]).read_text())
    writers = [set(shard["value_counts"]["writer"]) for shard in manifest["shards"]]
    assert (
        len(writers) == 4
        and sum(map(len, writers)) == 13
        and set().union(*writers) == {str(w) for w in range(13)}
    )


def test_the_search_example_tunes_on_validation_only_and_each_trial_is_a_nested_mlflow_run(examples):
    """The README's merge-search example in the label-skew example's checkout: its runs merge the
    a0.1_independent training (nothing is trained again); each search completes its trials, merges its
    best trial, and logs every trial as a nested run; a larger trial count re-runs that run's merge only."""
    import yaml
    from mlflow.tracking import MlflowClient

    from tests.support.helpers import planned_jobs, run_in

    checkout = examples["checkout"]
    rows = run_readme_examples(checkout, "examples-search")["search"]
    assert {row["training"] for row in rows.values()} == {
        examples["label_skew"]["a0.1_independent"]["training"]
    }
    client = MlflowClient(f"sqlite:///{checkout}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse-search")
    for run in ("search_scale", "search_weights", "search_ties"):
        merge = json.loads((checkout / "results" / "runs" / run / "merge.json").read_text())
        found = merge["search"]
        assert found["trials_done"] == 30 and found["objective"] == "val_accuracy"
        assert found["best_value"] >= found["default_value"]  # the run's own parameters were a trial's rival
        assert {k: merge["params"][k] for k in found["best_params"]} == found["best_params"]
        (parent,) = client.search_runs([experiment.experiment_id], f"tags.mlflow.runName = '{run}'")
        trials = client.search_runs(
            [experiment.experiment_id], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'", max_results=200
        )
        assert len([t for t in trials if "shardfuse.trial" in t.data.tags]) == len(found["trials"])
        assert parent.data.metrics["search_best_val_accuracy"] == pytest.approx(found["best_value"])
        names = [a.path for a in client.list_artifacts(parent.info.run_id, "search")]
        assert "search/optimization_history.png" in names
    config = yaml.safe_load((checkout / "config" / "examples" / "search.yaml").read_text())
    config["runs"]["search_ties"]["merge_search"]["trials"] = 32
    (checkout / "more.yaml").write_text(yaml.safe_dump(config))
    planned = planned_jobs(run_in(checkout, ["snakemake", "-n", "--configfile", "more.yaml"]).stdout)
    assert planned.get("merge") == 1 and "train" not in planned, planned
