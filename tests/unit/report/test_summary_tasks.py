"""Runs of every task side by side: summary.csv, the headline metrics and the plots ask the task
(its score and direction) instead of saying "accuracy"; runs that all classify keep the old bytes."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path

import pytest

from shardfuse import summary
from shardfuse.experiment.records import TrainRecord
from shardfuse.io import UserError
from shardfuse.report import figures
from shardfuse.track import inputs as tracking_inputs
from tests.support.tracking import make_run_dir, regression_evaluation

# The header summary.csv had before tasks existed, spelled out so that no edit to COLUMNS can move it.
CLASSIFICATION_HEADER = (
    "run", "training", "dataset", "world_size", "strategy", "sync_every", "merge_method",
    "test_accuracy_merged", "test_loss_merged", "test_accuracy_best_rank", "test_accuracy_mean_rank",
    "test_accuracy_base", "test_accuracy_ddp_baseline", "fusion_gain", "max_abs_diff_between_ranks",
    "num_steps", "train_seconds",
)  # fmt: skip
# Appended to every header by the train stage's communication record (train_seconds is already above).
TRAINING_COLUMNS = ("mode", "effective_batch_size", "bytes_all_reduced_per_rank")
# Appended last by the ensemble of the ranks (the evaluate stage scores it since issue 16).
ENSEMBLE_COLUMNS = ("test_accuracy_ensemble", "fusion_gap")
MSE_COLUMNS = ("test_mse_merged", "test_mse_best_rank", "test_mse_mean_rank", "test_mse_base",
               "test_mse_ddp_baseline")  # fmt: skip


def classification_evaluation(run: str, merged: float, ddp_baseline: float | None = None) -> dict:
    """eval.json of a classification run as evaluate wrote it before tasks (no task/score keys)."""
    ranks = [{"rank": 0, "loss": 0.6, "accuracy": 0.7}, {"rank": 1, "loss": 0.65, "accuracy": 0.7123456789}]
    return {
        "run": run,
        "test_rows": 300,
        "merged": {"loss": 0.5, "accuracy": merged},
        "base": {"loss": 1.1, "accuracy": 1 / 3},
        "ranks": ranks,
        "best_rank_accuracy": 0.7123456789,
        "mean_rank_accuracy": (0.7 + 0.7123456789) / 2,
        "mean_rank_loss": 0.625,
        "fusion_gain": merged - 0.7123456789,
        "ddp_baseline": None
        if ddp_baseline is None
        else {"run": "ddp", "loss": 0.4, "accuracy": ddp_baseline},
    }


def with_task_keys(evaluation: dict) -> dict:
    """The same classification results as the evaluate stage writes them now."""
    keys = {"task": "classification", "score": "accuracy", "lower_is_better": False}
    return {**evaluation, **keys, "metrics": ["loss", "accuracy"]}


RUN_CONFIG = {"training": "t0", "dataset": "d", "world_size": 2, "strategy": "independent", "sync_every": ""}


def write_run(root: Path, run: str, evaluation: dict, train: dict | None = None, **cfg) -> dict:
    """eval.json, merge.json and the training's train.json where summary reads them; the run's config.

    ``train``: train.json fields besides num_steps and train_seconds (none: an old train stage's)."""
    run_dir = root / "runs" / run
    run_dir.mkdir(parents=True)
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    merge = {"method": "uniform", "max_abs_diff_between_ranks": 0.125}
    (run_dir / "merge.json").write_text(json.dumps(merge))
    cfg = {**RUN_CONFIG, **cfg}
    ranks = root / "trainings" / cfg["training"] / "ranks"
    ranks.mkdir(parents=True, exist_ok=True)
    (ranks / "train.json").write_text(
        json.dumps({"num_steps": 40, "train_seconds": 3.14159, **(train or {})})
    )
    return cfg


def run_summary(root: Path, evaluations: dict[str, dict]) -> tuple[list[str], list[dict[str, str]], bytes]:
    runs = {run: write_run(root, run, evaluation) for run, evaluation in evaluations.items()}
    out = root / "summary.csv"
    summary.write_summary(runs, root / "runs", root / "trainings", out)
    with open(out, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = list(reader)
    return list(reader.fieldnames or ()), rows, out.read_bytes()


def old_summary_bytes(evaluations: dict[str, dict]) -> bytes:
    """summary.csv as the stage wrote it before tasks existed (its code, inlined)."""
    text = io.StringIO(newline="")
    writer = csv.DictWriter(text, fieldnames=CLASSIFICATION_HEADER)
    writer.writeheader()
    cfg = RUN_CONFIG
    for run in evaluations:
        evaluation, baseline = evaluations[run], evaluations[run].get("ddp_baseline") or {}
        writer.writerow({
            "run": run, "training": cfg["training"], "dataset": cfg["dataset"],
            "world_size": cfg["world_size"], "strategy": cfg["strategy"], "sync_every": cfg["sync_every"],
            "merge_method": "uniform", "test_accuracy_merged": evaluation["merged"]["accuracy"],
            "test_loss_merged": evaluation["merged"]["loss"],
            "test_accuracy_best_rank": evaluation["best_rank_accuracy"],
            "test_accuracy_mean_rank": evaluation["mean_rank_accuracy"],
            "test_accuracy_base": evaluation["base"]["accuracy"],
            "test_accuracy_ddp_baseline": baseline.get("accuracy", ""),
            "fusion_gain": evaluation["fusion_gain"], "max_abs_diff_between_ranks": 0.125, "num_steps": 40,
            "train_seconds": round(3.14159, 3),
        })  # fmt: skip
    return text.getvalue().encode()


@pytest.mark.parametrize("task_keys", [False, True], ids=["old-eval-json", "eval-json-with-task"])
def test_classification_only_summary_is_the_old_csv_byte_for_byte_then_the_training_columns(
    tmp_path, task_keys
):
    evaluations = {
        "ddp": classification_evaluation("ddp", 0.8312),
        "indep": classification_evaluation("indep", 0.79, 0.8312),
    }
    if task_keys:
        evaluations = {run: with_task_keys(evaluation) for run, evaluation in evaluations.items()}
    header, rows, written = run_summary(tmp_path, evaluations)
    assert tuple(header) == (*CLASSIFICATION_HEADER, *TRAINING_COLUMNS, *ENSEMBLE_COLUMNS)
    assert CLASSIFICATION_HEADER == summary.COLUMNS
    assert summary.summary_columns(["classification"]) == (
        *CLASSIFICATION_HEADER, *TRAINING_COLUMNS, *ENSEMBLE_COLUMNS
    )  # fmt: skip
    # An old train.json: the mode comes from the run's strategy, the counts are unknown (empty); an
    # eval.json without an ensemble: its cells are empty too.
    old_lines = old_summary_bytes(evaluations).decode().split("\r\n")
    new_lines = written.decode().split("\r\n")
    assert new_lines[0] == old_lines[0] + "," + ",".join((*TRAINING_COLUMNS, *ENSEMBLE_COLUMNS))
    assert new_lines[1:] == [line + ",independent,,,," if line else line for line in old_lines[1:]]
    assert rows[1]["test_accuracy_ddp_baseline"] == "0.8312" and rows[0]["test_accuracy_ddp_baseline"] == ""


def test_regression_runs_fill_test_mse_columns_and_a_positive_gain_when_merged_mse_is_lower(tmp_path):
    header, rows, _ = run_summary(tmp_path, {"reg": regression_evaluation("reg", ddp_baseline=True)})
    after = CLASSIFICATION_HEADER.index("test_accuracy_ddp_baseline") + 1
    extra = (*MSE_COLUMNS, "test_mae_merged", "test_r2_merged")
    expected = (*CLASSIFICATION_HEADER[:after], *extra, *CLASSIFICATION_HEADER[after:], *TRAINING_COLUMNS,
                "test_mse_ensemble", "fusion_gap")  # fmt: skip
    # No classification run: no accuracy columns, which would be empty in every row.
    assert tuple(header) == tuple(c for c in expected if not c.startswith("test_accuracy_"))
    (row,) = rows
    assert float(row["test_mse_merged"]) == pytest.approx(0.25)
    assert float(row["test_mse_best_rank"]) == pytest.approx(0.30)
    assert float(row["test_mse_mean_rank"]) == pytest.approx(0.31)
    assert float(row["test_mse_base"]) == pytest.approx(1.0)
    assert float(row["test_mse_ddp_baseline"]) == pytest.approx(0.22)
    assert float(row["test_r2_merged"]) == pytest.approx(0.75) and float(
        row["test_mae_merged"]
    ) == pytest.approx(0.38)
    assert float(row["test_loss_merged"]) == pytest.approx(0.26)
    assert float(row["fusion_gain"]) == pytest.approx(0.05)  # lower mse than the best rank: positive


def test_mixed_tasks_get_a_task_column_and_leave_other_tasks_cells_empty(tmp_path):
    causal = regression_evaluation("lm")  # the same shape, ranked by loss
    metrics = ["loss", "perplexity", "bits_per_token", "bits_per_byte"]
    causal.update(task="causal_lm", score="loss", metrics=metrics)
    for entry in (causal["merged"], causal["base"], *causal["ranks"]):
        entry.update(perplexity=2.0, bits_per_token=1.0, bits_per_byte=1.0)
    causal.update(best_rank_loss=0.31, fusion_gain=0.31 - 0.26)
    evaluations = {
        "cls": classification_evaluation("cls", 0.8),
        "reg": regression_evaluation("reg"),
        "lm": causal,
    }
    header, rows, _ = run_summary(tmp_path, evaluations)
    after = header.index("test_accuracy_ddp_baseline") + 1
    assert header[after : header.index("fusion_gain")] == [
        "task", *MSE_COLUMNS, "test_mae_merged", "test_r2_merged", "test_loss_best_rank",
        "test_loss_mean_rank", "test_loss_base", "test_loss_ddp_baseline", "test_perplexity_merged",
        "test_bits_per_token_merged", "test_bits_per_byte_merged",
    ]  # fmt: skip
    assert len(header) == len(set(header))  # causal_lm's test_loss_merged is the existing column
    by_run = {row["run"]: row for row in rows}
    assert [by_run[r]["task"] for r in ("cls", "reg", "lm")] == ["classification", "regression", "causal_lm"]
    assert by_run["cls"]["test_mse_merged"] == "" and by_run["reg"]["test_accuracy_merged"] == ""
    assert float(by_run["lm"]["test_loss_best_rank"]) == pytest.approx(0.31)
    assert by_run["cls"]["test_loss_best_rank"] == "" and by_run["lm"]["test_mse_best_rank"] == ""
    assert [figures.row_task(by_run[r]).score for r in ("cls", "reg", "lm")] == ["accuracy", "mse", "loss"]


def test_training_columns_come_from_train_json_and_stay_empty_for_old_trainings(tmp_path):
    diloco = {"mode": "diloco", "effective_batch_size": 256, "bytes_all_reduced_per_rank": 4_000_000_000}
    trainings = {  # run -> (train.json fields, run config fields)
        "diloco": ({**diloco, "strategy": "diloco", "sync_every": 16}, {}),
        "indep": ({"mode": "independent", "effective_batch_size": 64, "bytes_all_reduced_per_rank": 0}, {}),
        # Trainings from before train.json said its mode: derived from their strategy and sync_every.
        "old_ddp": ({"strategy": "ddp", "sync_every": 0}, {}),
        "old_local": ({"strategy": "localsgd", "sync_every": 0}, {}),
        "old_cfg": (None, {"strategy": "localsgd", "sync_every": 8}),
    }
    runs = {
        run: write_run(tmp_path, run, regression_evaluation(run), train, training=f"t-{run}", **cfg)
        for run, (train, cfg) in trainings.items()
    }
    out = tmp_path / "summary.csv"
    summary.write_summary(runs, tmp_path / "runs", tmp_path / "trainings", out)
    with open(out, newline="") as fh:
        reader = csv.DictReader(fh)
        assert tuple(reader.fieldnames[-6:]) == (
            "train_seconds",
            *TRAINING_COLUMNS,
            "test_mse_ensemble",
            "fusion_gap",
        )
        cells = {row["run"]: tuple(row[c] for c in TRAINING_COLUMNS) for row in reader}
    assert cells == {
        "diloco": ("diloco", "256", "4000000000"),
        "indep": ("independent", "64", "0"),  # 0 bytes is known, not empty
        "old_ddp": ("ddp", "", ""),
        "old_local": ("independent", "", ""),
        "old_cfg": ("localsgd", "", ""),
    }


def test_training_mode_prefers_train_json_then_its_strategy_then_the_run_config():
    def mode(train_json: dict, cfg: dict) -> str:
        return TrainRecord.from_json(train_json).training_mode(cfg.get("strategy"), cfg.get("sync_every"))

    assert mode({"mode": "diloco", "strategy": "localsgd", "sync_every": 0}, {}) == "diloco"
    assert mode({"strategy": "localsgd", "sync_every": 4}, {"strategy": "ddp"}) == "localsgd"
    assert mode({}, {"strategy": "localsgd", "sync_every": ""}) == "independent"
    assert mode({}, {"strategy": "ddp", "sync_every": 0}) == "ddp"
    assert mode({}, {}) == ""


def test_summary_main_prints_each_runs_own_score(tmp_path, capsys):
    evaluations = {"cls": classification_evaluation("cls", 0.8), "reg": regression_evaluation("reg")}
    runs = {run: write_run(tmp_path, run, evaluation) for run, evaluation in evaluations.items()}
    args = ["--runs-json", json.dumps(runs), "--results-dir", tmp_path / "runs"]
    summary.main(
        [*map(str, args), "--trainings-dir", str(tmp_path / "trainings"), "--out", str(tmp_path / "s.csv")]
    )
    lines = capsys.readouterr().out.splitlines()
    assert "merged accuracy 0.8000  best rank 0.7123" in lines[0]
    assert "merged mse 0.2500  best rank 0.3000" in lines[1]


def test_regression_headline_metrics_name_mse_r2_and_no_accuracy(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "reg", world_size=2, ddp_baseline=True)
    (run_dir / "eval.json").write_text(json.dumps(regression_evaluation("reg", ddp_baseline=True)))
    inputs = tracking_inputs.load_inputs(run_dir, manifest)
    headline = inputs.headline
    assert not [name for name in headline if "accuracy" in name]
    expected = {
        "test_mse_merged": 0.25, "test_loss_merged": 0.26, "test_mae_merged": 0.38, "test_r2_merged": 0.75,
        "test_mse_best_rank": 0.30, "test_mse_mean_rank": 0.31, "test_loss_mean_rank": 0.32,
        "test_mse_initial": 1.0, "test_mse_ddp_baseline": 0.22, "test_mse_rank_0": 0.30,
        "test_mse_rank_1": 0.32, "fusion_gain": 0.05, "ddp_gap": 0.25 - 0.22,
    }  # fmt: skip
    assert {name: headline[name] for name in expected} == pytest.approx(expected)
    assert inputs.ranks[1].test_metrics == pytest.approx(
        {"test_mse": 0.32, "test_loss": 0.33, "test_mae": 0.41, "test_r2": 0.68}
    )


def test_headline_fusion_gain_is_computed_with_the_task_when_eval_json_has_none(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "reg")
    evaluation = regression_evaluation("reg")
    del evaluation["fusion_gain"]
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    assert tracking_inputs.load_inputs(run_dir, manifest).headline["fusion_gain"] == pytest.approx(0.05)


def test_classification_headline_metrics_keep_their_names_and_values(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "cls", world_size=2, ddp_baseline=True)
    old = tracking_inputs.load_inputs(run_dir, manifest).headline
    evaluation = with_task_keys(json.loads((run_dir / "eval.json").read_text()))
    evaluation["fusion_gain"] = evaluation["merged"]["accuracy"] - evaluation["best_rank_accuracy"]
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    new = tracking_inputs.load_inputs(run_dir, manifest).headline
    assert new == old
    assert sorted(old) == sorted([
        "test_accuracy_merged", "test_loss_merged", "test_accuracy_best_rank", "test_accuracy_mean_rank",
        "test_loss_mean_rank", "train_seconds", "merge_seconds", "fusion_gain", "test_accuracy_initial",
        "test_accuracy_ddp_baseline", "ddp_gap", "test_accuracy_rank_0", "test_accuracy_rank_1",
        "samples_per_second", "shard_rows_cv",  # the test manifest records no label counts
    ])  # fmt: skip
    # How much better the ddp baseline scores than the merged model (accuracy: higher is better).
    assert old["ddp_gap"] == pytest.approx(old["test_accuracy_ddp_baseline"] - old["test_accuracy_merged"])


def test_an_eval_json_ranked_by_a_score_its_task_does_not_use_is_a_user_error():
    evaluation = regression_evaluation("reg")
    evaluation["score"] = "accuracy"
    with pytest.raises(UserError, match=r"ranks regression by 'accuracy', but shardfuse ranks it by 'mse'"):
        tracking_inputs.evaluation_task(evaluation)
    with pytest.raises(UserError, match=r"unknown task 'poetry'.*re-run the evaluate stage"):
        tracking_inputs.evaluation_task({"task": "poetry"})


def test_ensemble_columns_come_last_and_stay_empty_for_an_eval_json_without_an_ensemble(tmp_path):
    without_gap = regression_evaluation("reg_nogap", ensemble=True)
    del without_gap["fusion_gap"]  # computed with the task from the ensemble and merged scores
    evaluations = {
        "cls": classification_evaluation("cls", 0.8),  # an older evaluate stage: no ensemble
        "reg": regression_evaluation("reg", ensemble=True),
        "reg_nogap": without_gap,
    }
    header, rows, _ = run_summary(tmp_path, evaluations)
    assert tuple(header[-6:]) == (
        *TRAINING_COLUMNS,
        "test_accuracy_ensemble",
        "test_mse_ensemble",
        "fusion_gap",
    )
    by_run = {row["run"]: row for row in rows}
    ensemble = ("test_accuracy_ensemble", "test_mse_ensemble", "fusion_gap")
    assert tuple(by_run["cls"][c] for c in ensemble) == ("", "", "")
    for run in ("reg", "reg_nogap"):
        assert by_run[run]["test_accuracy_ensemble"] == ""
        assert float(by_run[run]["test_mse_ensemble"]) == pytest.approx(0.21)
        assert float(by_run[run]["fusion_gap"]) == pytest.approx(0.04)  # ensemble mse lower: positive


def test_headline_metrics_carry_the_ensemble_and_fusion_gap_only_when_eval_json_has_them(tmp_path):
    run_dir, manifest = make_run_dir(tmp_path, "reg")
    (run_dir / "eval.json").write_text(json.dumps(regression_evaluation("reg", ensemble=True)))
    headline = tracking_inputs.load_inputs(run_dir, manifest).headline
    expected = {
        "test_mse_ensemble": 0.21, "test_loss_ensemble": 0.22, "test_mae_ensemble": 0.35,
        "test_r2_ensemble": 0.79, "fusion_gap": 0.04,
    }  # fmt: skip
    assert {name: headline[name] for name in expected} == pytest.approx(expected)
    evaluation = regression_evaluation("reg", ensemble=True)
    del evaluation["fusion_gap"]
    (run_dir / "eval.json").write_text(json.dumps(evaluation))
    assert tracking_inputs.load_inputs(run_dir, manifest).headline["fusion_gap"] == pytest.approx(0.04)
    (run_dir / "eval.json").write_text(json.dumps(regression_evaluation("reg")))
    old = tracking_inputs.load_inputs(run_dir, manifest).headline
    assert not [name for name in old if name.endswith("_ensemble") or name == "fusion_gap"]


def test_a_failed_run_is_a_row_of_its_config_and_error_and_the_figures_draw_the_others(tmp_path):
    """The workflow's report after a failed run (shardfuse.experiment.outcome): the finished run's row as
    always, with no baseline from the failed ddp run; the failed run's row reads none of its files."""
    cfg = write_run(tmp_path, "indep", with_task_keys(classification_evaluation("indep", 0.79)))
    runs = {
        "ddp": {**RUN_CONFIG, "training": "t-ddp", "strategy": "ddp"},
        "indep": {**cfg, "ddp_baseline": "ddp"},
    }
    error = "shardfuse.launch: error: rank 0 failed: RuntimeError: boom"
    out = tmp_path / "summary.csv"
    summary.write_summary(runs, tmp_path / "runs", tmp_path / "trainings", out, {"ddp": error})

    with open(out, newline="") as fh:
        reader = csv.DictReader(fh)
        rows = {row["run"]: row for row in reader}
    assert tuple(reader.fieldnames) == (*CLASSIFICATION_HEADER, *TRAINING_COLUMNS, *ENSEMBLE_COLUMNS, "error")
    assert rows["ddp"]["error"] == error and rows["ddp"]["strategy"] == "ddp"
    assert rows["ddp"]["training"] == "t-ddp" and rows["ddp"]["test_accuracy_merged"] == ""
    assert rows["indep"]["error"] == "" and rows["indep"]["test_accuracy_merged"] == "0.79"
    assert rows["indep"]["test_accuracy_ddp_baseline"] == ""
    assert [row["run"] for row in figures.read_summary(out)] == ["indep"]

    with pytest.raises(UserError, match=r"ddp/eval\.json does not exist"):  # without it named: its files
        summary.write_summary(runs, tmp_path / "runs", tmp_path / "trainings", tmp_path / "all.csv")
