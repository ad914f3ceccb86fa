"""shardfuse.plots: real PNGs from fabricated run directories and summary tables (Agg backend)."""

from __future__ import annotations

from dataclasses import replace

import matplotlib.image
import numpy as np
import pytest

from shardfuse import plots
from shardfuse.experiment.records import EvalRecord
from shardfuse.io import UserError
from shardfuse.report import figures
from tests.support.report import summary_row, write_summary_csv
from tests.support.tracking import make_run_dir, regression_evaluation


def test_run_plots_are_three_deterministic_pngs_written_atomically(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "pictured", world_size=3, num_steps=120, training="shared")
    train_dir = tmp_path / "results" / "trainings" / "shared" / "ranks"
    written = plots.plot_run(run_dir, run_dir / "plots", train_dir)
    assert [p.name for p in written] == list(plots.RUN_PLOTS)
    for path in written:
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05  # not a blank canvas
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(plots.RUN_PLOTS)  # no temp files
    first = {p.name: p.read_bytes() for p in written}
    again = plots.plot_run(run_dir, run_dir / "plots", train_dir)
    assert {p.name: p.read_bytes() for p in again} == first  # same data, same bytes: no needless re-upload


def test_fusion_bars_show_merged_each_rank_best_mean_and_baselines_when_present(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "fused", world_size=2, ddp_baseline=True)
    evaluation = EvalRecord.read(run_dir / "eval.json")
    bars = plots.fusion_bars(evaluation)
    assert [(label, round(value, 3)) for label, value, _ in bars] == [
        ("merged", 0.8), ("rank 0", 0.7), ("rank 1", 0.72), ("best rank", 0.72), ("mean rank", 0.71),
        ("ddp baseline\n(ddp)", 0.83), ("initial model", 0.34),
    ]  # fmt: skip
    evaluation = replace(evaluation, ddp_baseline=None, base=None)
    assert [label for label, _, _ in plots.fusion_bars(evaluation)][-1] == "mean rank"
    with pytest.raises(UserError, match=r"^eval.json lacks 'merged'; re-run the evaluate stage"):
        plots.fusion_bars(replace(evaluation, merged=None))


def test_smoothing_keeps_a_trend_and_damps_noise():
    rng = np.random.default_rng(0)
    trend = np.linspace(2.0, 0.5, 500)
    noisy = trend + rng.normal(scale=0.2, size=500)
    smoothed = plots.smooth(noisy)
    assert smoothed.shape == noisy.shape
    assert np.abs(smoothed - trend).mean() < 0.4 * np.abs(noisy - trend).mean()
    np.testing.assert_allclose(plots.smooth(np.full(100, 3.0)), 3.0)


def test_run_plots_without_metrics_are_a_one_line_user_error(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "unmeasured")
    for path in (run_dir / "train" / "metrics").glob("*.parquet"):
        path.unlink()
    with pytest.raises(UserError, match=r"train/metrics has no rank-\*\.parquet; re-run the train stage"):
        plots.plot_run(run_dir, run_dir / "plots", run_dir / "train")


def test_fusion_plot_of_a_regression_run_shows_mse_lower_is_better_and_a_positive_gain():
    fig = plots.fusion_figure(EvalRecord.from_json(regression_evaluation("reg", ddp_baseline=True)), "reg")
    (ax,) = fig.axes
    assert ax.get_ylabel() == "test mse (lower is better)"
    assert ax.get_title() == "reg: merged vs ranks (fusion gain +0.050)"  # merged mse 0.25, best rank 0.30
    evaluation = EvalRecord.from_json(regression_evaluation("reg"))
    labels = [label for label, _, _ in plots.fusion_bars(evaluation)]
    assert labels == ["merged", "rank 0", "rank 1", "best rank", "mean rank", "initial model"]
    without_best = replace(evaluation, best_rank=None)  # the task picks it: the lowest mse, not the highest
    bars = {label: value for label, value, _ in plots.fusion_bars(without_best)}
    assert bars["best rank"] == pytest.approx(0.3)
    figures.pyplot().close(fig)


def test_fusion_plot_of_a_classification_run_says_higher_is_better_on_a_range_from_the_data(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "cls", ddp_baseline=True)
    fig = plots.fusion_figure(EvalRecord.read(run_dir / "eval.json"), "cls")
    (ax,) = fig.axes
    assert ax.get_ylabel() == "test accuracy (higher is better)"
    assert ax.get_title() == "cls: merged vs ranks (fusion gain +0.080)"
    low, high = ax.get_ylim()
    assert 0.6 < low < 0.7 and 0.83 < high < 0.95  # not anchored at 0, not forced up to 1
    figures.pyplot().close(fig)


def test_merge_methods_plot_puts_each_score_in_its_own_panels_with_its_direction(tmp_path):
    rows = [
        summary_row("a", "independent", "uniform", 0.8, training="t1"),
        summary_row("b", "independent", "ties", 0.82, training="t1"),
        {"run": "r", "training": "t2", "merge_method": "uniform", "test_accuracy_merged": "",
         "test_accuracy_best_rank": "", "test_mse_merged": 0.25, "test_mse_best_rank": 0.3},
        {"run": "s", "training": "t2", "merge_method": "ties", "test_accuracy_merged": "",
         "test_accuracy_best_rank": "", "test_mse_merged": 0.35, "test_mse_best_rank": 0.3},
    ]  # fmt: skip
    extra = ("training", "test_mse_merged", "test_mse_best_rank")
    rows = figures.read_summary(write_summary_csv(tmp_path / "summary.csv", rows, extra))
    assert [(task.score, [r.label for r in runs]) for task, runs in figures.score_groups(rows)] == [
        ("accuracy", ["b: ties (independent, 2 ranks)", "a: uniform (independent, 2 ranks)"]),
        ("mse", ["r: uniform", "s: ties"]),
    ]  # best merged score first: the higher accuracy, the lower mse
    fig = figures.merge_methods_figure(rows)
    shown = [ax for ax in fig.axes if ax.get_visible()]
    assert [ax.get_xlabel() for ax in shown] == [
        "test accuracy (higher is better)",
        "test mse (lower is better)",
    ]
    assert [[t.get_text() for t in ax.get_yticklabels()] for ax in shown] == [
        ["b: ties (independent, 2 ranks)", "a: uniform (independent, 2 ranks)"],
        ["r: uniform", "s: ties"],
    ]
    assert shown[0].get_xlim()[0] > 0.79 and shown[0].get_xlim()[1] < 0.91  # zoomed to 0.80-0.90 (best rank)
    assert shown[1].get_xlim()[0] < 0.25 and shown[1].get_xlim()[1] > 0.35
    figures.pyplot().close(fig)


def test_a_summary_row_with_no_score_is_a_user_error(tmp_path):
    row = {"run": "x", "test_accuracy_best_rank": "", "test_mse_best_rank": ""}
    with pytest.raises(UserError, match="summary row 'x' has no best-rank score; re-run the summary stage"):
        figures.row_task(row)
    assert figures.row_task({**row, "task": "regression"}).score == "mse"
    assert figures.row_task({**row, "test_mse_best_rank": "0.3"}).lower_is_better
    assert list(figures.task_of_score()) == ["accuracy", "mse", "loss"]  # old summaries: accuracy first


def test_fusion_plot_marks_the_ensemble_next_to_best_and_mean_rank_and_titles_the_fusion_gap():
    evaluation = EvalRecord.from_json(regression_evaluation("reg", ddp_baseline=True, ensemble=True))
    bars = plots.fusion_bars(evaluation)
    assert [label.split("\n")[0] for label, _, _ in bars] == [
        "merged", "rank 0", "rank 1", "best rank", "mean rank", "ensemble", "ddp baseline", "initial model",
    ]  # fmt: skip
    assert {label: (value, color) for label, value, color in bars}["ensemble"] == (
        pytest.approx(0.21),
        figures.ENSEMBLE_COLOR,
    )
    fig = plots.fusion_figure(evaluation, "reg")
    (ax,) = fig.axes
    # merged mse 0.25: 0.05 better than the best rank, 0.04 worse than the ensemble (mse 0.21).
    assert ax.get_title() == "reg: merged vs ranks (fusion gain +0.050, fusion gap +0.040)"
    figures.pyplot().close(fig)


def test_merge_methods_plot_marks_the_ensemble_where_the_summary_has_it(tmp_path):
    rows = [
        summary_row("a", "independent", "uniform", 0.8, training="t1", test_accuracy_ensemble=0.97),
        summary_row("b", "independent", "ties", 0.82, training="t1", test_accuracy_ensemble=0.97),
    ]
    path = write_summary_csv(tmp_path / "summary.csv", rows, ("training", "test_accuracy_ensemble"))
    fig = figures.merge_methods_figure(figures.read_summary(path))
    ax = fig.axes[0]
    assert [text.get_text() for text in fig.legends[0].get_texts()] == [
        "merged model",
        "best rank",
        "ensemble of the ranks",
    ]
    assert ax.get_xlim()[1] > 0.97  # the mark is in range
    figures.pyplot().close(fig)
    old = write_summary_csv(tmp_path / "old.csv", [summary_row("a", "independent", "uniform", 0.8)])
    fig = figures.merge_methods_figure(figures.read_summary(old))
    assert [text.get_text() for text in fig.legends[0].get_texts()] == ["merged model", "best rank"]
    figures.pyplot().close(fig)
