"""A track that fails (or is killed) while MLflow logs the merged model leaves no PENDING logged model
beside the READY one: a failure deletes it at once, and the next track of the run deletes what a killed
one left. Against a real MLflow SQLite store."""

from __future__ import annotations

import pytest

from shardfuse.track import model_logging
from shardfuse.track import sync as track_sync
from tests.support.tracking import TRACK_EXPERIMENT, active_runs, make_run_dir, run_config


def logged_models(track_store, run_name: str) -> dict[str, str]:
    """model id -> status of the run's parent's logged models (deleted ones left out)."""
    (parent,), _ = active_runs(track_store, run_name)
    found = track_store["client"].search_logged_models(
        [track_store["experiment_id"]], filter_string=f"source_run_id = '{parent.info.run_id}'"
    )
    return {model.model_id: str(model.status).rsplit(".", 1)[-1] for model in found}


def test_a_failure_after_the_logged_model_is_created_leaves_no_pending_model(
    track_store, tmp_path, monkeypatch
):
    run_dir, manifest = make_run_dir(tmp_path, "failing")

    def fail_while_saving(*args, **kwargs):
        raise RuntimeError("disk full while saving the model")

    # Model.log creates the logged model (PENDING), then saves it through the flavor: fail there.
    monkeypatch.setattr(model_logging._PYFUNC_FLAVOR, "save_model", fail_while_saving)
    with pytest.raises(Exception, match="disk full"):
        track_sync.track_run(
            "failing", run_dir, manifest, run_config("failing"), track_store["uri"], TRACK_EXPERIMENT
        )
    assert logged_models(track_store, "failing") == {}
    monkeypatch.undo()
    result = track_sync.track_run(
        "failing", run_dir, manifest, run_config("failing"), track_store["uri"], TRACK_EXPERIMENT
    )
    assert logged_models(track_store, "failing") == {result["model_uri"].split("/")[-1]: "READY"}


def test_the_next_track_deletes_a_pending_model_a_killed_track_left(track_store, tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "killed")
    args = ("killed", run_dir, manifest, run_config("killed"), track_store["uri"], TRACK_EXPERIMENT)
    first = track_sync.track_run(*args)
    ready = first["model_uri"].split("/")[-1]
    # What a track killed while logging leaves (no except clause runs on SIGKILL): a PENDING model.
    stray = track_store["client"].create_logged_model(
        track_store["experiment_id"], name="killed", source_run_id=first["parent_run_id"]
    )
    assert logged_models(track_store, "killed") == {ready: "READY", stray.model_id: "PENDING"}
    again = track_sync.track_run(*args)
    assert again["action"] == "unchanged"
    assert logged_models(track_store, "killed") == {ready: "READY"}
