"""Each rank scored on its own test distribution through the real workflow: a dirichlet run trained by
torchrun, evaluated with its shard set's manifest (the evaluate rule passes it for non-iid runs), its
local scores read back from eval.json, summary.csv, the fusion plot and the MLflow store."""

from __future__ import annotations

import csv
import json

import matplotlib.image
import yaml

from tests.support.helpers import mlflow_state, snakemake

LOCAL = ("local_accuracy_merged_mean", "local_accuracy_merged_worst", "normalized_accuracy")


def test_a_dirichlet_run_carries_its_local_scores_to_eval_json_summary_csv_and_mlflow(tmp_path):
    config = {
        "runs": {
            "skewed": {
                "strategy": "localsgd", "sync_every": 0, "merge_method": "uniform",
                "partition": "dirichlet", "partition_alpha": 0.3,
            }
        },
        "datasets": {"digits": {"source": "digits", "test_fraction": 0.2, "seed": 0}},
        "run_defaults": {
            "dataset": "digits", "world_size": 2, "hidden_sizes": [16], "epochs": 2, "batch_size": 64,
        },
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "tiny"},
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    snakemake(tmp_path)

    evaluation = json.loads((tmp_path / "results" / "runs" / "skewed" / "eval.json").read_text())
    local = {key: value for key, value in evaluation.items() if key.startswith(("local_", "normalized_"))}
    assert sorted(local) == sorted(
        [*LOCAL, *(f"local_accuracy_{who}rank_{r}" for who in ("", "merged_") for r in (0, 1))]
    )
    manifest = evaluation["sets"]["local_rank_0"]["path"]
    assert manifest.startswith("results/shards/digits/w2-seed0-dirichlet-") and manifest.endswith(
        "manifest.json"
    )
    # Label skew: each rank's own model does better on its own label mix than on the global test split.
    for rank in (0, 1):
        assert local[f"local_accuracy_rank_{rank}"] > evaluation["ranks"][rank]["accuracy"]

    with (tmp_path / "results" / "summary.csv").open() as fh:
        (row,) = list(csv.DictReader(fh))
    assert [float(row[column]) for column in LOCAL] == [local[column] for column in LOCAL]

    fusion = matplotlib.image.imread(tmp_path / "results" / "runs" / "skewed" / "plots" / "fusion.png")
    assert fusion.shape[1] > 900  # the local panel beside the global one

    state = mlflow_state(tmp_path)
    (parent,) = state["parents"]
    assert {key: parent.data.metrics[key] for key in local} == local
    for child in state["children"]:
        rank = int(child.info.run_name.rsplit("-", 1)[1])
        assert child.data.metrics["local_accuracy"] == local[f"local_accuracy_rank_{rank}"]
        assert child.data.metrics["local_accuracy_merged"] == local[f"local_accuracy_merged_rank_{rank}"]
