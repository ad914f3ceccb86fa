"""shardfuse.tracking against a real MLflow SQLite track_store (no mocks of MLflow)."""

from __future__ import annotations

import json
import urllib.parse
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
from mlflow.entities import ViewType
from safetensors.torch import save_file

from shardfuse.checkpoints.weights import load_weights, read_metadata
from shardfuse.experiment.records import TrainRecord
from shardfuse.io import UserError
from shardfuse.models.registry import build_model
from shardfuse.track import client as mlflow_common
from shardfuse.track import inputs as tracking_inputs
from shardfuse.track import push as mlflow_sync
from shardfuse.track import series as track_series
from shardfuse.track import sync as track_sync
from shardfuse.track.push import ROWS_PER_BATCH
from tests.support.tracking import (
    NEW_TRAIN_FIELDS,
    NUM_FEATURES,
    T0_MS,
    TRACK_EXPERIMENT,
    VAL_EVERY,
    active_runs,
    append_steps,
    grad_norm,
    make_run_dir,
    metric_history,
    regression_evaluation,
    remerge,
    run_config,
    track_into,
    val_score,
)


def _edit_json(path: Path, **changes) -> None:
    obj = json.loads(path.read_text())
    obj.update(changes)
    path.write_text(json.dumps(obj))


def test_flatten_params_dots_nested_keys_and_stringifies_lists_and_none():
    params = tracking_inputs.flatten_params(
        {"model": {"name": "mlp", "hidden_sizes": [16, 8], "opt": {"lr": 0.1}}, "seed": 0, "path": None,
         "flag": True, "empty": {}}
    )  # fmt: skip
    assert params == {
        "model.name": "mlp",
        "model.hidden_sizes": "[16, 8]",
        "model.opt.lr": "0.1",
        "seed": "0",
        "path": "None",
        "flag": "True",
        "empty": "{}",
    }
    assert (
        len(tracking_inputs.flatten_params({"long": "x" * 10_000})["long"])
        == tracking_inputs.MAX_PARAM_VALUE_CHARS
    )


def test_track_creates_one_parent_with_config_params_headline_metrics_and_rank_histories(
    track_store, tmp_path
):
    run_name, world_size, num_steps = "fresh", 3, 400  # 3 x 400 points: more than one log_batch
    run_dir, manifest = make_run_dir(tmp_path, run_name, world_size=world_size, num_steps=num_steps)
    config = run_config(run_name, world_size=world_size)
    config["extra"] = {f"knob_{i}": i for i in range(150)}  # more params than one log_batch takes
    result = track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    client = track_store["client"]

    assert result["action"] == "created"
    assert result["experiment_id"] == track_store["experiment_id"]
    parents, children = active_runs(track_store, run_name)
    assert [p.info.run_id for p in parents] == [result["parent_run_id"]]
    parent = parents[0]
    assert parent.info.run_name == run_name
    assert parent.info.status == "FINISHED"
    assert parent.data.tags["shardfuse.complete"] == "true"
    assert parent.data.tags["shardfuse.fingerprint"] == result["fingerprint"]
    # The config, and the mode an old train.json (no mode field) amounts to.
    assert parent.data.params == {**tracking_inputs.flatten_params(config), "mode": "ddp"}
    assert parent.data.params["merge.weights"] == "None"
    assert parent.data.params["model.hidden_sizes"] == "[16, 16]"

    evaluation = json.loads((run_dir / "eval.json").read_text())
    metrics = parent.data.metrics
    assert metrics["test_accuracy_merged"] == pytest.approx(0.8)
    assert metrics["test_loss_merged"] == pytest.approx(0.5)
    assert metrics["test_accuracy_best_rank"] == pytest.approx(0.74)
    assert metrics["fusion_gain"] == pytest.approx(0.8 - 0.74)
    assert metrics["test_accuracy_mean_rank"] == pytest.approx(evaluation["mean_rank_accuracy"])
    assert metrics["test_loss_mean_rank"] == pytest.approx(evaluation["mean_rank_loss"])
    assert metrics["train_seconds"] == pytest.approx(12.5)
    assert metrics["merge_seconds"] == pytest.approx(0.25)
    assert "bytes_all_reduced_per_rank" not in metrics  # unknown in an old train.json: not 0
    # How heterogeneous the shards are: from the manifest's rows (no label counts here: no label JSD).
    rows = np.array([719 + rank for rank in range(world_size)])
    assert metrics["shard_rows_cv"] == pytest.approx(rows.std() / rows.mean())
    assert "shard_label_jsd_mean" not in metrics
    for rank in range(world_size):
        assert metrics[f"test_accuracy_rank_{rank}"] == pytest.approx(0.70 + 0.02 * rank)

    assert len(children) == world_size
    assert result["child_run_ids"] == {c.data.tags["shardfuse.rank"]: c.info.run_id for c in children}
    assert list(result["child_run_ids"]) == [str(r) for r in range(world_size)]
    for child in children:
        rank = int(child.data.tags["shardfuse.rank"])
        assert child.info.run_name == f"{run_name}/rank-{rank}"
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert child.info.status == "FINISHED"
        assert child.data.params == {"rank": str(rank), "shard_rows": str(719 + rank)}
        assert child.data.metrics["test_accuracy"] == pytest.approx(0.70 + 0.02 * rank)
        assert child.data.metrics["test_loss"] == pytest.approx(0.6 + 0.05 * rank)
        # Metrics files and train.json of a training from before grad_norm, validation and published_step.
        assert set(child.data.metrics) == {"loss", "samples_per_second", "lr", "test_accuracy", "test_loss"}
        for key in ("loss", "samples_per_second", "lr"):
            history = sorted(client.get_metric_history(child.info.run_id, key), key=lambda m: m.step)
            assert [m.step for m in history] == list(range(num_steps))
            assert [m.timestamp for m in history] == [1_700_000_000_000 + 250 * s for s in range(num_steps)]
        losses = sorted(client.get_metric_history(child.info.run_id, "loss"), key=lambda m: m.step)
        assert losses[3].value == pytest.approx(1.1 - 0.3 - 0.01 * rank)

    artifacts = {f.path for f in client.list_artifacts(parent.info.run_id, "results")}
    assert artifacts == {
        "results/manifest.json", "results/train.json", "results/gather.json", "results/merge.json",
        "results/eval.json",
    }  # fmt: skip
    (model,) = client.search_logged_models(
        [track_store["experiment_id"]], f"source_run_id = '{parent.info.run_id}'"
    )
    assert result["model_uri"] == f"models:/{model.model_id}" and model.name == run_name


def test_regression_run_carries_its_mse_r2_and_rank_scores_and_no_accuracy(track_store, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "regressed", ddp_baseline=True)
    (run_dir / "eval.json").write_text(json.dumps(regression_evaluation("regressed", ddp_baseline=True)))
    result = track_sync.track_run(
        "regressed", run_dir, manifest, run_config("regressed"), track_store["uri"], TRACK_EXPERIMENT
    )
    metrics = track_store["client"].get_run(result["parent_run_id"]).data.metrics
    assert not [name for name in metrics if "accuracy" in name]
    assert metrics["test_mse_merged"] == pytest.approx(0.25)
    assert metrics["test_r2_merged"] == pytest.approx(0.75)
    assert metrics["test_mse_best_rank"] == pytest.approx(0.30)
    assert metrics["test_mse_ddp_baseline"] == pytest.approx(0.22)
    assert metrics["fusion_gain"] == pytest.approx(0.05)  # lower mse than the best rank: positive
    for rank, child_id in result["child_run_ids"].items():
        child = track_store["client"].get_run(child_id).data.metrics
        assert metrics[f"test_mse_rank_{rank}"] == pytest.approx(child["test_mse"])
        assert {"test_loss", "test_mse", "test_mae", "test_r2"} <= set(child)


def test_second_track_with_identical_inputs_keeps_run_and_does_not_duplicate_history(track_store, tmp_path):
    first, run_dir, manifest, config = track_into(track_store, tmp_path, "rerun")
    second = track_sync.track_run("rerun", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)

    assert second["action"] == "unchanged"
    assert second["num_points_pushed"] == 0
    changing = ("action", "num_points_pushed")
    assert {k: v for k, v in second.items() if k not in changing} == {
        k: v for k, v in first.items() if k not in changing
    }
    parents, children = active_runs(track_store, "rerun")
    assert [p.info.run_id for p in parents] == [first["parent_run_id"]]
    assert len(children) == 2
    for child_id in second["child_run_ids"].values():
        assert len(track_store["client"].get_metric_history(child_id, "loss")) == 7
    deleted_parents, deleted_children = active_runs(track_store, "rerun", ViewType.DELETED_ONLY)
    assert deleted_parents == deleted_children == []


def test_changed_merge_method_replaces_parent_and_deletes_old_runs(track_store, tmp_path):
    first, run_dir, manifest, config = track_into(track_store, tmp_path, "remerged")
    remerge(run_dir, "fisher")
    config["merge"]["method"] = "fisher"  # params are immutable in MLflow: a new config is a new parent
    second = track_sync.track_run("remerged", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)

    assert second["action"] == "replaced"
    assert second["parent_run_id"] != first["parent_run_id"]
    assert second["fingerprint"] != first["fingerprint"]
    parents, children = active_runs(track_store, "remerged")
    assert [p.info.run_id for p in parents] == [second["parent_run_id"]]
    assert sorted(c.info.run_id for c in children) == sorted(second["child_run_ids"].values())
    for old_id in [first["parent_run_id"], *first["child_run_ids"].values()]:
        assert track_store["client"].get_run(old_id).info.lifecycle_stage == "deleted"


def test_interrupted_track_resumes_on_next_run_without_losing_or_doubling_points(
    track_store, tmp_path, monkeypatch
):
    run_name, num_steps = "crashed", 700  # 3 batches per rank
    run_dir, manifest = make_run_dir(tmp_path, run_name, num_steps=num_steps)
    config = run_config(run_name)
    original = track_sync.sync_history

    def killed_after_one_batch(client, run_id, rows, start):
        original(client, run_id, rows[: start + ROWS_PER_BATCH], start)
        raise KeyboardInterrupt  # as if the job were killed while pushing rank 0's history

    with monkeypatch.context() as patch:
        patch.setattr(track_sync, "sync_history", killed_after_one_batch)
        with pytest.raises(KeyboardInterrupt):
            track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    (interrupted,), (partial,) = active_runs(track_store, run_name)
    assert interrupted.info.status == "FAILED"
    assert interrupted.data.tags["shardfuse.complete"] == "false"
    assert len(track_store["client"].get_metric_history(partial.info.run_id, "loss")) == ROWS_PER_BATCH

    result = track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert result["action"] == "updated"
    parents, children = active_runs(track_store, run_name)
    # The rest of the histories, each rank's two test metrics and the parent's headline metrics (logged
    # after the ranks, so the interrupted push had none of them).
    num_headline = len(parents[0].data.metrics)
    assert result["num_points_pushed"] == 3 * (2 * num_steps - ROWS_PER_BATCH) + 2 * 2 + num_headline
    assert [p.info.run_id for p in parents] == [interrupted.info.run_id] == [result["parent_run_id"]]
    assert parents[0].data.tags["shardfuse.complete"] == "true"
    assert parents[0].info.status == "FINISHED"
    assert result["child_run_ids"]["0"] == partial.info.run_id
    for child in children:
        for key in track_series.STEP_METRICS:
            history = track_store["client"].get_metric_history(child.info.run_id, key)
            assert sorted(m.step for m in history) == list(range(num_steps))


def test_missing_eval_json_is_a_user_error_naming_the_evaluate_stage(track_store, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "noeval")
    (run_dir / "eval.json").unlink()
    with pytest.raises(UserError, match=r"eval\.json does not exist; re-run the evaluate stage"):
        track_sync.track_run(
            "noeval", run_dir, manifest, run_config("noeval"), track_store["uri"], TRACK_EXPERIMENT
        )
    assert active_runs(track_store, "noeval") == ([], [])


def test_reading_a_checkpoint_without_shardfuse_metadata_is_a_user_error(tmp_path):
    path = tmp_path / "foreign.safetensors"
    save_file({"w": torch.zeros(2)}, str(path))
    with pytest.raises(UserError, match=r"foreign\.safetensors has no shardfuse metadata"):
        read_metadata(path)
    path.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(UserError, match=r"not a readable safetensors file"):
        read_metadata(path)


def test_more_training_steps_append_only_the_new_points_to_the_same_runs(track_store, tmp_path):
    first, run_dir, manifest, config = track_into(track_store, tmp_path, "grown")
    append_steps(run_dir / "train", 5)
    _edit_json(run_dir / "train" / "train.json", num_steps=12)
    evaluation = json.loads((run_dir / "eval.json").read_text())
    evaluation["merged"]["accuracy"] = 0.85
    (run_dir / "eval.json").write_text(json.dumps(evaluation))

    second = track_sync.track_run("grown", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert second["action"] == "updated"
    assert (second["parent_run_id"], second["child_run_ids"]) == (
        first["parent_run_id"],
        first["child_run_ids"],
    )
    for child_id in second["child_run_ids"].values():
        for key in track_series.STEP_METRICS:
            points = track_store["client"].get_metric_history(child_id, key)
            assert sorted(m.step for m in points) == list(range(12))  # 7 old + 5 new, none twice
        assert [s for s, _ in metric_history(track_store, child_id, "test_accuracy")] == [
            0
        ]  # unchanged: not re-logged
    # Summary metrics stay at step 0 (the chart view's bars); the newer point is the later one.
    assert metric_history(track_store, second["parent_run_id"], "test_accuracy_merged") == [
        (0, 0.8),
        (0, 0.85),
    ]
    latest = track_store["client"].get_run(second["parent_run_id"]).data.metrics["test_accuracy_merged"]
    assert latest == pytest.approx(0.85)
    parents, _ = active_runs(track_store, "grown")
    assert parents[0].data.metrics["test_accuracy_merged"] == pytest.approx(0.85)
    new_points = 2 * 5 * len(track_series.STEP_METRICS)
    assert new_points < second["num_points_pushed"] <= new_points + 12  # + changed headline metrics
    third = track_sync.track_run("grown", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert (third["action"], third["num_points_pushed"]) == ("unchanged", 0)


def test_rewritten_history_with_the_same_config_replaces_the_runs(track_store, tmp_path):
    first, run_dir, manifest, config = track_into(track_store, tmp_path, "retrained")
    path = run_dir / "train" / "metrics" / "rank-1.parquet"
    table = pq.read_table(path)
    pq.write_table(table.set_column(2, "loss", pa.array(table.column("loss").to_numpy() + 0.5)), path)
    second = track_sync.track_run(
        "retrained", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    assert second["action"] == "replaced"
    assert track_store["client"].get_run(first["parent_run_id"]).info.lifecycle_stage == "deleted"
    losses = metric_history(track_store, second["child_run_ids"]["1"], "loss")
    assert [s for s, _ in losses] == list(range(7)) and losses[0][1] == pytest.approx(1.1 - 0.01 + 0.5)


def test_merged_model_loads_with_pyfunc_predicts_like_the_weights_and_is_registered_once(
    track_store, tmp_path, monkeypatch
):
    name = "shardfuse-merged"
    result, run_dir, manifest, config = track_into(
        track_store, tmp_path, "served", {"registered_model": name}
    )
    assert result["registered_model"] == f"{name}/1"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", track_store["uri"])
    features = pd.DataFrame(
        np.random.default_rng(0).normal(size=(50, NUM_FEATURES)),
        columns=[f"x{i}" for i in range(NUM_FEATURES)],
    )
    tensors, metadata = load_weights(run_dir / "merged.safetensors")
    reference = build_model(metadata["model"])
    reference.load_state_dict(tensors)
    with torch.no_grad():
        expected = torch.softmax(reference.eval()(torch.tensor(features.to_numpy(), dtype=torch.float32)), 1)
    for uri in (f"runs:/{result['parent_run_id']}/served", result["model_uri"], f"models:/{name}/1"):
        predicted = mlflow.pyfunc.load_model(uri).predict(features)
        assert predicted["prediction"].tolist() == expected.argmax(1).tolist()
        probabilities = predicted[[f"probability_{c}" for c in range(3)]].to_numpy()
        np.testing.assert_allclose(probabilities, expected.numpy(), rtol=1e-5, atol=1e-6)

    _edit_json(run_dir / "eval.json", best_rank_accuracy=0.75)  # new results, same weights
    again = track_sync.track_run(
        "served", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT, registered_model=name
    )
    assert again["action"] == "updated"
    assert (again["model_uri"], again["registered_model"]) == (result["model_uri"], f"{name}/1")
    assert len(track_store["client"].search_model_versions(f"name = '{name}'")) == 1
    models = track_store["client"].search_logged_models(
        [track_store["experiment_id"]], f"source_run_id = '{result['parent_run_id']}'"
    )
    assert len(models) == 1
    # What mlflow.pyfunc.log_model writes, though the model is logged without loading it (no torch);
    # registered_model_meta is written by the loads from models:/NAME/1 above.
    location = urllib.parse.urlparse(models[0].artifact_location).path
    assert {p.name for p in Path(location).iterdir()} - {"registered_model_meta"} == {
        "MLmodel", "conda.yaml", "python_env.yaml", "requirements.txt", "input_example.json",
        "serving_input_example.json", "data", "code",
    }  # fmt: skip


def test_plots_dir_pngs_become_artifacts_and_a_missing_dir_is_skipped(track_store, tmp_path):
    plots = tmp_path / "plots"
    plots.mkdir()
    for name in ("loss.png", "fusion.png"):
        (plots / name).write_bytes(b"\x89PNG fake " + name.encode())
    result, *_ = track_into(track_store, tmp_path, "plotted", {"plots_dir": plots})
    listed = {f.path for f in track_store["client"].list_artifacts(result["parent_run_id"], "plots")}
    assert listed == {"plots/loss.png", "plots/fusion.png"}
    result, *_ = track_into(track_store, tmp_path / "other", "unplotted", {"plots_dir": tmp_path / "missing"})
    assert track_store["client"].list_artifacts(result["parent_run_id"], "plots") == []


def test_a_password_in_the_tracking_uri_is_refused_before_anything_is_sent(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "leaky")
    uri = "http://alice:s3cret@127.0.0.1:1"
    with pytest.raises(
        UserError, match=r"http://\*\*\*@127.0.0.1:1 has a password in it; .* MLFLOW_TRACKING_PASSWORD"
    ) as err:
        track_sync.track_run("leaky", run_dir, manifest, run_config("leaky"), uri, TRACK_EXPERIMENT)
    assert "s3cret" not in str(err.value)


def test_redact_uri_hides_user_and_password():
    assert mlflow_common.redact_uri("http://alice:s3cret@127.0.0.1:5055") == "http://***@127.0.0.1:5055"
    assert mlflow_common.redact_uri("postgresql://u:p@h/db?x=1") == "postgresql://***@h/db?x=1"
    assert mlflow_common.redact_uri("sqlite:///mlflow.db") == "sqlite:///mlflow.db"


def _points(track_store, run_id, key):
    """(step, timestamp, value) of every point of ``key``, in step order."""
    history = track_store["client"].get_metric_history(run_id, key)
    return sorted((m.step, m.timestamp, m.value) for m in history)


def _expected_series(rank, num_steps, values):
    """The (step, timestamp, value) points of a fixture column: its finite steps only."""
    return [
        (step, T0_MS + 250 * step, pytest.approx(float(values(rank, step))))
        for step in range(num_steps)
        if np.isfinite(values(rank, step))
    ]


def test_new_train_fields_become_parent_params_a_bytes_metric_and_sparse_rank_series(track_store, tmp_path):
    run_name, num_steps = "diloco", 11
    result, run_dir, _, config = track_into(
        track_store, tmp_path, run_name, num_steps=num_steps, new_train_fields=True
    )
    parent = track_store["client"].get_run(result["parent_run_id"])
    new_params = {
        "mode": "diloco", "grad_accum_steps": "2", "effective_batch_size": "128", "init": "shared",
        "keep": "best",
    }  # fmt: skip
    assert parent.data.params == {**tracking_inputs.flatten_params(config), **new_params}
    assert parent.data.metrics["bytes_all_reduced_per_rank"] == 123_456_789
    for rank, child_id in result["child_run_ids"].items():
        rank = int(rank)
        grad_norms = _points(track_store, child_id, "grad_norm")
        assert grad_norms == _expected_series(rank, num_steps, grad_norm)
        assert len(grad_norms) == num_steps - (rank == 1)  # rank 1's NaN at step 0 is left out
        validations = _points(track_store, child_id, "val_accuracy")  # train.json's validation score names it
        assert [step for step, _, _ in validations] == [2, 5, 8]
        assert validations == _expected_series(rank, num_steps, val_score)
        metrics = track_store["client"].get_run(child_id).data.metrics
        assert metrics["published_step"] == num_steps - 1 - rank
        assert ("best_val_score" in metrics) == (rank == 0)  # rank 1's is null: not logged
        assert metrics.get("best_val_score", 0.77) == pytest.approx(0.77)
        assert "val_score" not in metrics

    manifest = tmp_path / "results/shards/synthetic/w2-seed0/manifest.json"
    again = track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert (again["action"], again["num_points_pushed"]) == ("unchanged", 0)
    for child_id in again["child_run_ids"].values():
        assert len(_points(track_store, child_id, "val_accuracy")) == 3


def test_more_steps_append_only_the_new_grad_norm_and_validation_points(track_store, tmp_path):
    first, run_dir, manifest, config = track_into(track_store, tmp_path, "grown_val", new_train_fields=True)
    append_steps(run_dir / "train", 5)  # steps 7..11: validations at 8 and 11
    train_json = run_dir / "train" / "train.json"
    ranks = json.loads(train_json.read_text())["ranks"]
    ranks[0]["published_step"] = 11  # rank 0 now publishes its last step; rank 1 keeps step 5
    _edit_json(train_json, num_steps=12, ranks=ranks)
    second = track_sync.track_run(
        "grown_val", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    assert second["action"] == "updated" and second["child_run_ids"] == first["child_run_ids"]
    # Per rank 5 rows of 3 step metrics, 5 grad norms, 2 validations; rank 0's published_step; the
    # parent's samples_per_second (a mean over more steps).
    assert second["num_points_pushed"] == 2 * (5 * 3 + 5 + 2) + 1 + 1
    for rank, child_id in second["child_run_ids"].items():
        assert [s for s, _, _ in _points(track_store, child_id, "val_accuracy")] == [2, 5, 8, 11]
        assert len(_points(track_store, child_id, "grad_norm")) == 12 - (rank == "1")
        published = [(s, v) for s, _, v in _points(track_store, child_id, "published_step")]
        assert published == ([(0, 6.0), (0, 11.0)] if rank == "0" else [(0, 5.0)])
    third = track_sync.track_run("grown_val", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert (third["action"], third["num_points_pushed"]) == ("unchanged", 0)


def test_interrupted_series_push_resumes_without_losing_or_doubling_points(
    track_store, tmp_path, monkeypatch
):
    run_name, num_steps = "crashed_val", 2500  # grad_norm: 3 log_batches of 1000 points per rank
    run_dir, manifest = make_run_dir(tmp_path, run_name, num_steps=num_steps, new_train_fields=True)
    config = run_config(run_name)
    original = track_sync.log_batches

    def killed_after_one_grad_norm_batch(client, run_id, metrics=(), params=(), tags=()):
        metrics = list(metrics)
        if metrics and metrics[0].key == "grad_norm":
            original(client, run_id, metrics=metrics[:1000])
            raise KeyboardInterrupt  # as if the job were killed while pushing rank 0's grad norms
        original(client, run_id, metrics=metrics, params=params, tags=tags)

    with monkeypatch.context() as patch:
        patch.setattr(track_sync, "log_batches", killed_after_one_grad_norm_batch)
        patch.setattr(mlflow_sync, "log_batches", killed_after_one_grad_norm_batch)  # the series' pushes
        with pytest.raises(KeyboardInterrupt):
            track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    (_,), (partial,) = active_runs(track_store, run_name)
    assert len(_points(track_store, partial.info.run_id, "grad_norm")) == 1000

    result = track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert result["action"] == "updated" and result["child_run_ids"]["0"] == partial.info.run_id
    for rank, child_id in result["child_run_ids"].items():
        assert _points(track_store, child_id, "grad_norm") == _expected_series(
            int(rank), num_steps, grad_norm
        )
        assert len(_points(track_store, child_id, "val_accuracy")) == num_steps // VAL_EVERY
    again = track_sync.track_run(run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT)
    assert (again["action"], again["num_points_pushed"]) == ("unchanged", 0)


def test_a_rewritten_validation_series_or_changed_train_param_replaces_the_runs(track_store, tmp_path):
    _, run_dir, manifest, config = track_into(track_store, tmp_path, "revalidated", new_train_fields=True)
    path = run_dir / "train" / "metrics" / "rank-0.parquet"
    table = pq.read_table(path)
    index = table.schema.get_field_index("val_score")
    pq.write_table(table.set_column(index, "val_score", pa.array(table["val_score"].to_numpy() - 0.1)), path)
    second = track_sync.track_run(
        "revalidated", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    assert second["action"] == "replaced"  # loss, lr, throughput unchanged: only the series says so
    assert _points(track_store, second["child_run_ids"]["0"], "val_accuracy")[0][2] == pytest.approx(0.42)

    _edit_json(run_dir / "train" / "train.json", mode="localsgd")  # MLflow params cannot change
    third = track_sync.track_run(
        "revalidated", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    assert third["action"] == "replaced"
    assert track_store["client"].get_run(third["parent_run_id"]).data.params["mode"] == "localsgd"
    assert track_store["client"].get_run(second["parent_run_id"]).info.lifecycle_stage == "deleted"


def test_config_keys_win_over_train_json_params_of_the_same_name(track_store, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "configured", new_train_fields=True)
    config = {**run_config("configured"), "grad_accum_steps": 2, "keep": "best", "init": "shared"}
    result = track_sync.track_run(
        "configured", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    params = track_store["client"].get_run(result["parent_run_id"]).data.params
    assert (params["grad_accum_steps"], params["keep"], params["mode"]) == ("2", "best", "diloco")
    again = track_sync.track_run(
        "configured", run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT
    )
    assert again["action"] == "unchanged"


def test_step_series_keep_finite_points_and_name_validation_after_the_score():
    steps = np.arange(6)
    history = {
        "step": steps,
        "timestamp_ms": T0_MS + 10 * steps,
        "grad_norm": np.array([1, np.nan, 3, np.inf, 5, 6.0]),
        "val_score": np.array([np.nan, np.nan, 0.5, np.nan, np.nan, 0.7]),
    }
    series = track_series.step_series(history, "val_mse")
    assert series["grad_norm"].tolist() == [[0, T0_MS, 1], [2, T0_MS + 20, 3], [4, T0_MS + 40, 5],
                                            [5, T0_MS + 50, 6]]  # fmt: skip
    assert series["val_mse"].tolist() == [[2, T0_MS + 20, 0.5], [5, T0_MS + 50, 0.7]]
    history["grad_norm"][:] = np.nan  # clipping off in an old trainer, no validation: no series at all
    assert track_series.step_series({**history, "val_score": history["grad_norm"]}, "val_mse") == {}
    assert track_series.step_series({"step": steps, "timestamp_ms": steps}, "val_mse") == {}

    def validation(train_json: dict, default_score: str) -> str:
        return track_series.validation_metric(TrainRecord.from_json(train_json), default_score)

    assert validation({"validation": {"score": "loss", "every": 5}}, "accuracy") == "val_loss"
    assert validation({"validation": None}, "mse") == validation({}, "mse") == "val_mse"


def test_train_params_and_rank_metrics_take_what_train_json_has_and_skip_nulls():
    def train_params(train_json: dict) -> dict[str, str]:
        return tracking_inputs.train_params(TrainRecord.from_json(train_json))

    train = {**NEW_TRAIN_FIELDS, "init": None, "world_size": 2}
    assert train_params(train) == {
        "mode": "diloco", "grad_accum_steps": "2", "effective_batch_size": "128", "keep": "best",
    }  # fmt: skip
    # A train.json from before the mode field: derived from strategy and sync_every.
    assert train_params({"strategy": "ddp"}) == {"mode": "ddp"}
    assert train_params({"strategy": "localsgd", "sync_every": 0}) == {"mode": "independent"}
    assert train_params({"strategy": "localsgd", "sync_every": 8}) == {"mode": "localsgd"}
    assert train_params({}) == {}
    metrics = tracking_inputs.rank_train_metrics
    assert metrics({"rank": 0, "published_step": 40, "best_val_score": 0.5}) == {
        "published_step": 40.0, "best_val_score": 0.5,
    }  # fmt: skip
    assert metrics({"rank": 0, "published_step": 40, "best_val_score": None}) == {"published_step": 40.0}
    assert metrics({"rank": 0, "rows": 10}) == {}


def test_old_metrics_files_read_without_the_new_columns(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "old")
    history = track_series.read_step_metrics(run_dir / "train" / "metrics" / "rank-0.parquet")
    assert set(history) == {"step", "loss", "samples_per_second", "lr", "timestamp_ms"}
    new_dir, _ = make_run_dir(tmp_path / "new", "new", new_train_fields=True)
    history = track_series.read_step_metrics(new_dir / "train" / "metrics" / "rank-1.parquet")
    assert np.isnan(history["grad_norm"][0]) and history["grad_norm"][1] == pytest.approx(2.11)
    assert np.isfinite(history["val_score"]).sum() == 2  # 7 steps: validated at 2 and 5


def test_a_run_named_with_a_dot_logs_its_model_under_a_name_mlflow_accepts(track_store, tmp_path):
    # A sweep names runs by their value (a0.5_ddp); MLflow refuses '.' in a logged model's name.
    result, *_ = track_into(track_store, tmp_path, "a0.5_ddp")
    parent = track_store["client"].get_run(result["parent_run_id"])
    assert parent.info.run_name == "a0.5_ddp"
    (model,) = track_store["client"].search_logged_models(
        [track_store["experiment_id"]], f"source_run_id = '{parent.info.run_id}'"
    )
    assert model.name == "a0_5_ddp" and result["model_uri"] == f"models:/{model.model_id}"
