"""What the MLflow UI shows of a pushed run besides its curves (shardfuse.track.ui, issue 17):
summary metrics at step 0, the training's times, Source and User, datasets as inputs, the logged model
named after its run with its metrics, the merge settings that were used, the plots at the artifact root;
and a second push of unchanged files writes none of it again."""

from __future__ import annotations

import getpass
import json
from pathlib import Path

import numpy as np
import pytest
from mlflow import MlflowClient

from shardfuse.experiment.records import MergeRecord
from shardfuse.track import sync as track_sync
from shardfuse.track import ui as tracking_ui
from shardfuse.track.provenance import LAYOUT_VERSION
from tests.support.tracking import T0_MS, make_run_dir, remerge

EXPERIMENT = "shardfuse-ui-items"
NUM_STEPS = 40


def flat_config(run_name: str, method: str) -> dict:
    """A run config as the workflow passes it (config.run_config_for_tracking): flat merge_* keys."""
    return {
        "run": run_name, "dataset": "synthetic", "world_size": 2, "strategy": "ddp", "lr": 0.05,
        "merge_method": method, "merge_weights": None, "merge_scale": 1.0, "merge_density": None,
        "merge_t": 0.5, "merge_seed": 0, "merge_align": "none",
    }  # fmt: skip


@pytest.fixture(scope="module")
def pushed(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-items")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment(EXPERIMENT, artifact_location=str(root / "artifacts"))
    run_dir, manifest = make_run_dir(root, "ties_run", num_steps=NUM_STEPS, ddp_baseline=True)
    remerge(run_dir, "ties", params={"density": 0.2, "scale": 1.0})
    plots = run_dir / "plots"
    plots.mkdir()
    (plots / "fusion.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(100))
    snakefile = root / "Snakefile"
    snakefile.write_text("# the workflow\n")
    args = (manifest, flat_config("ties_run", "ties"), uri, EXPERIMENT)
    kwargs = {"plots_dir": plots, "snakefile": snakefile}
    first = track_sync.track_run("ties_run", run_dir, *args, **kwargs)

    def again():
        return track_sync.track_run("ties_run", run_dir, *args, **kwargs)

    return {"client": client, "first": first, "again": again, "snakefile": snakefile, "root": root}


def test_summary_metrics_are_at_step_0_and_curves_keep_their_steps(pushed):
    client, first = pushed["client"], pushed["first"]
    merged = client.get_metric_history(first["parent_run_id"], "test_accuracy_merged")
    assert [(m.step, m.value) for m in merged] == [(0, pytest.approx(0.8))]
    assert {m.step for m in client.get_metric_history(first["parent_run_id"], "ddp_gap")} == {0}
    for child_id in first["child_run_ids"].values():
        assert [m.step for m in client.get_metric_history(child_id, "test_accuracy")] == [0]
        assert sorted(m.step for m in client.get_metric_history(child_id, "loss")) == list(range(NUM_STEPS))


def test_run_times_are_the_trainings_and_source_user_training_tags_are_set(pushed):
    client, first = pushed["client"], pushed["first"]
    parent = client.get_run(first["parent_run_id"])
    last_step_ms = T0_MS + 250 * (NUM_STEPS - 1)
    assert parent.info.end_time == last_step_ms
    assert parent.info.start_time == last_step_ms - 12_500  # train.json's train_seconds
    for child_id in first["child_run_ids"].values():
        child = client.get_run(child_id)
        assert (child.info.start_time, child.info.end_time) == (T0_MS, last_step_ms)
        assert child.data.tags["mlflow.user"] == getpass.getuser()
    tags = parent.data.tags
    assert tags["mlflow.source.name"] == str(pushed["snakefile"].resolve())
    assert tags["mlflow.source.type"] == "LOCAL"
    assert tags["mlflow.user"] == getpass.getuser()
    assert tags["shardfuse.training"] == "ties_run" and tags["shardfuse.layout"] == LAYOUT_VERSION


def test_params_show_the_merge_settings_the_method_used(pushed):
    params = pushed["client"].get_run(pushed["first"]["parent_run_id"]).data.params
    assert params["merge_method"] == "ties"
    assert params["merge_density"] == "0.2"  # resolved by the merge stage, not the config's None
    assert params["merge_scale"] == "1.0"
    assert not {"merge_t", "merge_seed", "merge_weights"} & set(params)  # ties takes none of them
    assert params["merge_align"] == "none" and params["lr"] == "0.05"  # not a method parameter: kept


def test_datasets_are_run_inputs_with_digest_schema_and_rows(pushed):
    client, first = pushed["client"], pushed["first"]
    info = json.loads((pushed["root"] / "results" / "datasets" / "synthetic" / "dataset.json").read_text())
    parent = client.get_run(first["parent_run_id"])
    found = {d.dataset.name: d for d in parent.inputs.dataset_inputs}
    assert set(found) == {"synthetic", "synthetic-test"}
    train, test = found["synthetic"], found["synthetic-test"]
    assert train.dataset.digest == info["sha256"]["train"][:36]
    assert json.loads(train.dataset.profile)["sha256"] == info["sha256"]["train"]
    assert json.loads(train.dataset.profile)["num_rows"] == 719 + 720
    assert json.loads(test.dataset.profile)["num_rows"] == 300
    columns = json.loads(train.dataset.schema)["mlflow_colspec"]
    assert columns[0] == {"name": "x0", "type": "float"} and columns[-1] == {"name": "label", "type": "long"}
    assert {t.key: t.value for t in train.tags}["mlflow.data.context"] == "training"
    assert {t.key: t.value for t in test.tags}["mlflow.data.context"] == "evaluation"
    for rank, child_id in first["child_run_ids"].items():
        (shard,) = client.get_run(child_id).inputs.dataset_inputs
        assert shard.dataset.name == f"synthetic-shard-{rank}-of-2"
        assert json.loads(shard.dataset.profile)["num_rows"] == 719 + int(rank)


def test_model_is_named_after_the_run_and_carries_its_metrics_and_merge(pushed):
    client, first = pushed["client"], pushed["first"]
    model = client.get_logged_model(first["model_uri"].removeprefix("models:/"))
    assert model.name == "ties_run"
    metrics = {m.key: m for m in model.metrics}
    assert metrics["test_accuracy_merged"].value == pytest.approx(0.8)
    assert metrics["test_accuracy_merged"].dataset_name == "synthetic-test"
    assert "test_loss_merged" in metrics and "fusion_gain" not in metrics  # the model's own scores only
    assert model.params["merge_method"] == "ties" and model.params["merge_density"] == "0.2"
    assert model.params["training"] == "ties_run"


def test_plots_are_also_at_the_artifact_root(pushed):
    client, parent_id = pushed["client"], pushed["first"]["parent_run_id"]
    root = {a.path for a in client.list_artifacts(parent_id)}
    assert "fusion.png" in root and "plots" in root
    assert [a.path for a in client.list_artifacts(parent_id, "plots")] == ["plots/fusion.png"]


def test_a_second_push_of_unchanged_files_writes_nothing(pushed):
    client, first = pushed["client"], pushed["first"]

    def state():
        parent = client.get_run(first["parent_run_id"])
        points = sum(len(client.get_metric_history(parent.info.run_id, key)) for key in parent.data.metrics)
        inputs = len(parent.inputs.dataset_inputs)
        models = client.search_logged_models([parent.info.experiment_id])
        model_points = sum(len(m.metrics) for m in models)
        return parent.info.end_time, points, inputs, len(models), model_points, parent.data.tags

    before = state()
    again = pushed["again"]()
    assert again["action"] == "unchanged" and again["num_points_pushed"] == 0
    assert state() == before


def test_run_times_without_history_or_seconds():
    history = {0: {"timestamp_ms": np.array([5_000, 9_000])}, 1: {"timestamp_ms": np.array([4_000, 10_000])}}
    times = tracking_ui.run_times(history, 3.0)
    assert times.parent == (4_000, 10_000)  # the earliest step is before end - train_seconds
    assert tracking_ui.run_times(history, 60.0).parent == (10_000 - 60_000, 10_000)
    assert times.ranks == {0: (5_000, 9_000), 1: (4_000, 10_000)}
    assert tracking_ui.run_times({0: {"timestamp_ms": np.array([])}}, 1.0) == ((None), {})


def test_merge_params_keep_what_the_method_takes_and_name_greedy_soups_choice():
    config = {"merge_method": "greedy_soup", "merge_weights": "None", "merge_density": "None", "lr": "0.1"}
    merge = MergeRecord(method="greedy_soup", params={}, greedy_soup={"selected": [0, 2, 3]})
    assert tracking_ui.merge_params(config, merge) == {
        "merge_method": "greedy_soup", "lr": "0.1", "merge_greedy_soup_selected": "0,2,3",
    }  # fmt: skip
    weighted = MergeRecord(method="weighted", params={"weights": [1.0, 3.0]})
    assert tracking_ui.merge_params(config, weighted)["merge_weights"] == "[1.0, 3.0]"


def test_source_tags_fall_back_to_the_working_directory_snakefile(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    tags = tracking_ui.source_tags(None)
    assert tags["mlflow.source.name"] == str(Path(tmp_path / "Snakefile").resolve())
    assert "mlflow.source.git.repoURL" not in tags  # not a git checkout


def test_rank_system_metrics_become_system_series_of_the_child_and_node_peaks_of_the_parent(tmp_path):
    from shardfuse.metrics.system import read_system_metrics

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment(EXPERIMENT, artifact_location=str(tmp_path / "artifacts"))
    run_dir, manifest = make_run_dir(tmp_path, "sys_run", system_metrics=True)
    config = flat_config("sys_run", "uniform")
    result = track_sync.track_run("sys_run", run_dir, manifest, config, uri, EXPERIMENT)
    for rank, child_id in result["child_run_ids"].items():
        samples = read_system_metrics(run_dir / "train" / "metrics" / f"system-rank-{rank}.parquet")
        assert len(samples["system/process_rss_megabytes"]) >= 2
        child = client.get_run(child_id)
        assert child.data.tags["shardfuse.host"] == f"node{rank}"
        for name in ("system/cpu_utilization_percentage", "system/system_memory_usage_megabytes",
                     "system/process_rss_megabytes"):  # fmt: skip
            points = sorted(client.get_metric_history(child_id, name), key=lambda m: m.step)
            assert [(m.step, m.timestamp, m.value) for m in points] == [
                (i, int(t), pytest.approx(v)) for i, (t, v) in enumerate(samples[name])
            ]
    parent = client.get_run(result["parent_run_id"]).data.metrics
    rss = read_system_metrics(run_dir / "train" / "metrics" / "system-rank-1.parquet")[
        "system/process_rss_megabytes"
    ]
    assert parent["system/node1/peak_process_rss_megabytes"] == pytest.approx(rss[:, 1].max())
    again = track_sync.track_run("sys_run", run_dir, manifest, config, uri, EXPERIMENT)
    assert again["action"] == "unchanged" and again["num_points_pushed"] == 0
