"""Scores on each rank's local test distribution, exact: a mixture of cells' running sums is the weighted
class-conditional score, one cell alone is bitwise its rows scored alone, a cell without rows is dropped
and recorded, and normalized_<score> divides the right way for either direction of the score."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from shardfuse.io import UserError
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from shardfuse.models.tasks import Totals, task_for
from shardfuse.scoring.local import local_scores
from shardfuse.scoring.mixture import mix, weighted_sets
from shardfuse.scoring.scorer import model_of, score_in_cells, score_models
from shardfuse.scoring.split import Split
from tests.support.data import CLASSIFICATION_INFO

INFO = CLASSIFICATION_INFO
REGRESSION_INFO = {
    "task": "regression",
    "num_features": 4,
    "num_classes": 0,
    "feature_names": ["a", "b", "c", "d"],
    "label_names": [],
    "target_names": ["y_a", "y_b"],
}


def model_on(info, seed: int):
    torch.manual_seed(seed)
    spec = model_spec("mlp", {"hidden_sizes": [5]}, [], info)
    return model_of(build_model(spec).state_dict(), spec, f"model {seed}")


def split_of(features, targets) -> Split:
    return Split("test", Path("test.parquet"), features, targets)


def test_a_mixture_of_class_cells_is_the_class_conditional_scores_weighted_by_hand():
    task = task_for("classification")
    # Three classes; per class outputs that get 1 of 2, 2 of 3 and 0 of 1 rows right.
    outputs = torch.tensor([[2.0, 0, 0], [0, 2.0, 0], [0, 3.0, 0], [0, 3.0, 0], [1.0, 0, 0], [0, 0, -1.0]])
    targets = torch.tensor([0, 0, 1, 1, 1, 2])
    cells = [Totals() for _ in range(3)]
    for cell in range(3):
        rows = targets == cell
        task.accumulate(cells[cell], outputs[rows], targets[rows])
    alone = [task.finish(totals) for totals in cells]
    assert [m["accuracy"] for m in alone] == [0.5, pytest.approx(2 / 3), 0.0]
    weights = (0.6, 0.3, 0.1)
    mixed = task.finish(mix(cells, weights))
    assert mixed["accuracy"] == pytest.approx(0.6 * 0.5 + 0.3 * 2 / 3 + 0.1 * 0.0, abs=1e-15)
    assert mixed["loss"] == pytest.approx(
        sum(w * m["loss"] for w, m in zip(weights, alone, strict=True)), abs=1e-12
    )
    # The test rows' own class mix (2, 3 and 1 of 6 rows) gives back the pooled score.
    pooled = Totals()
    task.accumulate(pooled, outputs, targets)
    assert task.finish(mix(cells, (2 / 6, 3 / 6, 1 / 6)))["accuracy"] == pytest.approx(
        task.finish(pooled)["accuracy"]
    )


@pytest.mark.parametrize("info", [INFO, REGRESSION_INFO], ids=["classification", "regression"])
def test_one_cell_alone_scores_its_rows_alone_and_the_whole_split_is_unchanged(info):
    generator = torch.Generator().manual_seed(1)
    features = torch.randn(40, 4, generator=generator)
    if info is INFO:
        targets = torch.randint(0, 3, (40,), generator=generator)
    else:
        targets = torch.randn(40, 2, generator=generator)
    of_row = torch.from_numpy(np.arange(40) % 3 - (np.arange(40) % 7 == 0))  # cells 0..2, some in none (-1)
    models = [model_on(info, seed) for seed in (0, 1)]
    split = split_of(features, targets)
    found = score_in_cells(models, split, 4096, ensemble=True, of_row=of_row, num_cells=3)
    whole, ensemble = score_models(models, split, 4096, ensemble=True)
    assert found.metrics == whole and found.ensemble == ensemble  # the global figures, bit for bit
    with torch.no_grad():
        outputs = [model.module(features) for model in models]
    for cell in range(3):
        rows = of_row == cell
        one_hot = tuple(1.0 if k == cell else 0.0 for k in range(3))
        mixed = [m.task.finish(mix(c, one_hot)) for m, c in zip(models, found.cells, strict=True)]
        # Bitwise the sums of the cell's rows alone (from the same outputs) ...
        for model, output, got in zip(models, outputs, mixed, strict=True):
            own = Totals()
            model.task.accumulate(own, output[rows], targets[rows])
            assert got == model.task.finish(own)
        # ... and, within float32 rounding (a forward pass on other rows may round otherwise), the
        # scores of a split of those rows alone.
        alone, alone_ensemble = score_models(
            models, split_of(features[rows], targets[rows]), 4096, ensemble=True
        )
        for got, want in zip(
            [*mixed, models[0].task.finish(mix(found.ensemble_cells, one_hot))],
            [*alone, alone_ensemble],
            strict=True,
        ):
            assert got == pytest.approx(want, rel=1e-6)
    # Several batches: the same within rounding.
    batched = score_in_cells(models, split, 7, ensemble=True, of_row=of_row, num_cells=3)
    weights = (0.2, 0.5, 0.3)
    for model, cells, reference in zip(models, batched.cells, found.cells, strict=True):
        got, want = model.task.finish(mix(cells, weights)), model.task.finish(mix(reference, weights))
        assert got == pytest.approx(want, rel=1e-6)


def test_a_cell_without_test_rows_is_dropped_the_rest_renormalised_and_recorded():
    of_row = np.array([0, 0, 1, 1, 1, -1])  # cell 2 (a class the test split lacks) holds no row
    weights = np.array([[0.5, 0.25, 0.25], [0.0, 0.0, 1.0]])
    (first,) = weighted_sets(["a", "b", "c"], weights[:1], of_row, ["local_rank_0"], "raise test_fraction")
    assert first.weights == pytest.approx((2 / 3, 1 / 3, 0.0))
    assert first.record == {"rows": 5, "weights": {"a": pytest.approx(2 / 3), "b": pytest.approx(1 / 3)},
                            "dropped": {"c": 0.25}}  # fmt: skip
    with pytest.raises(
        UserError, match=r"^evaluation set 'local_rank_1' weighs no row of the test split; raise"
    ):
        weighted_sets(
            ["a", "b", "c"], weights, of_row, ["local_rank_0", "local_rank_1"], "raise test_fraction"
        )


def local_sets(score: str, merged: list[float], own: list[float]) -> dict:
    return {
        "test": {"kind": "test"},
        **{
            f"local_rank_{rank}": {
                "kind": "local",
                "trained_by": rank,
                "merged": {score: m},
                "ranks": [{"rank": r, score: o if r == rank else -1.0} for r in range(len(own))],
            }
            for rank, (m, o) in enumerate(zip(merged, own, strict=True))
        },
    }


def test_normalized_is_merged_over_own_for_accuracy_and_own_over_merged_for_mse():
    accuracy = local_scores(local_sets("accuracy", [0.6, 0.9], [0.8, 0.9]), task_for("classification"))
    assert accuracy == {
        "local_accuracy_merged_rank_0": 0.6, "local_accuracy_merged_rank_1": 0.9,
        "local_accuracy_rank_0": 0.8, "local_accuracy_rank_1": 0.9,
        "local_accuracy_merged_mean": pytest.approx(0.75), "local_accuracy_merged_worst": 0.6,
        "normalized_accuracy": pytest.approx((0.6 / 0.8 + 1.0) / 2),
    }  # fmt: skip
    mse = local_scores(local_sets("mse", [0.5, 0.2], [0.25, 0.2]), task_for("regression"))
    assert mse["local_mse_merged_worst"] == 0.5  # the highest: lower is better
    assert mse["normalized_mse"] == pytest.approx((0.25 / 0.5 + 1.0) / 2)  # below 1: merged is worse
    assert local_scores({"test": {"kind": "test"}}, task_for("classification")) == {}  # iid: no keys
    zero = local_scores(local_sets("accuracy", [0.5, 0.5], [0.0, 0.5]), task_for("classification"))
    assert "normalized_accuracy" not in zero and zero["local_accuracy_rank_0"] == 0.0
