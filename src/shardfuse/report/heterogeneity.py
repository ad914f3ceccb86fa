"""The figure of results/summary.csv across shard sets: each run's merged test score against how
heterogeneous its shards were (``shard_label_jsd_mean``, the mean Jensen-Shannon divergence, base 2, of
each rank's label distribution to the pooled one: 0 = iid labels, 1 = disjoint), one line per way of
training and fusing (the summary's ``mode`` and, where one mode was fused several ways, its merge
method), the ddp runs among them. A label-skew sweep (partition_alpha from 100 down to 0.1) reads left
to right as the shards grow apart; NVFlare's and Hsu et al.'s accuracy-against-alpha curves, with the
measured skew on the x axis instead of the knob that drew it.

A library, no command line: ``python -m shardfuse.plots heterogeneity --summary results/summary.csv
--out results/plots/heterogeneity.png``. Runs without a label divergence (an all-iid summary from before
the column, a regression dataset) are named under the plot, not drawn.
"""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

from shardfuse.models.tasks import Task
from shardfuse.report.figures import (
    OTHER_MODE_COLOR,
    cell,
    panels_by_score,
    read_summary,
    row_task,
    save_figure,
    score_label,
)
from shardfuse.strategies.registry import mode_colors

SKEW_COLUMN = "shard_label_jsd_mean"


class SkewPoint(NamedTuple):
    run: str
    line: str  # the mode, with the merge method where a mode was fused several ways
    mode: str
    skew: float
    task: Task
    score: float


def skew_points(rows: Iterable[dict[str, str]]) -> tuple[list[SkewPoint], list[str]]:
    """(the runs with a label divergence and a merged score, the names of the others)."""
    rows = list(rows)
    methods: dict[str, set[str]] = {}
    for row in rows:
        methods.setdefault(row.get("mode") or "unknown", set()).add(row.get("merge_method") or "")
    points, left_out = [], []
    for row in rows:
        task = row_task(row)
        skew, score = cell(row, SKEW_COLUMN), cell(row, f"test_{task.score}_merged")
        if skew is None or score is None:
            left_out.append(row["run"])
            continue
        mode = row.get("mode") or "unknown"
        line = mode if len(methods[mode]) == 1 else f"{mode}, {row.get('merge_method')}"
        points.append(SkewPoint(row["run"], line, mode, skew, task, score))
    return points, left_out


def _panel(ax, task: Task, points: list[SkewPoint]) -> None:
    colors = mode_colors()  # the strategies' records
    styles = ("-", "--", ":", "-.")
    seen_modes: dict[str, int] = {}
    for line in dict.fromkeys(p.line for p in points):
        mine = sorted((p for p in points if p.line == line), key=lambda p: p.skew)
        mode = mine[0].mode
        style = styles[seen_modes.get(mode, 0) % len(styles)]
        seen_modes[mode] = seen_modes.get(mode, 0) + 1
        ax.plot([p.skew for p in mine], [p.score for p in mine], style, marker="o", linewidth=1.6,
                color=colors.get(mode, OTHER_MODE_COLOR), label=line)  # fmt: skip
    ax.set_xlabel("label skew of the shards: mean Jensen-Shannon divergence to the pooled labels (bits)")
    ax.set_ylabel("merged " + score_label(task))
    ax.grid(alpha=0.3)
    ax.legend(title="training, fusion", fontsize="small")


def heterogeneity_figure(rows: list[dict[str, str]]):
    """Merged score vs label skew, a panel per score (see the module docstring)."""
    points, left_out = skew_points(rows)
    return panels_by_score(
        points,
        _panel,
        width=7.5,
        title="Merged model vs label skew of the shards",
        empty=f"No run has a label skew ({SKEW_COLUMN}): its shard sets are iid, or its\n"
        "dataset has no class labels.",
        missing="no label skew",
        left_out=left_out,
    )


def plot_heterogeneity(summary: Path, out: Path) -> Path:
    fig = heterogeneity_figure(read_summary(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)
