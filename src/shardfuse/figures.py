"""Figures of results/summary.csv (merge methods side by side, score vs communication) and the drawing
helpers every shardfuse figure shares (Agg backend, deterministic atomic PNGs, bars, score labels).

A library, no command line: :mod:`shardfuse.plots` draws these figures (``compare``, ``communication``)
next to the per-run plots::

    python -m shardfuse.plots communication --summary results/summary.csv \\
        --out results/plots/communication.png

The score is the task's (accuracy, mse, loss: see :mod:`shardfuse.tasks`); runs ranked by different
scores never share a panel, and every axis says which way is better.

``compare`` marks each run's best rank and, when summary.csv has the column, the ranks' output-averaged
ensemble (the reference a fused model is judged against).

``communication``: the merged model's test score against ``bytes_all_reduced_per_rank`` (the summary's
column, from train.json) on a log x axis, one labelled point per run, coloured by training mode. Runs
that communicated nothing (independent training) cannot sit on a log axis: they are drawn one decade
left of the smallest non-zero count (at 1 B when no run communicated), on a tick labelled ``0 B``, left
of a dotted line. Runs without a byte count (trainings from before train.json recorded it) are left out
and named under the plot.
"""

from __future__ import annotations

import csv
import math
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from shardfuse.io import UserError, atomic_path
from shardfuse.tasks import TASKS, Task, task_for

GROUP_COLUMNS = ("dataset", "world_size", "strategy")
MERGED_COLOR, RANK_COLOR, SUMMARY_COLOR, BASELINE_COLOR = "#d62728", "#7f9fbf", "#4c4c4c", "#2ca02c"
ENSEMBLE_COLOR = "#8c564b"  # the ranks' output-averaged ensemble: the reference a fused model aims at
# Score -> task, for summary rows (scores differ between tasks); accuracy first: old summaries have no other.
TASK_OF_SCORE: dict[str, Task] = {task.score: task for task in map(task_for, TASKS)}
MODE_COLORS = {"ddp": "#1f77b4", "localsgd": "#ff7f0e", "diloco": "#9467bd", "independent": "#2ca02c"}
OTHER_MODE_COLOR = "#7f7f7f"
BYTE_UNITS = ("B", "kB", "MB", "GB", "TB", "PB")


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: Path) -> Path:
    """Write a PNG atomically; no timestamp or version in it, so unchanged data gives identical bytes."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    pyplot().close(fig)
    return path


def score_label(task: Task) -> str:
    return f"test {task.score} ({'lower' if task.lower_is_better else 'higher'} is better)"


def number(value: float, sign: str = "") -> str:
    """Three decimals (accuracies, losses); significant digits for what they would hide (mse in
    large units, a tiny gain)."""
    if value == 0 or 1e-3 <= abs(value) < 1e4 or not math.isfinite(value):
        return f"{value:{sign}.3f}"
    return f"{value:{sign}.3g}"


def value_limits(values: Iterable[float]) -> tuple[float, float]:
    """y range from the data, always holding 0 (bars start there) and room for the value labels."""
    finite = [v for v in values if math.isfinite(v)]
    low, high = min([0.0, *finite]), max([0.0, *finite])
    span = (high - low) or 1.0
    return (low - 0.08 * span if low < 0 else 0.0), high + 0.08 * span


def bar_chart(ax, bars: list[tuple[str, float, str]], limits: tuple[float, float] | None = None) -> None:
    positions = np.arange(len(bars))
    ax.bar(positions, [b[1] for b in bars], color=[b[2] for b in bars])
    for x, (_, value, _) in zip(positions, bars, strict=True):
        ax.annotate(number(value), (x, value), ha="center", va="bottom", fontsize="small",
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.set_xticks(positions, [b[0] for b in bars], rotation=30 if len(bars) > 6 else 0, ha="right")
    ax.set_ylim(*(limits or value_limits(b[1] for b in bars)))
    ax.grid(axis="y", alpha=0.3)


def row_task(row: dict[str, str]) -> Task:
    """The task a summary row was scored for: its ``task`` cell, else the score whose best-rank cell
    it fills (summaries of one task have no task column)."""
    if row.get("task"):
        return task_for(row["task"])
    for score, task in TASK_OF_SCORE.items():
        if row.get(f"test_{score}_best_rank") not in (None, ""):
            return task
    raise UserError(f"summary row {row.get('run')!r} has no best-rank score; re-run the summary stage")


def read_summary(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise UserError(f"{path} does not exist; run the summary stage first")
    with open(path, newline="") as fh:
        rows = list(csv.DictReader(fh))
    header = set(rows[0]) if rows else set()
    needed = {"run", "merge_method"}
    if not any({f"test_{score}_merged", f"test_{score}_best_rank"} <= header for score in TASK_OF_SCORE):
        needed |= {"test_accuracy_merged", "test_accuracy_best_rank"}
    missing = needed - header
    if not rows or missing:
        raise UserError(f"{path} has no rows or lacks {', '.join(sorted(missing))}; re-run the summary stage")
    return rows


def training_groups(rows: Iterable[dict[str, str]]) -> dict[str, list[dict[str, str]]]:
    """Runs that share their training: by the ``training`` column, else dataset + world size + strategy."""
    groups: dict[str, list[dict[str, str]]] = {}
    for row in rows:
        if row.get("training"):
            key = row["training"]
        else:
            key = " / ".join(f"{c} {row[c]}" if c == "world_size" else row.get(c, "?") for c in GROUP_COLUMNS)
        groups.setdefault(key, []).append(row)
    return groups


def score_panels(rows: Iterable[dict[str, str]]) -> list[tuple[Task, list[dict[str, str]]]]:
    """One panel per training group and score (a group's runs share their data, so normally one
    score), panels of one score side by side in the order their scores' tasks are listed."""
    panels = []
    for members in training_groups(rows).values():
        by_task: dict[str, tuple[Task, list[dict[str, str]]]] = {}
        for row in members:
            task = row_task(row)
            by_task.setdefault(task.name, (task, []))[1].append(row)
        panels += by_task.values()
    return sorted(panels, key=lambda panel: TASKS.index(panel[0].name))  # stable: group order kept


def ensemble_marks(rows: list[dict[str, str]], task: Task) -> list[tuple[int, float]]:
    """(position, score) of the ranks' ensemble for the rows that have one (summaries since issue 16)."""
    cells = [(x, row.get(f"test_{task.score}_ensemble")) for x, row in enumerate(rows)]
    return [(x, float(cell)) for x, cell in cells if cell not in (None, "")]


def merge_methods_figure(rows: list[dict[str, str]]):
    """Merged score per merge method, a panel per training, the best rank and (where the summary has
    it) the ranks' ensemble marked in each."""
    panels = score_panels(rows)
    columns = min(3, len(panels))
    num_rows = math.ceil(len(panels) / columns)
    widest = max(len(members) for _, members in panels)
    fig, axes = pyplot().subplots(
        num_rows, columns, figsize=(columns * max(3.5, 0.9 * widest + 1.5), num_rows * 3.8), squeeze=False
    )
    # Panels of one score share a y range, so their bars compare at a glance.
    values: dict[str, list[float]] = {}
    for task, members in panels:
        for row in members:
            values.setdefault(task.score, []).extend(
                float(row[f"test_{task.score}_{kind}"]) for kind in ("merged", "best_rank")
            )
            values[task.score] += [value for _, value in ensemble_marks([row], task)]
    previous = ""
    for index, (ax, (task, members)) in enumerate(zip(axes.flat, panels, strict=False)):
        score = task.score
        bars = [(r["merge_method"], float(r[f"test_{score}_merged"]), MERGED_COLOR) for r in members]
        bar_chart(ax, bars, value_limits(values[score]))
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_xlim(-0.6, max(len(bars), 3) - 0.4)  # a lone bar stays bar-sized
        best = [float(r[f"test_{score}_best_rank"]) for r in members]
        ax.scatter(
            range(len(bars)), best, marker="_", s=600, color=SUMMARY_COLOR, zorder=3, label="best rank"
        )
        if marks := ensemble_marks(members, task):
            ax.scatter(*zip(*marks, strict=True), marker="_", s=600, color=ENSEMBLE_COLOR, zorder=3,
                       label="ensemble")  # fmt: skip
        first = members[0]
        title = f"{first.get('dataset', '?')}, world size {first.get('world_size', '?')}, "
        title += first.get("strategy", "?")
        if first.get("sync_every") not in (None, ""):
            title += f" (sync_every {first['sync_every']})"
        ax.set_title(title, fontsize="medium")
        ax.legend(fontsize="small", loc="lower right")
        if index % columns == 0 or score != previous:
            ax.set_ylabel("merged " + score_label(task))
            if index % columns:  # a label between panels needs the room
                fig.subplots_adjust(wspace=0.4)
        previous = score
    for ax in list(axes.flat)[len(panels) :]:
        ax.set_visible(False)
    fig.suptitle("Merge methods side by side (runs that share their training)")
    return fig


def plot_merge_methods(summary: Path, out: Path) -> Path:
    fig = merge_methods_figure(read_summary(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)


class CommunicationPoint(NamedTuple):
    """One run on the communication plot."""

    run: str
    mode: str  # the summary's mode cell ("unknown" when empty)
    num_bytes: int  # bytes_all_reduced_per_rank
    task: Task
    score: float  # the merged model's test score


def communication_points(rows: Iterable[dict[str, str]]) -> tuple[list[CommunicationPoint], list[str]]:
    """(the runs with a byte count and a merged score, the runs without: older trainings or summaries)."""
    points, left_out = [], []
    for row in rows:
        task = row_task(row)
        num_bytes, score = row.get("bytes_all_reduced_per_rank", ""), row.get(f"test_{task.score}_merged", "")
        if num_bytes in (None, "") or score in (None, ""):
            left_out.append(row["run"])
            continue
        mode = row.get("mode") or "unknown"
        points.append(CommunicationPoint(row["run"], mode, int(float(num_bytes)), task, float(score)))
    return points, left_out


def byte_label(value: float) -> str:
    """Decimal units, as network payloads are quoted: 1 kB = 1000 B."""
    if value < 1:
        return f"{value:g} B"
    unit = min(int(math.log10(value) // 3), len(BYTE_UNITS) - 1)
    return f"{value / 1000**unit:g} {BYTE_UNITS[unit]}"


def zero_bytes_position(points: Iterable[CommunicationPoint]) -> float:
    """Where runs that communicated nothing go: a decade left of the smallest non-zero count, else 1 B."""
    positive = [p.num_bytes for p in points if p.num_bytes > 0]
    return 10.0 ** (math.floor(math.log10(min(positive))) - 1) if positive else 1.0


def byte_ticks(points: list[CommunicationPoint], zero_x: float) -> dict[float, str]:
    """Tick position -> label: ``0 B`` where the runs without communication sit, then every decade (every
    few when they are many) from the smallest non-zero count's to the largest's."""
    ticks = {zero_x: "0 B"} if any(p.num_bytes == 0 for p in points) else {}
    positive = [p.num_bytes for p in points if p.num_bytes > 0]
    if positive:
        low, high = math.floor(math.log10(min(positive))), math.ceil(math.log10(max(positive)))
        step = max(1, math.ceil((high - low) / 8))
        ticks.update({10.0**k: byte_label(10.0**k) for k in range(low, high + 1, step)})
    return ticks


def _communication_panel(ax, task: Task, points: list[CommunicationPoint], zero_x: float) -> None:
    from matplotlib.ticker import NullFormatter

    xs = [p.num_bytes if p.num_bytes > 0 else zero_x for p in points]
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [(x, p) for x, p in zip(xs, points, strict=True) if p.mode == mode]
        ax.scatter([x for x, _ in mine], [p.score for _, p in mine], s=40, zorder=3, label=mode,
                   color=MODE_COLORS.get(mode, OTHER_MODE_COLOR))  # fmt: skip
    for x, point in zip(xs, points, strict=True):
        ax.annotate(point.run, (x, point.score), xytext=(5, 3), textcoords="offset points", fontsize="small")
    ax.set_xscale("log")
    ticks = byte_ticks(points, zero_x)
    ax.set_xticks(list(ticks), list(ticks.values()))
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlim(min(xs) / 10**0.5, max(xs) * 10**0.5)  # at least a decade wide
    if "0 B" in ticks.values():  # the 0 B tick is no point of the log scale: set it apart
        ax.axvline(zero_x * 10**0.5, color=SUMMARY_COLOR, linestyle=":", linewidth=1)
    ax.set_xlabel("bytes all-reduced per rank during training (log scale)")
    ax.set_ylabel("merged " + score_label(task))
    ax.grid(alpha=0.3)
    ax.legend(title="mode", fontsize="small")


def communication_figure(rows: list[dict[str, str]]):
    """Merged score vs bytes all-reduced per rank, a panel per score (see the module docstring)."""
    points, left_out = communication_points(rows)
    by_score: dict[str, list[CommunicationPoint]] = {}
    for point in sorted(points, key=lambda p: TASKS.index(p.task.name)):
        by_score.setdefault(point.task.score, []).append(point)
    fig, axes = pyplot().subplots(1, max(1, len(by_score)), figsize=(6.5 * max(1, len(by_score)), 4.5),
                                  squeeze=False)  # fmt: skip
    zero_x = zero_bytes_position(points)
    for ax, members in zip(axes.flat, by_score.values(), strict=False):
        _communication_panel(ax, members[0].task, members, zero_x)
    if not points:
        axes[0, 0].set_axis_off()
        axes[0, 0].text(0.5, 0.5, "No run has a byte count yet: its training predates the count, or the\n"
                        "summary does (re-run the train or the summary stage).", ha="center", va="center",
                        transform=axes[0, 0].transAxes)  # fmt: skip
    if left_out:
        fig.text(0.01, -0.02, "Not shown (no byte count): " + ", ".join(left_out), fontsize="small")
    fig.suptitle("Merged model vs communication per rank")
    return fig


def plot_communication(summary: Path, out: Path) -> Path:
    fig = communication_figure(read_summary(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)
