"""Adding a merge method is one plan and one record (README, Development): a toy method written into a
temporary module, registered by extending the registry's RECORDS, runs through the real merge stage on
per-rank checkpoints laid out as training writes them, and through evaluate."""

from __future__ import annotations

import pytest
import torch

from shardfuse.fusion.methods import registry
from tests.support.extensions import gather_merge_evaluate, tensors_of, write_module, write_ranks
from tests.support.helpers import call_stage

# Rank `pick`'s tensors as they are: a method whose result a test can tell from every other method's.
TOY = """
from shardfuse.fusion.methods.plan import Param, Plan
from shardfuse.fusion.methods.registry import Method
from shardfuse.io import UserError


class PickPlan(Plan):
    def combine(self, start, blocks, base):
        return blocks[self.job.ranks.index(self.params["pick"])]


def one_of_the_ranks(method, params, num_ranks):
    if params["pick"] >= num_ranks:
        raise UserError(f"{method}: pick {params['pick']} is not one of the run's {num_ranks} ranks")


RECORD = Method(
    "toy_pick",
    PickPlan,
    "a contract test's toy: one rank's weights",
    {"pick": Param(0, "integer", "an integer >= 0", lambda v: v >= 0)},
    check=one_of_the_ranks,
)
"""


@pytest.fixture()
def toy_method(tmp_path, monkeypatch):
    module = write_module(tmp_path, "toy_merge_method", TOY)
    monkeypatch.delitem(__import__("sys").modules, "toy_merge_method")
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, module.RECORD))
    return module.RECORD


def test_a_merge_method_added_as_one_record_runs_through_merge_and_evaluate(
    tmp_path, toy_method, digits_dataset
):
    ranks = tmp_path / "training" / "ranks"
    write_ranks(ranks, digits_dataset, num_ranks=3)
    record, evaluation = gather_merge_evaluate(tmp_path, digits_dataset, ranks, "toy_pick", {"pick": 1})
    merged = tensors_of(tmp_path / "run" / "merged.safetensors")
    chosen = tensors_of(ranks / "rank-1.safetensors")
    assert merged.keys() == chosen.keys() and all(torch.equal(merged[n], t) for n, t in chosen.items())
    assert (record["method"], record["params"], record["num_ranks"]) == ("toy_pick", {"pick": 1}, 3)
    # Evaluate scores the merge exactly as it scores rank 1, on every set it was given.
    scores = {key: value for key, value in evaluation["ranks"][1].items() if key != "rank"}
    assert evaluation["merged"] == scores and evaluation["sets"]["test"]["merged"] == scores
    assert evaluation["fusion_gain"] == pytest.approx(scores["accuracy"] - evaluation["best_rank_accuracy"])


def test_the_toy_methods_own_parameter_and_check_reach_the_stage(tmp_path, toy_method, digits_dataset):
    ranks = tmp_path / "ranks"
    write_ranks(ranks, digits_dataset, num_ranks=2)
    gather = tmp_path / "gather.json"
    assert call_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", gather).returncode == 0
    outputs = ["--out-weights", tmp_path / "m.safetensors", "--out-json", tmp_path / "m.json"]
    for params, fragment in (
        ('{"pick": 5}', "toy_pick: pick 5 is not one of the run's 2 ranks"),
        ('{"pick": -1}', "merge method toy_pick: parameter 'pick' must be an integer >= 0, got -1"),
        ('{"scale": 2}', "merge method toy_pick has no parameter 'scale' (valid: pick)"),
    ):
        proc = call_stage(
            "merge", "--gather", gather, "--method", "toy_pick", "--params-json", params, *outputs
        )
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
    assert not (tmp_path / "m.safetensors").exists()
    registered = call_stage("merge", "--gather", gather, "--method", "no_such_method", *outputs)
    assert "toy_pick" in registered.stderr  # the stage's --method choices are the records'


def test_the_toy_methods_parameter_is_a_run_key_that_reaches_the_merge_rule(toy_method):
    from shardfuse.experiment.keys import merge_param_keys, merge_params

    assert merge_param_keys("toy_pick") == {"merge_pick": "pick"}  # read from RECORDS when called
    assert merge_params({"merge_method": "toy_pick", "merge_pick": 1, "merge_t": 0.3}) == {"pick": 1}
