"""The evaluate stage on a real dirichlet shard set of digits (the test split prepare wrote, the manifest
partition wrote, a training's checkpoints gathered and merged): every model scored on each rank's label
mix exactly as the class-conditional scores weighted by hand, the global scores those of an evaluation
without local sets, a shard set not the training's refused; then eval.json's local scores read back
from summary.csv, the fusion plot and a real SQLite MLflow store."""

from __future__ import annotations

import csv
import json

import matplotlib.image
import pytest

from shardfuse import summary
from shardfuse.experiment.records import EvalRecord
from shardfuse.plots import plot_fusion
from shardfuse.scoring.scorer import model_from_file, score_models
from shardfuse.scoring.split import Split, load_split
from shardfuse.track import sync as track_sync
from tests.support.local import evaluate_on_shard_set, stage_ok
from tests.support.tracking import TRACK_EXPERIMENT, active_runs, make_run_dir, run_config

LOCAL = ("local_accuracy_merged_mean", "local_accuracy_merged_worst", "normalized_accuracy")


@pytest.fixture(scope="module")
def dirichlet(tmp_path_factory, digits_dataset):
    """(root, the dirichlet shard set, eval.json with local sets, eval.json without) of one training."""
    root = tmp_path_factory.mktemp("local")
    shards = root / "shards"
    stage_ok(
        "partition", "--input", digits_dataset / "train.parquet", "--world-size", 2, "--seed", 0,
        "--partitioner", "dirichlet", "--params-json", '{"alpha": 0.5}', "--out-dir", shards,
    )  # fmt: skip
    status, stderr, out = evaluate_on_shard_set(root, digits_dataset, shards)
    assert status == 0, stderr
    plain = root / "plain.json"
    out.rename(plain)
    status, stderr, out = evaluate_on_shard_set(
        root, digits_dataset, shards, "--set", f"local={shards}/manifest.json"
    )
    assert status == 0, stderr
    return root, shards, json.loads(out.read_text()), json.loads(plain.read_text())


def class_scores(path, test: Split) -> dict[str, dict[str, float]]:
    """The model's metrics on each class's test rows alone, scored here."""
    model = model_from_file(path)
    return {
        str(label): score_models([model], Split("c", test.path, test.features[rows], test.labels[rows]), 97)[
            0
        ][0]
        for label in range(10)
        if (rows := test.labels == label).any()
    }


def test_each_model_on_each_ranks_label_mix_is_its_class_scores_weighted_by_hand(dirichlet, digits_dataset):
    root, shards, evaluation, _ = dirichlet
    manifest = json.loads((shards / "manifest.json").read_text())
    test = load_split(digits_dataset / "test.parquet", "test")
    merged = class_scores(root / "run" / "merged.safetensors", test)
    own = [class_scores(root / "ranks" / f"rank-{rank}.safetensors", test) for rank in (0, 1)]
    for rank, shard in enumerate(manifest["shards"]):
        local = evaluation["sets"][f"local_rank_{rank}"]
        total = sum(shard["label_counts"].values())
        mix = {label: count / total for label, count in shard["label_counts"].items()}
        assert local["kind"] == "local" and local["trained_by"] == rank
        assert (
            local["weights"] == pytest.approx(mix) and "dropped" not in local
        )  # digits' test has every class
        for metrics, by_class in ((local["merged"], merged), (local["ranks"][rank], own[rank])):
            for metric in ("accuracy", "loss"):
                expected = sum(w * by_class[label][metric] for label, w in mix.items())
                assert metrics[metric] == pytest.approx(expected, rel=1e-6)
        assert evaluation[f"local_accuracy_merged_rank_{rank}"] == local["merged"]["accuracy"]
        assert evaluation[f"local_accuracy_rank_{rank}"] == local["ranks"][rank]["accuracy"]
        assert set(local) == {"kind", "path", "rows", "trained_by", "weights", "merged", "ranks", "ensemble"}
    merged_local = [evaluation[f"local_accuracy_merged_rank_{rank}"] for rank in (0, 1)]
    own_local = [evaluation[f"local_accuracy_rank_{rank}"] for rank in (0, 1)]
    assert evaluation["local_accuracy_merged_mean"] == pytest.approx(sum(merged_local) / 2)
    assert evaluation["local_accuracy_merged_worst"] == min(merged_local)
    assert evaluation["normalized_accuracy"] == pytest.approx(
        sum(m / o for m, o in zip(merged_local, own_local, strict=True)) / 2
    )


def test_the_global_scores_are_bitwise_those_of_an_evaluation_without_local_sets(dirichlet):
    _, _, evaluation, plain = dirichlet
    without = {k: v for k, v in evaluation.items() if not k.startswith(("local_", "normalized_"))}
    without["sets"] = {name: entry for name, entry in evaluation["sets"].items() if name == "test"}
    assert without == plain
    assert (
        list(evaluation)[-1] == "sets"
        and list(evaluation).index("normalized_accuracy") == len(evaluation) - 2
    )


def test_a_shard_set_that_is_not_the_trainings_or_is_iid_is_refused(dirichlet, digits_dataset, digits_shards):
    root, _, _, _ = dirichlet
    other = root / "other-shards"
    stage_ok(
        "partition", "--input", digits_dataset / "train.parquet", "--world-size", 2, "--seed", 1,
        "--partitioner", "dirichlet", "--params-json", '{"alpha": 0.5}', "--out-dir", other,
    )  # fmt: skip
    status, stderr, _ = evaluate_on_shard_set(
        root, digits_dataset, other, "--set", f"local={other}/manifest.json"
    )
    assert status == 2 and stderr.count("\n") == 1
    assert "but its model trained on" in stderr and "the shard set is not the training's" in stderr
    status, stderr, _ = evaluate_on_shard_set(root, digits_dataset, other, "--set", f"local={digits_shards}")
    assert status == 2
    assert "is partitioned iid, whose ranks have no local test distribution but the global one" in stderr


def test_local_scores_reach_summary_csv_the_fusion_plot_and_mlflow(dirichlet, track_store, tmp_path):
    _, _, evaluation, _ = dirichlet
    local = {k: v for k, v in evaluation.items() if k.startswith(("local_", "normalized_"))}
    run_dir, manifest = make_run_dir(tmp_path, "skewed", training="skewed")
    recorded = json.loads((run_dir / "eval.json").read_text())
    (run_dir / "eval.json").write_text(json.dumps({**recorded, **local}))
    iid_dir, _ = make_run_dir(tmp_path, "iid", training="iid")

    runs = {
        run: {"training": run, "dataset": "d", "world_size": 2, "strategy": "ddp", "sync_every": 0}
        for run in ("iid", "skewed")
    }
    csv_path = tmp_path / "summary.csv"
    summary.write_summary(runs, tmp_path / "results" / "runs", tmp_path / "results" / "trainings", csv_path)
    with csv_path.open() as fh:
        header, *rows = list(csv.reader(fh))
    assert header[-3:] == list(LOCAL) and header[: -len(LOCAL)] == list(
        summary.summary_columns(["classification"])
    )
    iid_row, skewed_row = (dict(zip(header, row, strict=True)) for row in rows)
    assert [float(skewed_row[column]) for column in LOCAL] == [local[column] for column in LOCAL]
    assert [iid_row[column] for column in LOCAL] == ["", "", ""]

    figure = plot_fusion(EvalRecord.read(run_dir / "eval.json"), "skewed", tmp_path / "fusion.png")
    assert (
        matplotlib.image.imread(figure).shape[1]
        > matplotlib.image.imread(
            plot_fusion(EvalRecord.read(iid_dir / "eval.json"), "iid", tmp_path / "fusion-iid.png")
        ).shape[1]
    )  # the local panel beside the global one

    training = tmp_path / "results" / "trainings" / "skewed"
    config = run_config("skewed")
    track_sync.track_run(
        "skewed", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT,
        train_dir=training / "ranks", gather_path=training / "gather.json",
    )  # fmt: skip
    (parent,), children = active_runs(track_store, "skewed")
    assert {key: parent.data.metrics[key] for key in local} == local
    by_rank = {child.info.run_name: child.data.metrics for child in children}
    for rank in (0, 1):
        child = by_rank[f"skewed/rank-{rank}"]
        assert child["local_accuracy"] == local[f"local_accuracy_rank_{rank}"]
        assert child["local_accuracy_merged"] == local[f"local_accuracy_merged_rank_{rank}"]
