"""What a reader sees in the comparison plots (issue 17): the merge-methods dot plot, a row per run on a
zoomed axis, best first, its references as marks and its legend off the data; the fusion plot zoomed to
the trained models, an initial model far worse than them an arrow at the edge."""

from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest

from shardfuse import plots
from shardfuse.experiment.records import EvalRecord
from shardfuse.report import figures
from tests.support.tracking import make_run_dir, regression_evaluation

# The default experiment's summary as it came out (digits, 18 runs): w2 runs judged against ddp, w4 runs
# against ddp_w4; every run's initial model scores 0.053.
W2 = {"world_size": 2, "test_accuracy_ddp_baseline": 0.9637, "test_accuracy_base": 0.0529}
W4 = {"world_size": 4, "test_accuracy_ddp_baseline": 0.9526, "test_accuracy_base": 0.0529}
W4_RANKS = {**W4, "mode": "independent", "test_accuracy_best_rank": 0.9331, "test_accuracy_mean_rank": 0.9240,
            "test_accuracy_ensemble": 0.9470}  # fmt: skip
W4_MERGED = {"soup_uniform": 0.9470, "soup_greedy": 0.9303, "task_arithmetic": 0.9470, "ties": 0.9303,
             "dare": 0.9275, "model_stock": 0.9470, "breadcrumbs": 0.9080, "breadcrumbs_ties": 0.9192,
             "della": 0.9442, "sce": 0.9359, "multislerp": 0.9470, "karcher": 0.9470}  # fmt: skip


def _same(value: float) -> dict:
    return {f"test_accuracy_{kind}": value for kind in ("merged", "best_rank", "mean_rank", "ensemble")}


def default_experiment_rows() -> list[dict]:
    rows = [
        {"run": "ddp", "merge_method": "consolidate", "mode": "ddp", **W2, **_same(0.9637)},
        {"run": "localsgd", "merge_method": "uniform", "mode": "localsgd", **W2, **_same(0.9637)},
        {"run": "ddp_w4", "merge_method": "consolidate", "mode": "ddp", **W4, **_same(0.9526)},
    ]
    for run, method in (("independent", "weighted"), ("independent_slerp", "slerp"),
                        ("independent_nuslerp", "nuslerp")):  # fmt: skip
        rows.append({"run": run, "merge_method": method, "mode": "independent", **W2,
                     "test_accuracy_merged": 0.9526, "test_accuracy_best_rank": 0.9554,
                     "test_accuracy_mean_rank": 0.9484, "test_accuracy_ensemble": 0.9498})  # fmt: skip
    for run, merged in W4_MERGED.items():
        method = "greedy_soup" if run == "soup_greedy" else run.removeprefix("soup_")
        rows.append({"run": run, "merge_method": method, **W4_RANKS, "test_accuracy_merged": merged})
    return rows


def _marks(ax, label: str) -> np.ndarray:
    """(x, row) of the scatter marks with this legend label; empty when there are none."""
    found = [c.get_offsets() for c in ax.collections if c.get_label() == label]
    return np.concatenate(found) if found else np.empty((0, 2))


def _rows_top_down(fig, ax) -> list[str]:
    """The row labels as they appear on the drawn figure, top first (whatever the axis order)."""
    fig.canvas.draw()
    labels = [label for label in ax.get_yticklabels() if label.get_text()]
    return [label.get_text() for label in sorted(labels, key=lambda t: -t.get_window_extent().y0)]


@pytest.fixture
def close_figures():
    yield
    figures.pyplot().close("all")


def test_merge_methods_axis_is_zoomed_to_the_scores_never_stretched_to_0_1(close_figures):
    fig = figures.merge_methods_figure(default_experiment_rows())
    (ax,) = fig.axes
    low, high = ax.get_xlim()
    assert 0.89 < low < 0.908 and 0.9637 < high < 0.98  # all marks inside, a small margin, not 0-1
    kinds = (figures.MERGED, figures.BEST, figures.MEAN, figures.ENSEMBLE, figures.DDP)
    drawn = np.concatenate([_marks(ax, kind)[:, 0] for kind in kinds])
    (span,) = [c for c in ax.collections if c.get_label() == figures.RANK_SPAN]
    ends = np.concatenate([segment[:, 0] for segment in span.get_segments()])
    assert len(drawn) == 5 * 18 and low < min(drawn.min(), ends.min()) and max(drawn.max(), ends.max()) < high
    # The initial model (0.053) would flatten the rest: named under the axis instead.
    assert (
        ax.get_xlabel()
        == "test accuracy (higher is better)\ninitial model (before training): 0.053, off the axis"
    )


def test_merge_methods_rows_go_best_merged_score_first_whichever_way_the_score_points(close_figures):
    fig = figures.merge_methods_figure(default_experiment_rows())
    rows = _rows_top_down(fig, fig.axes[0])
    assert len(rows) == 18
    assert rows[:2] == ["ddp: consolidate (ddp, 2 ranks)", "localsgd: uniform (localsgd, 2 ranks)"]
    assert rows[-3:] == ["dare (independent, 4 ranks)", "breadcrumbs_ties (independent, 4 ranks)",
                         "breadcrumbs (independent, 4 ranks)"]  # fmt: skip
    merged = _marks(fig.axes[0], figures.MERGED)
    by_row = merged[np.argsort(merged[:, 1])][:, 0]  # row 0 is drawn at the top
    assert list(by_row) == sorted(by_row, reverse=True)
    # mse: lower is better, so the lowest merged mse is the top row.
    regression = [{"run": run, "merge_method": run, "test_mse_merged": mse, "test_mse_best_rank": 0.3}
                  for run, mse in (("b", 0.31), ("a", 0.25), ("c", 0.40))]  # fmt: skip
    fig = figures.merge_methods_figure(regression)
    assert _rows_top_down(fig, fig.axes[0]) == ["a", "b", "c"]
    assert fig.axes[0].get_xlabel() == "test mse (lower is better)"


@pytest.mark.parametrize("num_runs", [3, 18])
def test_merge_methods_legend_sits_outside_every_panel_and_row_labels_do_not_collide(num_runs, close_figures):
    rows = default_experiment_rows()[:num_runs]
    rows.append({"run": "reg", "merge_method": "ties", "test_mse_merged": 0.25, "test_mse_best_rank": 0.3})
    fig = figures.merge_methods_figure(rows)
    fig.canvas.draw()
    (legend,) = fig.legends
    box = legend.get_window_extent()
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert len(panels) == 2  # accuracy and mse never share an axis
    for ax in panels:
        assert not box.overlaps(ax.get_window_extent())
        assert not box.overlaps(ax.xaxis.label.get_window_extent())  # nor the axis label under it
    labels = sorted((t.get_window_extent() for t in panels[0].get_yticklabels()), key=lambda b: b.y0)
    assert all(lower.y1 <= upper.y0 + 0.5 for lower, upper in itertools.pairwise(labels))


def test_merge_methods_figure_grows_with_its_rows(close_figures):
    short = figures.merge_methods_figure(default_experiment_rows()[:3]).get_figheight()
    tall = figures.merge_methods_figure(default_experiment_rows()).get_figheight()
    assert tall > short + 0.25 * 15


def test_merge_methods_marks_the_references_each_row_has_and_skips_the_rest(close_figures):
    fig = figures.merge_methods_figure(default_experiment_rows())
    (ax,) = fig.axes
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        figures.MERGED, figures.RANK_SPAN, figures.BEST, figures.MEAN, figures.ENSEMBLE, figures.DDP,
    ]  # fmt: skip
    for label in (figures.MERGED, figures.BEST, figures.MEAN, figures.ENSEMBLE, figures.DDP):
        assert len(_marks(ax, label)) == 18, label
    # Two ddp baselines (w2, w4): a mark per row at its own, no shared line.
    assert sorted(set(np.round(_marks(ax, figures.DDP)[:, 0], 4))) == [0.9526, 0.9637]
    assert not [line for line in ax.lines if line.get_label() == figures.DDP_SHARED]

    # One ddp baseline for all: one vertical line. No ensemble in two rows, none in any: marks skipped.
    rows = [row for row in default_experiment_rows() if row["world_size"] == 4]
    rows[0]["test_accuracy_ensemble"], rows[1]["test_accuracy_ensemble"] = "", None
    fig = figures.merge_methods_figure(rows)
    (ax,) = fig.axes
    (line,) = [line for line in ax.lines if line.get_label() == figures.DDP_SHARED]
    assert line.get_xdata()[0] == pytest.approx(0.9526)
    assert len(_marks(ax, figures.DDP)) == 0
    assert len(_marks(ax, figures.ENSEMBLE)) == len(rows) - 2
    old = [
        {key: value for key, value in row.items() if "ensemble" not in key and "ddp" not in key}
        for row in rows
    ]
    fig = figures.merge_methods_figure(old)
    assert [t.get_text() for t in fig.legends[0].get_texts()] == [
        figures.MERGED, figures.RANK_SPAN, figures.BEST, figures.MEAN,
    ]  # fmt: skip


def test_merge_methods_reads_the_initial_model_column_under_either_name(close_figures):
    rows = [{"run": "a", "merge_method": "ties", "test_accuracy_merged": 0.93,
             "test_accuracy_best_rank": 0.94, "test_accuracy_initial": 0.1}]  # fmt: skip
    fig = figures.merge_methods_figure(rows)
    assert fig.axes[0].get_xlabel().endswith("initial model (before training): 0.100, off the axis")
    del rows[0]["test_accuracy_initial"]
    fig = figures.merge_methods_figure(rows)
    assert fig.axes[0].get_xlabel() == "test accuracy (higher is better)"  # no such column: no note


def test_zoomed_limits_and_far_outside():
    assert figures.zoomed_limits([0.93, 0.96]) == pytest.approx((0.9282, 0.9618))
    assert figures.zoomed_limits([0.5, 0.5]) == pytest.approx((0.495, 0.505))
    assert figures.far_outside(0.34, [0.7, 0.83]) and figures.far_outside(1.0, [0.21, 0.36])
    assert not figures.far_outside(0.6, [0.7, 0.83])  # 0.10 from a 0.13-wide range: drawn with them
    assert not figures.far_outside(0.75, [0.7, 0.83])


def _off_axis_notes(ax) -> list[str]:
    return [text.get_text() for text in ax.texts if "off the axis" in text.get_text()]


def test_fusion_plot_keeps_a_far_worse_initial_model_off_its_zoomed_axis(tmp_path, close_figures):
    run_dir, _ = make_run_dir(tmp_path, "cls", ddp_baseline=True)
    evaluation = EvalRecord.read(run_dir / "eval.json")  # ranks 0.70-0.83, initial model 0.34
    (ax,) = plots.fusion_figure(evaluation, "cls").axes
    low, high = ax.get_ylim()
    assert 0.34 < low < 0.70 and 0.83 < high < 0.9
    assert low > 0.6  # zoomed: the 0.13 between the ranks and the ddp baseline fill the axis
    assert _off_axis_notes(ax) == ["0.340\noff the axis"]
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert "initial model" in labels and not [label for label in labels if label.startswith("base")]
    colors = {label: color for label, _, color in plots.fusion_bars(evaluation)}
    assert colors["initial model"] != colors["ddp baseline\n(ddp)"]  # the two must not read alike

    closer = replace(evaluation, base={**evaluation.base, "accuracy": 0.65})  # close to the ranks: among them
    (ax,) = plots.fusion_figure(closer, "cls").axes
    assert ax.get_ylim()[0] < 0.65 and not _off_axis_notes(ax)

    # mse: the initial model is far *above* (worse); the arrow sits at the top edge.
    regression = EvalRecord.from_json(regression_evaluation("reg", ddp_baseline=True, ensemble=True))
    (ax,) = plots.fusion_figure(regression, "reg").axes
    low, high = ax.get_ylim()
    assert 0.15 < low < 0.21 and 0.32 < high < 1.0
    assert _off_axis_notes(ax) == ["1.000\noff the axis"]
