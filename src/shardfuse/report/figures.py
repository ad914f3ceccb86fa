"""Figures of results/summary.csv (merge methods side by side, score vs communication) and the drawing
helpers every shardfuse figure shares (Agg backend, deterministic atomic PNGs, zoomed score axes).

A library, no command line: :mod:`shardfuse.plots` draws these figures (``compare``, ``communication``)
next to the per-run plots::

    python -m shardfuse.plots compare --summary results/summary.csv --out results/plots/merge_methods.png

The score is the task's (accuracy, mse, loss: see :mod:`shardfuse.models.tasks`); runs ranked by different
scores never share a panel, and every axis says which way is better.

``compare`` (``merge_methods.png``): a dot plot, one row per run (its name, merge method and training),
the best merged test score at the top, whichever way the score points. Per row the merged model is a
dot (its value right of the panel) and the references it is judged against are marks: the ranks' span
from mean to best rank, the ranks' output-averaged ensemble, and the ddp baseline (one dashed line when
every run shares it, a square per row otherwise). A row lacking a value lacks its mark. The axis is
zoomed to the drawn values, never stretched to 0-1: fused models of one training differ by thousandths.
The initial model (scored before training) is named under the axis, not drawn: it would flatten the rest.
The legend sits below the panels, never on the data.

``communication``: the merged model's test score against ``bytes_all_reduced_per_rank`` (the summary's
column, from train.json) on a log x axis, one labelled point per run, coloured by training mode. Runs
that communicated nothing (independent training) cannot sit on a log axis: they are drawn one decade
left of the smallest non-zero count (at 1 B when no run communicated), on a tick labelled ``0 B``, left
of a dotted line. Runs without a byte count (trainings from before train.json recorded it) are left out
and named under the plot.
"""

from __future__ import annotations

import csv
import io
import math
from collections.abc import Iterable
from pathlib import Path
from typing import NamedTuple

import numpy as np

from shardfuse.io import UserError, atomic_path, read_text
from shardfuse.models.tasks import Task, task_for, task_names
from shardfuse.strategies.registry import mode_colors

MERGED_COLOR, RANK_COLOR, SUMMARY_COLOR, BASELINE_COLOR = "#d62728", "#7f9fbf", "#4c4c4c", "#2ca02c"
ENSEMBLE_COLOR = "#8c564b"  # the ranks' output-averaged ensemble: the reference a fused model aims at
INITIAL_COLOR = "#a0a0a0"  # the initial model: not the ddp baseline's green, the two read alike otherwise
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


def zoomed_limits(values: Iterable[float], margin: float = 0.06) -> tuple[float, float]:
    """An axis range from the data alone plus a small margin: never stretched to 0 or to 1, so scores a
    few thousandths apart (fused models of one training usually are) stay apart."""
    finite = [v for v in values if math.isfinite(v)]
    if not finite:
        return 0.0, 1.0
    low, high = min(finite), max(finite)
    pad = margin * (high - low) if high > low else max(0.01 * abs(high), 1e-3)
    return low - pad, high + pad


def far_outside(value: float, others: Iterable[float]) -> bool:
    """Whether ``value`` lies further from the others' range than that range is wide: on one axis with
    it, the others would share less than half of it (the initial model, scored before any training,
    usually does that to the trained ones)."""
    finite = [v for v in others if math.isfinite(v)]
    if not finite or not math.isfinite(value):
        return False
    low, high = min(finite), max(finite)
    return max(low - value, value - high) > max(high - low, 1e-12)


def task_of_score() -> dict[str, Task]:
    """Score -> task, for summary rows (scores differ between tasks); accuracy first: old summaries
    have no other."""
    return {task.score: task for task in map(task_for, task_names())}


def row_task(row: dict[str, str]) -> Task:
    """The task a summary row was scored for: its ``task`` cell, else the score whose best-rank cell
    it fills (summaries of one task have no task column)."""
    if row.get("task"):
        return task_for(row["task"])
    for score, task in task_of_score().items():
        if row.get(f"test_{score}_best_rank") not in (None, ""):
            return task
    raise UserError(f"summary row {row.get('run')!r} has no best-rank score; re-run the summary stage")


def read_summary(path: Path) -> list[dict[str, str]]:
    if not path.is_file():
        raise UserError(f"{path} does not exist; run the summary stage first")
    text = read_text(path, "delete it and re-run the summary stage")
    rows = list(csv.DictReader(io.StringIO(text, newline="")))
    header = set(rows[0]) if rows else set()
    # A failed run's row (its error, no scores) is not drawn (shardfuse.experiment.outcome).
    rows = [row for row in rows if not row.get("error")]
    needed = {"run", "merge_method"}
    if not any({f"test_{score}_merged", f"test_{score}_best_rank"} <= header for score in task_of_score()):
        needed |= {"test_accuracy_merged", "test_accuracy_best_rank"}
    missing = needed - header
    if not rows or missing:
        raise UserError(f"{path} has no rows or lacks {', '.join(sorted(missing))}; re-run the summary stage")
    return rows


class RunScores(NamedTuple):
    """One row of the merge-methods plot: a run's merged test score and what it is judged against, in
    the run's score; None where the summary has no value (that mark is then left out)."""

    label: str
    merged: float | None
    best_rank: float | None
    mean_rank: float | None
    ensemble: float | None
    ddp_baseline: float | None
    initial: float | None  # the initial model, before any training: named under the axis, not drawn

    def drawn(self) -> list[float]:
        """The values drawn on the axis (not the initial model's)."""
        marks = (self.merged, self.best_rank, self.mean_rank, self.ensemble, self.ddp_baseline)
        return [value for value in marks if value is not None]


# The merge-methods plot's marks, in legend order.
MERGED, RANK_SPAN, BEST, MEAN = "merged model", "ranks: mean to best", "best rank", "mean rank"
ENSEMBLE, DDP_SHARED, DDP = "ensemble of the ranks", "ddp baseline (all runs)", "ddp baseline (per run)"
LEGEND_ORDER = (MERGED, RANK_SPAN, BEST, MEAN, ENSEMBLE, DDP_SHARED, DDP)


def cell(row: dict[str, str], column: str) -> float | None:
    """A summary cell as a number; None when empty, absent or not finite."""
    value = row.get(column)
    if value in (None, ""):
        return None
    parsed = float(value)
    return parsed if math.isfinite(parsed) else None


def run_label(row: dict[str, str]) -> str:
    """The run's name, its merge method (unless the name is the method) and the training it fused."""
    method = row.get("merge_method") or ""
    label = row["run"] if method in ("", row["run"]) else f"{row['run']}: {method}"
    ranks = f"{row['world_size']} ranks" if row.get("world_size") else ""
    training = ", ".join(part for part in (row.get("mode") or row.get("strategy") or "", ranks) if part)
    return f"{label} ({training})" if training else label


def run_scores(row: dict[str, str], task: Task) -> RunScores:
    prefix = f"test_{task.score}_"
    initial = cell(row, prefix + "initial")
    if initial is None:  # summaries from before the column said what it is
        initial = cell(row, prefix + "base")
    kinds = ("merged", "best_rank", "mean_rank", "ensemble", "ddp_baseline")
    return RunScores(run_label(row), *(cell(row, prefix + kind) for kind in kinds), initial)


def score_groups(rows: Iterable[dict[str, str]]) -> list[tuple[Task, list[RunScores]]]:
    """One group per score (runs of different scores share no axis), in the order the tasks are listed;
    in each, the runs best merged score first, whichever way the score points, runs without one last."""
    by_task: dict[str, tuple[Task, list[dict[str, str]]]] = {}
    for row in rows:
        task = row_task(row)
        by_task.setdefault(task.name, (task, []))[1].append(row)
    groups = []
    for task, members in sorted(by_task.values(), key=lambda group: task_names().index(group[0].name)):
        runs = [run_scores(row, task) for row in members]
        runs.sort(key=lambda r: (r.merged is None, 0.0 if r.merged is None else task.sort_key(r.merged)))
        groups.append((task, runs))
    return groups


def _scatter(ax, runs: list[RunScores], field: str, handles: dict, label: str, **style) -> None:
    """One mark per run that has ``field``; runs without it simply lack the mark."""
    points = [(getattr(run, field), y) for y, run in enumerate(runs) if getattr(run, field) is not None]
    if points:
        handles[label] = ax.scatter(*zip(*points, strict=True), label=label, **style)


def _initial_note(runs: list[RunScores], limits: tuple[float, float]) -> str:
    values = [run.initial for run in runs if run.initial is not None]
    if not values:
        return ""
    low, high = min(values), max(values)
    shown = number(low) if low == high else f"{number(low)} to {number(high)}"
    outside = any(not limits[0] <= value <= limits[1] for value in values)
    return f"\ninitial model (before training): {shown}" + (", off the axis" if outside else ", not drawn")


def _merge_methods_panel(ax, task: Task, runs: list[RunScores], handles: dict) -> None:
    for y in range(1, len(runs), 2):  # stripes keep the eye on a row across a wide panel
        ax.axhspan(y - 0.5, y + 0.5, color="#f3f3f3", linewidth=0, zorder=0)
    spans = [
        (y, r.mean_rank, r.best_rank) for y, r in enumerate(runs) if None not in (r.best_rank, r.mean_rank)
    ]
    if spans:
        ys, means, bests = zip(*spans, strict=True)
        left, right = np.minimum(means, bests), np.maximum(means, bests)
        handles[RANK_SPAN] = ax.hlines(ys, left, right, color=RANK_COLOR, linewidth=5, alpha=0.55, zorder=1,
                                       label=RANK_SPAN)  # fmt: skip
    baselines = {run.ddp_baseline for run in runs}
    if len(baselines) == 1 and None not in baselines:  # one ddp training behind every run: one line
        handles[DDP_SHARED] = ax.axvline(baselines.pop(), color=BASELINE_COLOR, linestyle="--", linewidth=1.5,
                                         zorder=1, label=DDP_SHARED)  # fmt: skip
    else:
        _scatter(ax, runs, "ddp_baseline", handles, DDP, marker="s", s=80, facecolors="none",
                 edgecolors=BASELINE_COLOR, linewidths=1.5, zorder=2)  # fmt: skip
    _scatter(ax, runs, "mean_rank", handles, MEAN, marker="o", s=34, facecolors="white",
             edgecolors=SUMMARY_COLOR, linewidths=1.2, zorder=3)  # fmt: skip
    _scatter(ax, runs, "best_rank", handles, BEST, marker="|", s=260, color=SUMMARY_COLOR, linewidths=2.5,
             zorder=3)  # fmt: skip
    _scatter(ax, runs, "merged", handles, MERGED, marker="o", s=64, color=MERGED_COLOR, zorder=4)
    # Above the merged dot: a merged model often scores exactly what the ensemble does (a few test rows).
    _scatter(ax, runs, "ensemble", handles, ENSEMBLE, marker="D", s=30, color=ENSEMBLE_COLOR,
             edgecolors="white", linewidths=0.6, zorder=5)  # fmt: skip
    for y, run in enumerate(runs):  # the merged score in figures, a column right of the panel
        if run.merged is not None:
            ax.text(1.01, y, number(run.merged), transform=ax.get_yaxis_transform(), va="center",
                    fontsize="small", color=MERGED_COLOR)  # fmt: skip
    ax.set_yticks(range(len(runs)), [run.label for run in runs])
    ax.set_ylim(len(runs) - 0.5, -0.5)  # best at the top
    limits = zoomed_limits(value for run in runs for value in run.drawn())
    ax.set_xlim(*limits)
    ax.grid(axis="x", alpha=0.3)
    ax.set_xlabel(score_label(task) + _initial_note(runs, limits))


def merge_methods_figure(rows: list[dict[str, str]]):
    """Every run a row, best merged score first, on an axis zoomed to the scores (see the module
    docstring); a panel per score, the legend below them all."""
    groups = score_groups(rows)
    heights = [len(runs) + 2.5 for _, runs in groups]  # the rows, and room for the axis labels
    fig, axes = pyplot().subplots(len(groups), 1, figsize=(9.0, 0.3 * sum(heights) + 1.0), squeeze=False,
                                  layout="constrained", gridspec_kw={"height_ratios": heights})  # fmt: skip
    handles: dict = {}
    for ax, (task, runs) in zip(axes.flat, groups, strict=True):
        _merge_methods_panel(ax, task, runs, handles)
        if len(groups) > 1:
            ax.set_title(task.name, loc="left", fontsize="medium")
    labels = [label for label in LEGEND_ORDER if label in handles]
    fig.legend([handles[label] for label in labels], labels, loc="outside lower center", fontsize="small",
               ncol=min(4, len(labels)))  # fmt: skip
    fig.suptitle("Merge methods: each run's merged model against its ranks and baselines, best first")
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
    colors = mode_colors()  # the strategies' records
    for mode in dict.fromkeys(p.mode for p in points):
        mine = [(x, p) for x, p in zip(xs, points, strict=True) if p.mode == mode]
        ax.scatter([x for x, _ in mine], [p.score for _, p in mine], s=40, zorder=3, label=mode,
                   color=colors.get(mode, OTHER_MODE_COLOR))  # fmt: skip
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


def panels_by_score(
    points: list, draw, *, width: float, title: str, empty: str, missing: str, left_out: list[str]
):
    """A figure of one panel per score (runs ranked by different scores share no axis), in the order the
    tasks are listed: ``draw(ax, task, points of that score)`` fills each. Without points, ``empty`` in
    place of a panel; the runs ``left_out`` named under it ("Not shown (``missing``): ...")."""
    by_score: dict[str, list] = {}
    for point in sorted(points, key=lambda p: task_names().index(p.task.name)):
        by_score.setdefault(point.task.score, []).append(point)
    panels = max(1, len(by_score))
    fig, axes = pyplot().subplots(1, panels, figsize=(width * panels, 4.5), squeeze=False)
    for ax, members in zip(axes.flat, by_score.values(), strict=False):
        draw(ax, members[0].task, members)
    if not points:
        axes[0, 0].set_axis_off()
        axes[0, 0].text(0.5, 0.5, empty, ha="center", va="center", transform=axes[0, 0].transAxes)
    if left_out:
        fig.text(0.01, -0.02, f"Not shown ({missing}): " + ", ".join(left_out), fontsize="small")
    fig.suptitle(title)
    return fig


def communication_figure(rows: list[dict[str, str]]):
    """Merged score vs bytes all-reduced per rank, a panel per score (see the module docstring)."""
    points, left_out = communication_points(rows)
    zero_x = zero_bytes_position(points)
    return panels_by_score(
        points,
        lambda ax, task, members: _communication_panel(ax, task, members, zero_x),
        width=6.5,
        title="Merged model vs communication per rank",
        empty="No run has a byte count yet: its training predates the count, or the\n"
        "summary does (re-run the train or the summary stage).",
        missing="no byte count",
        left_out=left_out,
    )


def plot_communication(summary: Path, out: Path) -> Path:
    fig = communication_figure(read_summary(summary))
    out.parent.mkdir(parents=True, exist_ok=True)
    return save_figure(fig, out)
