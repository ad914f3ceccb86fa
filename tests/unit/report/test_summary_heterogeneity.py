"""summary.csv's heterogeneity columns: present when the runs name their shard sets' manifests (the
workflow passes them when some run is not iid), read from each manifest (an iid one's computed from its
label counts); absent otherwise, so an all-iid experiment keeps its bytes."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from shardfuse import summary
from shardfuse.data.heterogeneity import heterogeneity
from shardfuse.io import UserError

HETEROGENEITY = ["shard_label_jsd_mean", "shard_label_jsd_max", "shard_rows_cv"]


def write_run(root: Path, run: str, manifest: dict | None = None) -> dict:
    """eval.json, merge.json, train.json (and the shard set's manifest) of a classification run."""
    run_dir = root / "runs" / run
    run_dir.mkdir(parents=True)
    evaluation = {
        "task": "classification",
        "score": "accuracy",
        "lower_is_better": False,
        "metrics": ["loss", "accuracy"],
        "test_rows": 100,
        "merged": {"loss": 0.5, "accuracy": 0.8},
        "base": {"loss": 1.0, "accuracy": 0.1},
        "ranks": [{"rank": 0, "loss": 0.6, "accuracy": 0.7}, {"rank": 1, "loss": 0.6, "accuracy": 0.75}],
        "best_rank_accuracy": 0.75,
        "mean_rank_accuracy": 0.725,
        "fusion_gain": 0.05,
    }
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    (run_dir / "merge.json").write_text(json.dumps({"method": "uniform", "max_abs_diff_between_ranks": 0.1}))
    ranks = root / "trainings" / run / "ranks"
    ranks.mkdir(parents=True)
    (ranks / "train.json").write_text(json.dumps({"num_steps": 4, "train_seconds": 1.0}))
    cfg = {"training": run, "dataset": "d", "world_size": 2, "strategy": "localsgd", "sync_every": 0}
    if manifest is not None:
        path = root / "shards" / run / "manifest.json"
        path.parent.mkdir(parents=True)
        path.write_text(json.dumps(manifest))
        cfg["manifest"] = str(path)
    return cfg


def read_summary(root: Path, runs: dict) -> tuple[list[str], dict[str, dict[str, str]]]:
    out = root / "summary.csv"
    summary.write_summary(summary.checked_runs(runs), root / "runs", root / "trainings", out)
    with open(out, newline="") as fh:
        rows = list(csv.DictReader(fh))
    return list(rows[0]), {row["run"]: row for row in rows}


IID = {
    "shards": [
        {"rows": 50, "label_counts": {"0": 25, "1": 25}},
        {"rows": 50, "label_counts": {"0": 24, "1": 26}},
    ]
}
SKEWED = {
    "partition": {"name": "dirichlet", "params": {"alpha": 0.1, "min_rows": 10, "self_balancing": False}},
    "heterogeneity": {"label_jsd_mean": 0.25, "label_jsd_max": 0.5, "rows_cv": 0.4},
    "shards": [
        {"rows": 70, "label_counts": {"0": 60, "1": 10}},
        {"rows": 30, "label_counts": {"0": 1, "1": 29}},
    ],
}


def test_without_manifests_the_header_has_no_heterogeneity_columns(tmp_path):
    header, _ = read_summary(tmp_path, {"a": write_run(tmp_path, "a")})
    assert header[-1] == "fusion_gap"
    assert not set(HETEROGENEITY) & set(header)


def test_a_skewed_run_and_an_iid_run_get_their_shard_sets_numbers(tmp_path):
    runs = {"iid": write_run(tmp_path, "iid", IID), "skewed": write_run(tmp_path, "skewed", SKEWED)}
    header, rows = read_summary(tmp_path, runs)
    assert header[-3:] == HETEROGENEITY
    assert [float(rows["skewed"][column]) for column in HETEROGENEITY] == [0.25, 0.5, 0.4]
    computed = heterogeneity(IID["shards"])  # an iid manifest records no heterogeneity: computed
    assert float(rows["iid"]["shard_label_jsd_mean"]) == pytest.approx(computed["label_jsd_mean"])
    assert 0 < float(rows["iid"]["shard_label_jsd_max"]) < 0.01
    assert float(rows["iid"]["shard_rows_cv"]) == 0


def test_shards_without_class_labels_leave_the_label_cells_empty(tmp_path):
    manifest = {"shards": [{"rows": 30}, {"rows": 10}]}  # regression: no label counts
    _, rows = read_summary(tmp_path, {"r": write_run(tmp_path, "r", manifest)})
    assert (rows["r"]["shard_label_jsd_mean"], rows["r"]["shard_label_jsd_max"]) == ("", "")
    assert float(rows["r"]["shard_rows_cv"]) == pytest.approx(0.5)


def test_a_manifest_without_shards_is_a_user_error_naming_the_partition_stage(tmp_path):
    runs = {"r": write_run(tmp_path, "r", {"world_size": 2})}
    with pytest.raises(UserError, match="has no shards with rows; re-run the partition stage"):
        read_summary(tmp_path, runs)
