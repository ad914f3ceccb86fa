"""Scoring weights on a split (shared by evaluate, greedy soup and recalibration) and the evaluation-set
records evaluate takes: one pass scores each model as it is scored alone, a set is named by its kind, and
the global test split is always among them."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfuse.io import UserError
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from shardfuse.scoring import sets
from shardfuse.scoring.scorer import Scorer, model_of, same_as_earlier, score_in_cells, score_models
from shardfuse.scoring.split import Split
from tests.support.data import CLASSIFICATION_INFO

REGRESSION_INFO = {
    "task": "regression",
    "num_features": 5,
    "num_classes": 0,
    "feature_names": [f"x{i}" for i in range(5)],
    "label_names": [],
    "target_names": ["y_a", "y_b"],
}


def split_of(features, labels, name="test") -> Split:
    return Split(name, Path(f"{name}.parquet"), features, labels)


def test_a_scorer_scores_regression_in_target_units():
    spec = model_spec("mlp", {"hidden_sizes": []}, [], REGRESSION_INFO)
    model = build_model(spec)
    with torch.no_grad():
        model.net[0].weight.zero_()
        model.net[0].bias.zero_()
        model.target_mean.copy_(torch.tensor([1.0, 2.0]))
        model.target_scale.copy_(torch.tensor([3.0, 3.0]))
    split = split_of(torch.zeros(4, 5), torch.tensor([[1.0, 2.0]] * 3 + [[3.0, 2.0]]))
    metrics = Scorer(split, spec, batch_size=4096).score(model.state_dict())
    assert metrics["mse"] == pytest.approx(4.0 / 8) and metrics["mae"] == pytest.approx(2.0 / 8)


def test_one_pass_scores_each_model_as_it_is_scored_alone_whatever_the_batches():
    spec = model_spec("mlp", {"hidden_sizes": [6]}, [], CLASSIFICATION_INFO)
    generator = torch.Generator().manual_seed(0)
    split = split_of(torch.randn(23, 4, generator=generator), torch.randint(0, 3, (23,), generator=generator))
    models = []
    for seed in range(3):
        torch.manual_seed(seed)
        models.append(model_of(build_model(spec).state_dict(), spec, f"model {seed}"))
    together, ensemble = score_models(models, split, batch_size=5, ensemble=True)
    alone = [score_models([model], split, batch_size=5)[0][0] for model in models]
    assert together == alone and len({m["accuracy"] for m in alone} | {ensemble["accuracy"]}) > 1
    assert score_models(models, split, batch_size=5)[1] is None  # no ensemble unless asked


def test_models_with_the_same_weights_run_once_and_score_as_each_scored_alone():
    """ddp's ranks and their consolidated merge hold one set of weights: it runs once a batch, and every
    copy, the ensemble and the cells score bit for bit as when each model runs."""
    spec = model_spec("mlp", {"hidden_sizes": [6]}, [], CLASSIFICATION_INFO)
    generator = torch.Generator().manual_seed(0)
    split = split_of(torch.randn(23, 4, generator=generator), torch.randint(0, 3, (23,), generator=generator))
    torch.manual_seed(0)
    shared = build_model(spec).state_dict()
    torch.manual_seed(1)
    other = build_model(spec).state_dict()
    models = [
        model_of(weights, spec, f"model {i}") for i, weights in enumerate([shared, other, shared, shared])
    ]
    assert same_as_earlier(models) == [0, 1, 0, 0]
    calls = []
    for position, model in enumerate(models):
        model.module.register_forward_hook(lambda *_, position=position: calls.append(position))
    of_row = torch.arange(23) % 3 - 1  # cells 0 and 1, and rows in none
    found = score_in_cells(models, split, batch_size=5, ensemble=True, of_row=of_row, num_cells=2)
    assert calls == [0, 1] * 5  # five batches, each through two models
    # Each model run on its own, as before the copies were recognised.
    alone = [score_in_cells([model], split, 5, of_row=of_row, num_cells=2) for model in models]
    assert found.metrics == [scored.metrics[0] for scored in alone]
    assert found.cells == [scored.cells[0] for scored in alone]
    trio = [model_of(w, spec, "m") for w in (shared, other, other)]
    assert same_as_earlier(trio) == [0, 1, 1]
    ensemble_of_distinct = score_models(
        [model_of(w, spec, "m") for w in (shared, other)], split, 5, ensemble=True
    )[1]
    assert found.ensemble != ensemble_of_distinct  # the copies weigh in the ensemble as before


def test_a_model_differing_in_one_buffer_or_dtype_is_not_a_copy():
    spec = model_spec("mlp", {"hidden_sizes": [6]}, [], REGRESSION_INFO)
    weights = build_model(spec).state_dict()
    scaled = {**weights, "target_scale": weights["target_scale"] * 2}
    doubled = {name: tensor.double() for name, tensor in weights.items()}
    models = [model_of(w, spec, "m") for w in (weights, scaled, weights)]
    assert same_as_earlier(models) == [0, 1, 0]
    wide = model_of(doubled, spec, "m")
    wide.module.double()
    assert same_as_earlier([models[0], wide]) == [0, 1]


def test_a_split_the_model_does_not_take_is_refused_before_scoring():
    spec = model_spec("mlp", {"hidden_sizes": []}, [], CLASSIFICATION_INFO)
    with pytest.raises(UserError, match=r"expects inputs shaped \[4\] per row but the data has \[7\]"):
        Scorer(split_of(torch.zeros(2, 7), torch.zeros(2, dtype=torch.long)), spec, 16)


def test_a_split_without_rows_says_how_to_give_it_some():
    empty = split_of(torch.zeros(0, 4), torch.zeros(0, dtype=torch.long))
    with pytest.raises(UserError, match=r"^test split test.parquet has no rows; raise the dataset's"):
        empty.require_rows("test", sets.set_kind("test").empty_fix)


def test_an_evaluation_set_is_named_by_its_kind_and_the_test_split_is_required(tmp_path, monkeypatch):
    assert sets.parse_set("test=results/datasets/d/test.parquet")[0].name == "test"
    unknown = r"^unknown evaluation set 'other'; use one of test, local, domain; pass"
    with pytest.raises(UserError, match=unknown):
        sets.parse_set("other=x.parquet")
    with pytest.raises(UserError, match=r"is not KIND=PATH"):
        sets.parse_set("test")
    # A new kind is one record; the stage still wants the global test split first.
    toy = sets.SetKind("toy", "a test record", lambda path: None, "give it rows", ("merged",))
    monkeypatch.setattr(sets, "RECORDS", (*sets.RECORDS, toy))
    first = r"^evaluate scores the run on the global test split first: pass --test PATH"
    with pytest.raises(UserError, match=first):
        sets.expand([sets.parse_set(f"toy={tmp_path / 'a.parquet'}")])
    checked = []
    test = sets.SetKind("test", "the test split, unchecked here", checked.append, "raise test_fraction")
    monkeypatch.setattr(sets, "RECORDS", (test, toy))
    found = sets.expand([(test, tmp_path / "t.parquet"), sets.parse_set(f"toy={tmp_path / 'a.parquet'}")])
    assert [(kind.name, named.name) for kind, named in found] == [("test", "test"), ("toy", "toy")]
    assert checked == [tmp_path / "t.parquet"]  # each kind checks its own file
    with pytest.raises(UserError, match=r"^evaluation set 'test' is given twice; pass each --set once"):
        sets.expand([(test, tmp_path / "t.parquet"), (test, tmp_path / "t.parquet")])
