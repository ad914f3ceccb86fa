"""Adding a task is one module with a ``Task`` subclass and its class in ``shardfuse.models.tasks.RECORDS``
(plus the schema's task enum, which tests/contracts/test_registries.py holds to the records): a toy task
written to a temporary module and registered so is prepared, trained, merged and evaluated by the real
stages, and every stage ranks by its score. The sources that give its layout of targets serve it."""

from __future__ import annotations

import json

from shardfuse.checkpoints.weights import read_metadata
from shardfuse.models import tasks
from tests.support.extension import import_toy_module, prepare_to_evaluate

TOY_TASK = '''
from shardfuse.models.regression import Regression


class MaeRegression(Regression):
    """Regression ranked by the mean absolute error (in the targets' units)."""

    name = "regression_mae"
    score = "mae"
'''


def test_a_toy_task_in_the_records_is_trained_and_evaluated_by_its_own_score(tmp_path, monkeypatch):
    toy = import_toy_module(tmp_path, "toy_task", TOY_TASK)
    monkeypatch.setattr(tasks, "RECORDS", (*tasks.RECORDS, toy.MaeRegression))
    spec = {
        "source": "synthetic",
        "task": "regression_mae",
        "num_rows": 600,
        "num_features": 4,
        "num_outputs": 2,
    }

    evaluation = prepare_to_evaluate(monkeypatch, tmp_path, spec)

    assert json.loads((tmp_path / "dataset" / "dataset.json").read_text())["task"] == "regression_mae"
    header = read_metadata(tmp_path / "training" / "ranks" / "rank-0.safetensors")
    assert header["model"]["task"] == "regression_mae"
    assert (evaluation["task"], evaluation["score"], evaluation["lower_is_better"]) == (
        "regression_mae",
        "mae",
        True,
    )
    rank_mae = evaluation["ranks"][0]["mae"]
    # eval.json names its scores after the task's: best_rank_mae, ensemble_mae.
    assert evaluation["best_rank_mae"] == evaluation["mean_rank_mae"] == rank_mae
    assert evaluation["ensemble_mae"] == evaluation["ensemble"]["mae"]
    # One rank: the uniform merge is that rank, so merging neither helps nor hurts by the toy's score.
    assert evaluation["merged"]["mae"] == rank_mae and evaluation["fusion_gain"] == 0
