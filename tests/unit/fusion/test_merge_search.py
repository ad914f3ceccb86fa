"""Merge search (run key merge_search, shardfuse.fusion.search): Optuna trials scored on the validation
split only, a study that resumes after a kill without repeating a trial, the same trials for the same
seed, and one line for a search that cannot run."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from shardfuse.data import reader as data_module
from shardfuse.fusion import search as search_module
from shardfuse.io import UserError, sha256_file
from shardfuse.merge import merge
from shardfuse.scoring import scorer as scorer_module
from tests.support.fusion import LOGISTIC, classifier, gather_to, make_run, write_split

SIMPLEX = {"trials": 8, "sampler": "random", "seed": 3, "space": {"merge_weights": "simplex"}}


@pytest.fixture()
def run(tmp_path):
    gen = np.random.default_rng(0)
    features = gen.standard_normal((400, 2)).astype(np.float32)
    dataset = tmp_path / "dataset"
    dataset.mkdir()
    write_split(dataset / "val.parquet", features[:200], (features[:200, 0] > 0).astype(int))
    write_split(dataset / "test.parquet", features[200:], (features[200:, 0] < 0).astype(int))  # opposite
    splits = ("val", "test")
    info = {
        "rows": dict.fromkeys(splits, 200),
        "sha256": {s: sha256_file(dataset / f"{s}.parquet") for s in splits},
    }
    (dataset / "dataset.json").write_text(json.dumps(info))
    # ranks 0 and 2 point the wrong way on x1's noise; rank 1 is right: weights on rank 1 win
    ranks = [classifier([-4.0, 3.0]), classifier([5.0, 0.0]), classifier([-2.0, -6.0])]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1, 1], spec=LOGISTIC), 3)
    return gather_path, dataset


def searched(run, tmp_path, search, name="m", db="search.db"):
    gather_path, dataset = run
    return merge(
        gather_path, "weighted", tmp_path / f"{name}.safetensors", tmp_path / f"{name}.json",
        val_split=dataset / "val.parquet", search=search, search_db=tmp_path / db,
    )  # fmt: skip


def test_trials_read_the_validation_split_only_and_the_best_beats_the_default(run, tmp_path, monkeypatch):
    read = []
    original = data_module.load_table
    monkeypatch.setattr(
        data_module, "load_table", lambda path, *a, **k: read.append(Path(path)) or original(path)
    )
    record = searched(run, tmp_path, SIMPLEX)
    found = record.search
    assert set(read) == {run[1] / "val.parquet"}  # never the test split
    assert found["trials_done"] == 8 and len(found["trials"]) == 8 and found["objective"] == "val_accuracy"
    assert found["best_value"] == max(t["value"] for t in found["trials"]) > found["default_value"]
    assert record.params["weights"] == found["best_params"]["weights"]  # the best trial was merged
    assert record.weights == pytest.approx(
        [w / sum(record.params["weights"]) for w in record.params["weights"]]
    )


def test_a_killed_study_resumes_without_repeating_a_trial_and_the_same_seed_gives_the_same_trials(
    run, tmp_path, monkeypatch
):
    whole = searched(run, tmp_path, SIMPLEX, "whole", "whole.db").search
    calls = {"n": 0}
    original = scorer_module.Scorer.score

    def dying(self, tensors):
        calls["n"] += 1
        if calls["n"] == 5:  # the default's score, then trials 0..2 complete; trial 3 is killed
            raise KeyboardInterrupt
        return original(self, tensors)

    monkeypatch.setattr(scorer_module.Scorer, "score", dying)
    with pytest.raises(KeyboardInterrupt):
        searched(run, tmp_path, SIMPLEX, "killed", "killed.db")
    monkeypatch.setattr(scorer_module.Scorer, "score", original)
    resumed = searched(run, tmp_path, SIMPLEX, "killed", "killed.db").search
    states = [t["state"] for t in resumed["trials"]]
    assert states == ["COMPLETE"] * 8  # the killed trial was never stored
    complete = [t["params"] for t in resumed["trials"] if t["state"] == "COMPLETE"]
    assert complete == [t["params"] for t in whole["trials"]]  # as if never killed; none repeated
    assert len({json.dumps(p) for p in complete}) == 8
    more = searched(run, tmp_path, {**SIMPLEX, "trials": 10}, "more", "whole.db").search  # continues
    assert [t["params"] for t in more["trials"][:8]] == [t["params"] for t in whole["trials"]]
    assert more["trials_done"] == 10 and more["study"] == whole["study"]
    other = searched(run, tmp_path, {**SIMPLEX, "seed": 4}, "other", "whole.db").search  # another study
    assert other["study"] != whole["study"] and other["trials"][0]["params"] != whole["trials"][0]["params"]


def test_tpe_over_a_range_and_a_refused_trial_fails_without_stopping_the_study(run, tmp_path):
    gather_path, dataset = run
    search = {"trials": 6, "seed": 0, "space": {"merge_scale": [0.2, 3.0]}}
    record = merge(
        gather_path, "task_arithmetic", tmp_path / "ta.safetensors", tmp_path / "ta.json",
        val_split=dataset / "val.parquet", search=search, search_db=tmp_path / "ta.db",
    )  # fmt: skip
    found = record.search
    assert found["sampler"] == "tpe" and found["trials_done"] == 6
    assert all(0.2 <= t["params"]["scale"] <= 3.0 for t in found["trials"])
    assert record.params["scale"] == found["best_params"]["scale"]


@pytest.mark.parametrize(
    ("search", "message"),
    [
        ({"trials": 0, "space": {"merge_scale": [0, 1]}}, "merge_search.trials must be an integer >= 1"),
        ({"trials": 3, "space": {"merge_density": [0.1, 0.5]}},
         "merge_search.space.merge_density: merge method task_arithmetic has no such parameter"),
        ({"trials": 3, "space": {"merge_scale": [2.0, 1.0]}}, "[2.0, 1.0] is empty or inverted"),
        ({"trials": 3, "space": {}}, "merge_search.space must name at least one parameter"),
        ({"trials": 3, "sampler": "cma", "space": {"merge_scale": [0.1, 1]}},
         "merge_search.sampler 'cma' is not one of tpe, cmaes, random, grid"),
        ({"trials": 3, "sampler": "cmaes", "space": {"merge_scale": [0.5, 1.0, 1.5]}},
         "sampler cmaes searches continuous ranges, but merge_scale is categorical"),
        ({"trials": 3, "space": {"merge_scale": [0.1, 1]}, "budget": 3}, "unknown key 'budget'"),
    ],
)  # fmt: skip
def test_a_search_that_cannot_run_is_one_line(search, message):
    with pytest.raises(UserError) as info:
        search_module.parse(search, "task_arithmetic", {"scale": "number"}, "merge_search")
    assert message in str(info.value) and "\n" not in str(info.value)


def test_a_search_on_a_method_without_parameters_or_without_a_validation_split_is_refused(run, tmp_path):
    gather_path, dataset = run
    with pytest.raises(UserError, match="merge method uniform has no parameter to search"):
        merge(gather_path, "uniform", tmp_path / "u.safetensors", tmp_path / "u.json",
              val_split=dataset / "val.parquet", search=SIMPLEX, search_db=tmp_path / "u.db")  # fmt: skip
    with pytest.raises(UserError, match=r"test\.parquet is the dataset's test split"):
        merge(gather_path, "weighted", tmp_path / "w.safetensors", tmp_path / "w.json",
              val_split=dataset / "test.parquet", search=SIMPLEX, search_db=tmp_path / "w.db")  # fmt: skip
    assert not (tmp_path / "u.safetensors").exists() and not (tmp_path / "w.json").exists()


@pytest.mark.parametrize(
    ("run", "dataset", "message"),
    [
        ({"strategy": "ddp", "merge_method": "consolidate", "merge_search": SIMPLEX}, {},
         "runs[r].merge_search: merge method consolidate keeps rank 0"),
        ({"merge_method": "weighted", "merge_search": SIMPLEX}, {"val_fraction": 0},
         "trials are scored on the validation split but dataset 'digits' has val_fraction 0"),
        ({"merge_method": "ties", "merge_search": {"trials": 2, "space": {"merge_scale": [1, 1]}}}, {},
         "config error at runs[r].merge_search.space.merge_scale [1, 1] is empty or inverted"),
    ],
)  # fmt: skip
def test_the_config_refuses_a_search_that_cannot_run_before_any_job(run, dataset, message):
    from shardfuse.experiment.load import load_experiment
    from shardfuse.experiment.schema import ConfigError

    config = {
        "datasets": {"digits": {"source": "digits", **dataset}},
        "runs": {"r": {"strategy": "localsgd", "sync_every": 0, **run}},
        "run_defaults": {"dataset": "digits", "world_size": 2},
    }
    with pytest.raises(ConfigError) as info:
        load_experiment(config, environ={})
    assert message in str(info.value), str(info.value)


def test_each_trial_is_a_nested_mlflow_run_and_the_parent_carries_the_best_and_default_scores(tmp_path):
    from mlflow.tracking import MlflowClient

    from shardfuse.track.sync import sync_trials

    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    experiment = client.create_experiment("search")
    parent = client.create_run(experiment, run_name="ta")
    search = {
        "objective": "val_accuracy", "best_value": 0.9, "default_value": 0.7,
        "trials": [
            {"number": 0, "params": {"scale": 0.5}, "value": 0.8, "state": "COMPLETE"},
            {"number": 1, "params": {"scale": 2.5}, "value": None, "state": "FAIL"},
            {"number": 2, "params": {"scale": 1.2}, "value": 0.9, "state": "COMPLETE"},
        ],
    }  # fmt: skip
    sync_trials(client, experiment, parent.info.run_id, "ta", search, {})
    children = client.search_runs([experiment], f"tags.`mlflow.parentRunId` = '{parent.info.run_id}'")
    by_trial = {int(r.data.tags["shardfuse.trial"]): r for r in children}
    assert sorted(by_trial) == [0, 1, 2]
    assert by_trial[2].data.params["merge_scale"] == "1.2" and by_trial[2].data.metrics["val_accuracy"] == 0.9
    assert by_trial[1].info.status == "FAILED" and "val_accuracy" not in by_trial[1].data.metrics
    metrics = client.get_run(parent.info.run_id).data.metrics
    assert metrics["search_best_val_accuracy"] == 0.9 and metrics["search_default_val_accuracy"] == 0.7


def test_the_study_is_drawn_with_optunas_own_figures(run, tmp_path):
    from shardfuse.track.sync import search_figures

    record = searched(run, tmp_path, SIMPLEX)
    drawn = (
        search_figures(record.search, tmp_path / "figures") if (tmp_path / "figures").mkdir() is None else []
    )
    assert [p.name for p in drawn] == ["optimization_history.png", "param_importances.png"]
    assert all(p.stat().st_size > 10_000 for p in drawn)


def test_in_memory_trials_merge_what_the_streamed_engine_merges_per_tensor_settings_included(
    run, tmp_path, monkeypatch
):
    gather_path, dataset = run
    given = {"scale": [{"filter": "bias", "value": 0.5}, {"value": 1.5}]}  # the run's own, per tensor
    search = {"trials": 4, "sampler": "random", "space": {"merge_density": [0.3, 1.0]}}

    def ties(name):
        return merge(
            gather_path, "ties", tmp_path / f"{name}.safetensors", tmp_path / f"{name}.json", given,
            val_split=dataset / "val.parquet", search=search, search_db=tmp_path / f"{name}.db",
        )  # fmt: skip

    held = ties("held")
    monkeypatch.setattr(search_module, "MEMORY_BUDGET", 0)  # every trial streams through the engine
    streamed = ties("streamed")
    assert held.search["in_memory"] and not streamed.search["in_memory"]
    assert [t["value"] for t in held.search["trials"]] == [t["value"] for t in streamed.search["trials"]]
    assert held.search["default_value"] == streamed.search["default_value"]
    assert held.sha256 == streamed.sha256


def test_granularity_layer_suggests_one_value_per_layer_and_needs_layers(run, tmp_path):
    import optuna

    spec = search_module.parse(
        {
            "trials": 2,
            "granularity": "layer",
            "space": {"merge_scale": [0.5, 2.0], "merge_weights": "simplex"},
        },
        "weighted",
        {"scale": "number", "weights": "weights"},
        "merge_search",
    )
    fixed = {"merge_scale_layer0": 0.5, "merge_scale_layer1": 0.7, "merge_scale_layer2": 0.9}
    fixed |= {f"merge_weights_{r}_layer{i}": 0.1 * (r + 1) for r in range(2) for i in range(3)}
    params = search_module._suggest(optuna.trial.FixedTrial(fixed), spec, num_ranks=2, num_layers=3)
    assert params == {"scale": [0.5, 0.7, 0.9], "weights": [[0.1, 0.1, 0.1], [0.2, 0.2, 0.2]]}
    with pytest.raises(
        UserError, match="granularity layer needs a model whose tensor names show two or more"
    ):
        searched(run, tmp_path, {**SIMPLEX, "granularity": "layer"})  # the logistic model has no layers


def test_a_retrained_run_starts_a_new_study_in_the_same_file(run, tmp_path):
    first = searched(run, tmp_path, SIMPLEX, "first", "same.db").search
    other = tmp_path / "retrained"
    other.mkdir()
    ranks = [classifier([-4.0, 3.0]), classifier([5.0, 1.0]), classifier([-2.0, -6.0])]  # rank 1 changed
    retrained = gather_to(other, make_run(other, ranks, [1, 1, 1], spec=LOGISTIC), 3)
    again = searched((retrained, run[1]), tmp_path, SIMPLEX, "again", "same.db").search
    assert again["study"] != first["study"] and again["trials_done"] == 8  # no stale trial reused
    assert searched(run, tmp_path, SIMPLEX, "third", "same.db").search["study"] == first["study"]


@pytest.mark.parametrize(
    ("sampler", "space", "done"),
    [
        ("cmaes", {"merge_scale": [0.2, 3.0], "merge_density": [0.1, 1.0]}, 6),
        ("grid", {"merge_scale": [0.5, 2.0]}, 3),
    ],
)
def test_cmaes_and_grid_run_their_studies(run, tmp_path, sampler, space, done):
    gather_path, dataset = run
    search = {"trials": 6, "sampler": sampler, "grid_points": 3, "space": space}
    record = merge(
        gather_path, "ties", tmp_path / "t.safetensors", tmp_path / "t.json",
        val_split=dataset / "val.parquet", search=search, search_db=tmp_path / "t.db",
    )  # fmt: skip
    found = record.search
    assert found["trials_done"] == done and found["sampler"] == sampler  # grid: its 3 points, then done
    if sampler == "grid":
        assert sorted(t["params"]["scale"] for t in found["trials"]) == [0.5, 1.25, 2.0]
