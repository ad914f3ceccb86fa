"""The ensemble reference: each task's ``combine`` against a hand computation, evaluate's ensemble of a
real training against an independent one (rank weights run here, probabilities averaged here), world
size 1 (the ensemble is the rank), and the ensemble's MLflow headline metrics pushed once."""

from __future__ import annotations

import json
import math

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from shardfuse.data.reader import load_table
from shardfuse.models.registry import build_model
from shardfuse.models.tasks import Totals, task_for
from shardfuse.scoring.scorer import model_from_file, score_models
from shardfuse.scoring.split import load_split
from tests.support.tracking import make_run_dir, regression_evaluation, run_config
from tests.support.training import EVAL_BATCH_SIZE, train_merge_evaluate


def score(task, outputs, targets):
    totals = Totals()
    task.accumulate(totals, outputs, targets)
    return task.finish(totals)


def test_classification_combine_averages_probabilities_and_scores_the_mean_probability():
    a, b = torch.tensor([[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]), torch.tensor([[0.0, 3.0, 0.0], [0.0, 0.0, 2.0]])
    task = task_for("classification")
    combined = task.combine([a, b])

    def softmax(row):
        exps = [math.exp(v) for v in row]
        return [e / sum(exps) for e in exps]

    mean = [[(p + q) / 2 for p, q in zip(softmax(ra), softmax(rb), strict=True)] for ra, rb in
            zip(a.tolist(), b.tolist(), strict=True)]  # fmt: skip
    torch.testing.assert_close(combined.exp(), torch.tensor(mean, dtype=torch.float64), rtol=0, atol=1e-12)
    # Mean probabilities: row 0 (0.416, 0.508, 0.076), class 1 though rank 0 alone says class 0;
    # row 1 (0.159, 0.341, 0.499), class 2.
    targets = torch.tensor([0, 2])
    metrics = score(task, combined, targets)
    assert metrics["loss"] == pytest.approx(-(math.log(mean[0][0]) + math.log(mean[1][2])) / 2, abs=1e-12)
    assert [max(range(3), key=row.__getitem__) for row in mean] == [1, 2]
    assert metrics["accuracy"] == 0.5  # the argmax of the means: row 0 wrong, row 1 right


def test_regression_combine_is_the_mean_prediction():
    a, b, c = torch.tensor([[1.0, 10.0]]), torch.tensor([[2.0, 20.0]]), torch.tensor([[6.0, 0.0]])
    task = task_for("regression", target_scale=torch.tensor([2.0, 10.0]))
    combined = task.combine([a, b, c])
    assert combined.tolist() == [[3.0, 10.0]]
    metrics = score(task, combined, torch.tensor([[4.0, 10.0]]))
    assert metrics["mse"] == pytest.approx((1.0 + 0.0) / 2) and metrics["mae"] == pytest.approx(0.5)


def test_causal_lm_combine_renormalises_the_mean_log_probabilities_per_token():
    a = torch.tensor([[[1.0, 0.0, 0.0], [0.0, 0.0, 2.0]]])  # one block of two tokens, vocabulary of 3
    b = torch.tensor([[[0.0, 2.0, 0.0], [1.0, 0.0, 0.0]]])
    task = task_for("causal_lm")
    combined = task.combine([a, b])
    assert combined.shape == a.shape

    def log_softmax(row):
        total = math.log(sum(math.exp(v) for v in row))
        return [v - total for v in row]

    expected = []
    for ra, rb in zip(a[0].tolist(), b[0].tolist(), strict=True):
        mean = [(p + q) / 2 for p, q in zip(log_softmax(ra), log_softmax(rb), strict=True)]
        expected.append(log_softmax(mean))  # renormalised: mean - logsumexp(mean)
    torch.testing.assert_close(combined[0], torch.tensor(expected), rtol=0, atol=1e-6)
    torch.testing.assert_close(combined.exp().sum(dim=-1), torch.ones(1, 2), rtol=0, atol=1e-6)
    targets = torch.tensor([[1, 2]])
    nll = -(expected[0][1] + expected[1][2]) / 2
    assert score(task, combined, targets)["loss"] == pytest.approx(nll, abs=1e-6)


@pytest.mark.parametrize("name", ["classification", "regression", "causal_lm"])
def test_the_ensemble_of_one_model_is_that_model(name):
    outputs = torch.randn(4, 3, 5) if name == "causal_lm" else torch.randn(4, 3)
    task = task_for(name)
    assert task.combine([outputs]) is outputs
    with pytest.raises(ValueError, match="at least one"):
        task.combine([])


@torch.no_grad()
def _independent_ensemble(paths, test_path):
    """Loss and accuracy of the mean softmax probability of the models, the whole split at once."""
    features, labels = load_table(test_path)
    probabilities = []
    for path in paths:
        tensors, metadata = load_weights(path)
        model = build_model(metadata["model"])
        model.load_state_dict(tensors)
        model.eval()
        probabilities.append(torch.softmax(model(features).double(), dim=1))
    mean = torch.stack(probabilities).mean(dim=0)
    loss = -mean.gather(1, labels[:, None]).log().mean().item()
    return {"loss": loss, "accuracy": (mean.argmax(dim=1) == labels).double().mean().item()}


def test_evaluate_scores_the_ensemble_of_the_ranks_as_an_independent_computation(
    tmp_path, small_trainings, digits_dataset, digits_shards
):
    trained = small_trainings / "results" / "trainings" / "independent" / "ranks"
    evaluation, paths = train_merge_evaluate(tmp_path, digits_dataset, digits_shards, 2, trained)
    expected = _independent_ensemble(paths, digits_dataset / "test.parquet")
    ensemble = evaluation["ensemble"]
    assert set(ensemble) == {"loss", "accuracy"}
    assert ensemble == pytest.approx(expected, abs=1e-6)
    assert evaluation["ensemble_accuracy"] == ensemble["accuracy"]
    assert evaluation["fusion_gap"] == pytest.approx(ensemble["accuracy"] - evaluation["merged"]["accuracy"])
    # One pass scores the ranks too, exactly as scoring each rank on its own does.
    split = load_split(digits_dataset / "test.parquet", "test")
    for rank, path in enumerate(paths):
        own = score_models([model_from_file(path)], split, EVAL_BATCH_SIZE)[0][0]
        assert evaluation["ranks"][rank] == {"rank": rank, **own}
    # eval.json's test set holds the same scores as its top-level fields, which readers keep reading.
    test = evaluation["sets"]["test"]
    assert (test["merged"], test["ranks"], test["ensemble"]) == (
        evaluation["merged"],
        evaluation["ranks"],
        evaluation["ensemble"],
    )


def test_track_pushes_the_ensemble_headline_once_and_an_old_eval_json_pushes_none(tmp_path):
    from mlflow.tracking import MlflowClient

    from shardfuse.track import sync as track_sync

    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    client.create_experiment("shardfuse", artifact_location=str(tmp_path / "artifacts"))
    for name, ensemble in (("with", True), ("old", False)):
        run_dir, manifest = make_run_dir(tmp_path / name, name)
        (run_dir / "eval.json").write_text(json.dumps(regression_evaluation(name, ensemble=ensemble)))
        first = track_sync.track_run(name, run_dir, manifest, run_config(name), uri, "shardfuse")
        metrics = client.get_run(first["parent_run_id"]).data.metrics
        pushed = {key: value for key, value in metrics.items() if "ensemble" in key or key == "fusion_gap"}
        if ensemble:
            expected = {"test_mse_ensemble": 0.21, "test_loss_ensemble": 0.22, "test_mae_ensemble": 0.35,
                        "test_r2_ensemble": 0.79, "fusion_gap": 0.04}  # fmt: skip
            assert pushed == pytest.approx(expected)
        else:
            assert pushed == {}
        again = track_sync.track_run(name, run_dir, manifest, run_config(name), uri, "shardfuse")
        assert (again["action"], again["num_points_pushed"]) == ("unchanged", 0)
        assert client.get_run(first["parent_run_id"]).data.metrics == metrics
