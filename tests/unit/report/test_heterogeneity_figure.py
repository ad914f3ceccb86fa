"""results/plots/heterogeneity.png: each run's merged score against its shards' label skew, a line per
training mode (split by merge method where one mode was fused several ways), drawn from summary.csv."""

from __future__ import annotations

import matplotlib.colors
import matplotlib.image

from shardfuse.plots import main as plots_main
from shardfuse.report import figures
from shardfuse.report.heterogeneity import heterogeneity_figure, skew_points
from shardfuse.strategies.registry import mode_colors
from tests.support.report import summary_row, write_summary_csv

SKEW = ("mode", "shard_label_jsd_mean")


def _row(run, mode, method, merged, skew):
    return summary_row(run, mode, method, merged, mode=mode, shard_label_jsd_mean=skew)


ROWS = [
    _row("a100_ddp", "ddp", "consolidate", 0.95, 0.001),
    _row("a01_ddp", "ddp", "consolidate", 0.94, 0.39),
    _row("a1_ddp", "ddp", "consolidate", 0.95, 0.11),
    _row("a100_uniform", "independent", "uniform", 0.92, 0.001),
    _row("a01_uniform", "independent", "uniform", 0.67, 0.39),
    _row("a01_ties", "independent", "ties", 0.70, 0.39),
    _row("iid_old", "localsgd", "uniform", 0.93, ""),  # a summary cell left empty: not drawn
]


def test_each_mode_is_one_line_sorted_by_skew_and_a_mode_fused_two_ways_is_two(tmp_path):
    rows = figures.read_summary(write_summary_csv(tmp_path / "summary.csv", ROWS, SKEW))
    points, left_out = skew_points(rows)
    assert left_out == ["iid_old"]
    assert sorted({point.line for point in points}) == ["ddp", "independent, ties", "independent, uniform"]
    fig = heterogeneity_figure(rows)
    (ax,) = [ax for ax in fig.axes if ax.get_visible()]
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines["ddp"].get_xdata()) == [0.001, 0.11, 0.39]  # sorted by skew, not by row
    assert list(lines["ddp"].get_ydata()) == [0.95, 0.95, 0.94]
    assert list(lines["independent, uniform"].get_ydata()) == [0.92, 0.67]
    assert matplotlib.colors.to_hex(lines["ddp"].get_color()) == mode_colors()["ddp"]
    assert lines["independent, ties"].get_linestyle() != lines["independent, uniform"].get_linestyle()
    assert ax.get_ylabel() == "merged test accuracy (higher is better)"
    assert fig.texts[0].get_text() == "Not shown (no label skew): iid_old"
    figures.pyplot().close(fig)


def test_the_cli_writes_the_png_and_an_all_iid_summary_gets_a_note(tmp_path):
    summary = write_summary_csv(tmp_path / "summary.csv", ROWS, SKEW)
    out = tmp_path / "plots" / "heterogeneity.png"
    plots_main(["heterogeneity", "--summary", str(summary), "--out", str(out)])
    assert matplotlib.image.imread(out).shape[1] > 600
    iid = figures.read_summary(write_summary_csv(tmp_path / "iid.csv", ROWS[-1:], SKEW))
    fig = heterogeneity_figure(iid)
    assert "No run has a label skew" in fig.axes[0].texts[0].get_text()
    figures.pyplot().close(fig)
