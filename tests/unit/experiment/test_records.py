"""train.json, merge.json and eval.json as typed records: what older stages wrote reads as None (never 0),
what a newer one writes survives a read and a write, what the stages write today is written back key for
key in their order, and anything but a JSON object is refused."""

from __future__ import annotations

import json
from dataclasses import fields, replace
from pathlib import Path

import pytest

from shardfuse.experiment.records import WRITTEN, EvalRecord, MergeRecord, TrainRecord, mode_of
from shardfuse.io import UserError
from shardfuse.models.tasks import evaluation_task


def test_a_record_round_trips_with_the_fields_a_newer_train_stage_adds():
    data = {"run": "t", "world_size": 2, "num_steps": 7, "train_seconds": 1.5, "future_field": [1, 2]}
    record = TrainRecord.from_json(data)
    assert record.num_steps == 7 and record.extra == {"future_field": [1, 2]}
    written = record.to_json()
    assert written["future_field"] == [1, 2] and TrainRecord.from_json(written) == record
    # The train stage writes every field, null where it has nothing to say (null is not absent).
    assert set(written) == WRITTEN | {"future_field"} and written["slurm_job_id"] is None


def test_an_older_train_json_reads_as_absent_fields_not_zeros(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"run": "old", "strategy": "localsgd", "sync_every": 0, "num_steps": 3}))
    record = TrainRecord.read(path)
    assert record.bytes_all_reduced_per_rank is None and record.effective_batch_size is None
    assert record.training_mode() == "independent"


@pytest.mark.parametrize(
    ("data", "run_config", "mode"),
    [
        ({"mode": "diloco", "strategy": "localsgd", "sync_every": 0}, {}, "diloco"),
        ({"strategy": "localsgd", "sync_every": 4}, {"strategy": "ddp"}, "localsgd"),
        ({}, {"strategy": "localsgd", "sync_every": ""}, "independent"),
        ({}, {"strategy": "ddp", "sync_every": 0}, "ddp"),
        ({}, {}, ""),
    ],
)
def test_the_mode_is_recorded_else_derived_from_the_record_else_from_the_run_config(data, run_config, mode):
    record = TrainRecord.from_json(data)
    assert record.training_mode(run_config.get("strategy"), run_config.get("sync_every")) == mode


def test_the_mode_rule_is_the_train_stages():
    assert [mode_of(s, n) for s, n in (("ddp", 0), ("localsgd", 0), ("localsgd", 5), ("diloco", 5))] == [
        "ddp",
        "independent",
        "localsgd",
        "diloco",
    ]


def test_anything_but_a_json_object_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match=r"train.json is not a JSON object; re-run the train stage"):
        TrainRecord.read(path)


# merge.json as the merge stage writes it from rank files, aligned and recalibrated: every optional field.
MERGE_JSON = {
    "run": "sweep", "training": "t", "method": "ties", "params": {"density": 0.5}, "num_ranks": 2,
    "base": {"path": "base.safetensors", "sha256": "b0"}, "weights": None, "greedy_soup": None,
    "alignment": {"method": "weight_matching", "sweeps": 3}, "hash": "blake3",
    "ingredients": [{"rank": 0, "path": "rank-0.safetensors", "sha256": "s0", "blake3": "k0", "rows": 5}],
    "recalibration": {"batchnorm_layers": 0, "sha256": "r1"}, "tensor_stats": {"w": {"max_abs_diff": 0.5}},
    "max_abs_diff_between_ranks": 0.5, "seconds": 0.25, "peak_rss_mb": 300.0, "output": "merged.safetensors",
    "sha256": "r1", "num_tensors": 1, "num_parameters": 12,
}  # fmt: skip
# ... and from a sharded checkpoint (consolidate --dcp-dir): no alignment, hash or recalibration, a dcp.
DCP_MERGE_JSON = {
    "run": "ddp", "training": "t", "method": "consolidate", "params": {"tolerance": 0.0}, "num_ranks": 2,
    "base": None, "weights": None, "greedy_soup": None, "ingredients": [],
    "dcp": {"dir": "dcp", "files": [], "skipped_tensors": ["optim.step"]}, "tensor_stats": {},
    "max_abs_diff_between_ranks": None, "seconds": 0.25, "peak_rss_mb": 300.0, "output": "merged.safetensors",
    "sha256": "r1", "num_tensors": 1, "num_parameters": 12,
}  # fmt: skip


@pytest.mark.parametrize("data", [MERGE_JSON, DCP_MERGE_JSON])
def test_merge_json_round_trips_in_the_order_the_merge_stage_writes_it(data):
    record = MergeRecord.from_json(data)
    assert record.extra == {} and (record.dcp is None) == (record.hash is not None)
    written = record.to_json()
    assert list(written) == list(data) and written == data
    # The optional fields are left out when unset; the others are written, null or not.
    assert MergeRecord.written() == {f.name for f in fields(MergeRecord)} - MergeRecord.OPTIONAL - {"extra"}


def test_an_older_or_newer_merge_json_reads_absent_fields_as_none_and_keeps_unknown_keys_last(tmp_path):
    path = tmp_path / "merge.json"
    path.write_text(
        json.dumps({"run": "old", "method": "uniform", "future": {"x": 1}, "weights": [0.5, 0.5]})
    )
    record = MergeRecord.read(path)
    assert (record.method, record.training, record.hash, record.ingredients) == ("uniform", None, None, None)
    assert record.extra == {"future": {"x": 1}} and list(record.to_json())[-1] == "future"


def eval_json(task: str, score: str, metrics: list[str]) -> dict:
    """eval.json as the evaluate stage writes it for ``task``, key for key (the score's keys in place)."""
    floor = {"perplexity": 1.0}  # each metric in its range (a perplexity is at least 1)
    merged = {metric: floor.get(metric, 0) + 0.5 for metric in metrics}
    ranks = [
        {"rank": rank, **{metric: floor.get(metric, 0) + 0.4 + 0.1 * rank for metric in metrics}}
        for rank in (0, 1)
    ]
    return {
        "run": "r", "training": "t", "test_rows": 10, "task": task, "score": score,
        "lower_is_better": task != "classification", "metrics": metrics, "merged": merged,
        "base": {metric: floor.get(metric, 0) + 0.1 for metric in metrics}, "ranks": ranks,
        f"best_rank_{score}": 0.45, f"mean_rank_{score}": 0.44, "mean_rank_loss": 0.44, "fusion_gain": 0.05,
        "ensemble": merged,
        f"ensemble_{score}": 0.55, "fusion_gap": 0.05, "ddp_baseline": None,
    }  # fmt: skip


EVAL_CASES = [
    ("classification", "accuracy", ["loss", "accuracy"]),
    ("regression", "mse", ["loss", "mse", "mae", "r2"]),
    # Scored by loss: mean_rank_loss is both mean_rank_<score> and the mean rank's loss, written once.
    ("causal_lm", "loss", ["loss", "perplexity", "bits_per_token", "bits_per_byte"]),
]


@pytest.mark.parametrize(("task", "score", "metrics"), EVAL_CASES)
def test_eval_json_round_trips_with_the_score_named_keys_mapped_to_typed_fields(task, score, metrics):
    data = eval_json(task, score, metrics)
    record = EvalRecord.from_json(data)
    assert (record.best_rank, record.mean_rank, record.ensemble_score) == (0.45, 0.44, 0.55)
    assert record.mean_rank_loss == 0.44 and record.extra == {}
    written = record.to_json()
    assert list(written) == list(data) and written == data
    assert {f"best_rank_{score}", f"mean_rank_{score}", f"ensemble_{score}"} <= set(written)
    assert evaluation_task(record).score == score  # the readers' check takes the record as the dict
    with pytest.raises(KeyError, match=f"best_rank_{score}"):
        replace(record, best_rank=None).required("best_rank")


@pytest.mark.parametrize(
    ("task", "score", "metrics", "where", "metric", "value", "problem"),
    [
        (*EVAL_CASES[0], "merged", "accuracy", 1.7, "merged accuracy 1.7 is outside [0, 1]"),
        (*EVAL_CASES[0], "ranks", "loss", -0.5, "ranks[1] loss -0.5 is outside [0, inf]"),
        (*EVAL_CASES[1], "ensemble", "r2", 1.5, "ensemble r2 1.5 is outside [-inf, 1]"),
        (*EVAL_CASES[2], "base", "perplexity", 0.5, "base perplexity 0.5 is outside [1, inf]"),
    ],
)
def test_an_impossible_score_in_eval_json_is_one_line_naming_the_file(
    task, score, metrics, where, metric, value, problem
):
    data = eval_json(task, score, metrics)
    if where == "ranks":
        data["ranks"][1][metric] = value
    else:
        data[where] = {**data[where], metric: value}
    with pytest.raises(UserError) as refused:
        EvalRecord.from_json(data, "results/runs/r/eval.json")
    assert str(refused.value) == (
        f"results/runs/r/eval.json: {problem} for task {task} (an edited or damaged file); re-run the "
        "evaluate stage"
    )


# What evaluate stages added since the first: tasks, then the fusion gain, the ddp baseline, the ensemble.
NEWER_EVAL_KEYS = (
    "task",
    "score",
    "fusion_gain",
    "ddp_baseline",
    "ensemble",
    "ensemble_accuracy",
    "fusion_gap",
)


def test_an_eval_json_from_before_tasks_and_the_ensemble_reads_as_classification_with_absent_fields(tmp_path):
    data = eval_json("classification", "accuracy", ["loss", "accuracy"])
    old = {key: value for key, value in data.items() if key not in NEWER_EVAL_KEYS}
    path = tmp_path / "eval.json"
    path.write_text(json.dumps({**old, "initial": {"accuracy": 0.2}}))
    record = EvalRecord.read(path)
    absent = ("task", "score", "fusion_gain", "ddp_baseline", "ensemble", "ensemble_score", "fusion_gap")
    assert [getattr(record, name) for name in absent] == [None] * len(absent)
    assert (record.best_rank, record.mean_rank) == (0.45, 0.44)  # best_rank_accuracy, as classification
    assert evaluation_task(record, path).name == "classification"
    assert record.extra == {"initial": {"accuracy": 0.2}} and record.initial_model() == {"accuracy": 0.2}
    written = record.to_json()
    assert written["best_rank_accuracy"] == 0.45 and written["initial"] == {"accuracy": 0.2}
    assert written["ensemble"] is None  # the evaluate stage writes every field


def test_an_eval_json_of_an_unknown_task_keeps_its_score_keys_for_the_readers_to_refuse():
    data = {"run": "r", "task": "poetry", "best_rank_rhyme": 0.5, "merged": {"rhyme": 0.5}}
    record = EvalRecord.from_json(data)
    assert record.best_rank is None and record.extra == {"best_rank_rhyme": 0.5}
    assert record.to_json()["best_rank_rhyme"] == 0.5
    with pytest.raises(UserError, match=r"^eval.json: unknown task 'poetry'.*; re-run the evaluate stage$"):
        evaluation_task(record)


@pytest.mark.parametrize(("record", "stage"), [(MergeRecord, "merge"), (EvalRecord, "evaluate")])
def test_a_merge_or_eval_json_that_is_no_json_object_is_refused_naming_the_file_and_stage(
    tmp_path, record, stage
):
    path = tmp_path / record.FILE
    path.write_text('"done"')
    with pytest.raises(UserError, match=rf"{record.FILE} is not a JSON object; re-run the {stage} stage"):
        record.read(path)


def test_the_ddp_baseline_is_filled_from_the_ddp_runs_eval_json(tmp_path):
    """evaluate no longer waits for the ddp run: plots, track and summary read its metrics instead."""
    from shardfuse.console.failures import baseline_warnings

    own = {"run": "soup", "task": "causal_lm", "score": "loss", "merged": {"loss": 2.0}, "ddp_baseline": None}
    ddp = {"run": "ddp", "task": "causal_lm", "score": "loss", "merged": {"loss": 1.5}, "ddp_baseline": None}
    (tmp_path / "soup.json").write_text(json.dumps(own))
    (tmp_path / "ddp.json").write_text(json.dumps(ddp))
    filled = EvalRecord.read_with_baseline(tmp_path / "soup.json", tmp_path / "ddp.json")
    assert filled.ddp_baseline == {"run": "ddp", "loss": 1.5}
    assert EvalRecord.read_with_baseline(tmp_path / "soup.json", None).ddp_baseline is None
    older = {**own, "ddp_baseline": {"run": "old", "loss": 9.0}}  # written by an evaluate that waited
    (tmp_path / "older.json").write_text(json.dumps(older))
    assert (
        EvalRecord.read_with_baseline(tmp_path / "older.json", tmp_path / "ddp.json").ddp_baseline["run"]
        == "old"
    )
    failed = [Path("logs/train/d-w2-ddp-abc.log")]
    baselines = {"soup": ("ddp", "d-w2-ddp-abc"), "ddp": ("ddp", "d-w2-ddp-abc"), "x": ("other", "t")}
    (warning,) = baseline_warnings(failed, baselines)
    assert warning.startswith("shardfuse: warning: ddp run ddp failed, so soup is evaluated without")
    assert baseline_warnings([Path("logs/merge/x.log")], baselines) == []


def test_eval_json_holds_a_score_per_set_and_an_older_file_reads_as_its_test_set():
    old = EvalRecord.from_json(eval_json(*EVAL_CASES[0]))
    assert old.set_names() == ["test"]
    assert old.scores_on("test") == {
        "kind": "test", "rows": 10, "merged": old.merged, "ranks": old.ranks, "ensemble": old.ensemble,
        "base": old.base,
    }  # fmt: skip
    local = {"kind": "local", "path": "l.parquet", "rows": 4, "merged": {"loss": 1.0, "accuracy": 0.25}}
    test = {**old.scores_on("test"), "path": "test.parquet"}
    new = EvalRecord.from_json({**eval_json(*EVAL_CASES[0]), "sets": {"test": test, "rank-0": local}})
    assert new.set_names() == ["test", "rank-0"] and new.scores_on("rank-0") == local
    assert list(new.to_json())[-1] == "sets" and EvalRecord.from_json(new.to_json()) == new
    with pytest.raises(
        UserError, match=r"eval.json has no scores on evaluation set 'domain-a' \(it has test, "
    ):
        new.scores_on("domain-a")
