"""The leaderboard URL `make ui` prints (shardfuse.leaderboard): the score a parent carries picks
the sort and the columns; the shared view is written to the experiment once; a missing experiment is
one line (the browser test in tests/services/test_mlflow_ui.py opens the URL)."""

from __future__ import annotations

import json
import subprocess
import sys

from mlflow.tracking import MlflowClient

from shardfuse.track.leaderboard import SHARED_VIEW_TAG, experiment_leaderboard, score_of, view_state
from tests.support.helpers import subprocess_env


def test_the_score_and_its_direction_come_from_the_task():
    assert score_of({"test_accuracy_merged", "test_loss_merged"}) == ("test_accuracy_merged", False)
    assert score_of({"test_r2_merged", "test_mse_merged"}) == ("test_r2_merged", False)
    assert score_of({"test_perplexity_merged", "test_loss_merged"}) == ("test_perplexity_merged", True)
    assert score_of({"test_loss_merged"}) == ("test_loss_merged", True)
    state = view_state("test_loss_merged", True)
    assert state["orderByKey"] == "metrics.`test_loss_merged`" and state["orderByAsc"] is True
    assert state["selectedColumns"] == [
        "attributes.`Dataset`", "metrics.`test_loss_merged`", "metrics.`test_loss_best_rank`",
        "metrics.`test_loss_ensemble`", "metrics.`test_loss_ddp_baseline`", "metrics.`fusion_gain`",
    ]  # fmt: skip


def test_the_shared_view_is_written_once_and_a_missing_experiment_is_one_line(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    experiment_id = client.create_experiment("board")
    run = client.create_run(experiment_id, run_name="r", tags={"shardfuse.complete": "true"})
    client.log_metric(run.info.run_id, "test_r2_merged", 0.9)
    url = experiment_leaderboard(uri, "board", "http://127.0.0.1:5055/")
    assert url == (
        f"http://127.0.0.1:5055/#/experiments/{experiment_id}/runs?workflowType=machine_learning"
        "&viewStateShareKey=shardfuse-leaderboard"
    )
    state = json.loads(client.get_experiment(experiment_id).tags[SHARED_VIEW_TAG])
    assert state["orderByKey"] == "metrics.`test_r2_merged`" and state["orderByAsc"] is False
    assert state["searchFilter"] == "tags.`shardfuse.complete` = 'true'"
    proc = subprocess.run(
        [sys.executable, "-m", "shardfuse.leaderboard", "--tracking-uri", uri, "--experiment", "nope"],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2 and proc.stdout == ""
    (line,) = proc.stderr.strip().splitlines()
    assert f"experiment 'nope' is not in {uri}; run the workflow first" in line


def test_the_experiment_description_links_the_figures_and_never_replaces_the_users_own(tmp_path):
    """The comparison stage's description (the figures one click from the experiment page) is written
    where there is none or it wrote the one there; a description of the user's own is left as it is."""
    from pathlib import Path

    from shardfuse.comparison import NOTE_TAG, describe_experiments

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(uri)
    ours, theirs = client.create_experiment("ours"), client.create_experiment("theirs")
    client.set_experiment_tag(theirs, NOTE_TAG, "My ablation of TIES densities.")
    records = [
        {"experiment_id": ours, "parent_run_id": "p1"},
        {"experiment_id": theirs, "parent_run_id": "p2"},
    ]
    pngs = [Path("merge_methods.png"), Path("communication.png")]
    describe_experiments(client, records, pngs)
    note = client.get_experiment(ours).tags[NOTE_TAG]
    artifacts = f"#/experiments/{ours}/runs/p1/artifacts/comparison"
    assert note.startswith(
        f"**Across runs:** [merge_methods.png]({artifacts}/merge_methods.png)"
        f" · [communication.png]({artifacts}/communication.png)\n"
    )
    assert client.get_experiment(theirs).tags[NOTE_TAG] == "My ablation of TIES densities."
    describe_experiments(client, [{"experiment_id": ours, "parent_run_id": "p9"}], pngs[:1])
    assert "/runs/p9/" in client.get_experiment(ours).tags[NOTE_TAG]  # ours: written again
