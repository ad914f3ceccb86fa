"""Plots of one run (loss, throughput, merged vs ranks) and of merge methods across runs, as PNGs.

By hand::

    python -m shardfuse.plots --run-dir results/runs/ddp --train-dir results/trainings/<training>/ranks \\
        --out-dir results/runs/ddp/plots
    python -m shardfuse.plots compare --summary results/summary.csv --out results/plots/merge_methods.png

The run plots read the training's ``metrics/rank-*.parquet`` (under TRAIN_DIR) and the run's
``eval.json``; ``compare`` groups the rows of ``summary.csv`` that share their training (a ``training``
column if there is one, else dataset, world size and strategy) and shows each group's merged score per
run/merge method. The score is the task's (accuracy, mse, loss: see :mod:`shardfuse.tasks`); runs ranked
by different scores never share a panel, and every axis says which way is better. Matplotlib's Agg
backend, no display needed; every PNG is written atomically.
"""

from __future__ import annotations

import csv
import math
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.io import StageParser, UserError, atomic_path, read_json, run_cli
from shardfuse.tasks import TASKS, Task, evaluation_task, task_for
from shardfuse.tracking_inputs import read_step_metrics

RUN_PLOTS = ("loss.png", "throughput.png", "fusion.png")
GROUP_COLUMNS = ("dataset", "world_size", "strategy")
MERGED_COLOR, RANK_COLOR, SUMMARY_COLOR, BASELINE_COLOR = "#d62728", "#7f9fbf", "#4c4c4c", "#2ca02c"
# Score -> task, for summary rows (scores differ between tasks); accuracy first: old summaries have no other.
TASK_OF_SCORE: dict[str, Task] = {task.score: task for task in map(task_for, TASKS)}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def smooth(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average (about 2% of the points); the ends average over what exists."""
    values = np.asarray(values, dtype=np.float64)
    if window is None:
        window = max(1, len(values) // 50)
    if window <= 1 or len(values) < 3:
        return values
    kernel = np.ones(window)
    return np.convolve(values, kernel, mode="same") / np.convolve(np.ones(len(values)), kernel, mode="same")


def save_figure(fig, path: Path) -> Path:
    """Write a PNG atomically; no timestamp or version in it, so unchanged data gives identical bytes."""
    with atomic_path(path) as tmp:
        fig.savefig(tmp, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    _pyplot().close(fig)
    return path


def rank_metrics(train_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    paths = sorted((train_dir / "metrics").glob("rank-*.parquet"), key=lambda p: int(p.stem[5:]))
    if not paths:
        raise UserError(f"{train_dir}/metrics has no rank-*.parquet; re-run the train stage first")
    return {int(path.stem[5:]): read_step_metrics(path) for path in paths}


def _rank_colors(num_ranks: int) -> list:
    cmap = _pyplot().get_cmap("tab10" if num_ranks <= 10 else "viridis")
    return [cmap(i if num_ranks <= 10 else i / max(num_ranks - 1, 1)) for i in range(num_ranks)]


def plot_curves(
    metrics: dict[int, dict[str, np.ndarray]], key: str, ylabel: str, title: str, out: Path
) -> Path:
    """One line per rank vs step: raw (faint) and smoothed; log scale when the values span decades."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    colors = _rank_colors(len(metrics))
    finite = []
    for color, (rank, columns) in zip(colors, sorted(metrics.items()), strict=True):
        steps, values = columns["step"], columns[key].astype(np.float64)
        ax.plot(steps, values, color=color, alpha=0.25, linewidth=0.8)
        label = f"rank {rank}" + (
            f" (median {np.median(values):,.0f}/s)" if key == "samples_per_second" else ""
        )
        ax.plot(steps, smooth(values), color=color, linewidth=1.8, label=label)
        finite.extend(values[np.isfinite(values)].tolist())
    if finite and min(finite) > 0 and max(finite) / min(finite) > 30:
        ax.set_yscale("log")
    ax.set_xlabel("step")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize="small", ncol=max(1, math.ceil(len(metrics) / 8)))
    return save_figure(fig, out)


def score_label(task: Task) -> str:
    return f"test {task.score} ({'lower' if task.lower_is_better else 'higher'} is better)"


def fusion_bars(evaluation: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, test score, color) for the merged model, each rank, best/mean rank and baselines."""
    task = evaluation_task(evaluation)
    score = task.score
    try:
        bars = [("merged", float(evaluation["merged"][score]), MERGED_COLOR)]
        ranks = sorted(evaluation["ranks"], key=lambda r: int(r["rank"]))
        if not ranks:
            raise KeyError("ranks")
        values = [float(r[score]) for r in ranks]
        bars += [(f"rank {int(r['rank'])}", v, RANK_COLOR) for r, v in zip(ranks, values, strict=True)]
        # eval.json's figures where it has them; the task's best and the plain mean where it does not.
        best = evaluation.get(f"best_rank_{score}", task.best(values))
        mean = evaluation.get(f"mean_rank_{score}", sum(values) / len(values))
        bars += [("best rank", float(best), SUMMARY_COLOR), ("mean rank", float(mean), SUMMARY_COLOR)]
    except (KeyError, TypeError, ValueError) as exc:
        raise UserError(f"eval.json lacks {exc}; re-run the evaluate stage") from None
    for key, label in (("ddp_baseline", "ddp baseline"), ("base", "initial model")):
        with_value = evaluation.get(key)
        if isinstance(with_value, dict) and isinstance(with_value.get(score), (int, float)):
            run = f"\n({with_value['run']})" if with_value.get("run") else ""
            bars.append((label + run, float(with_value[score]), BASELINE_COLOR))
    return bars


def _number(value: float, sign: str = "") -> str:
    """Three decimals (accuracies, losses); significant digits for what they would hide (mse in
    large units, a tiny gain)."""
    if value == 0 or 1e-3 <= abs(value) < 1e4 or not math.isfinite(value):
        return f"{value:{sign}.3f}"
    return f"{value:{sign}.3g}"


def _value_limits(values: Iterable[float]) -> tuple[float, float]:
    """y range from the data, always holding 0 (bars start there) and room for the value labels."""
    finite = [v for v in values if math.isfinite(v)]
    low, high = min([0.0, *finite]), max([0.0, *finite])
    span = (high - low) or 1.0
    return (low - 0.08 * span if low < 0 else 0.0), high + 0.08 * span


def _bar_chart(ax, bars: list[tuple[str, float, str]], limits: tuple[float, float] | None = None) -> None:
    positions = np.arange(len(bars))
    ax.bar(positions, [b[1] for b in bars], color=[b[2] for b in bars])
    for x, (_, value, _) in zip(positions, bars, strict=True):
        ax.annotate(_number(value), (x, value), ha="center", va="bottom", fontsize="small",
                    xytext=(0, 2), textcoords="offset points")  # fmt: skip
    ax.set_xticks(positions, [b[0] for b in bars], rotation=30 if len(bars) > 6 else 0, ha="right")
    ax.set_ylim(*(limits or _value_limits(b[1] for b in bars)))
    ax.grid(axis="y", alpha=0.3)


def fusion_figure(evaluation: dict[str, Any], title: str):
    """The merged model against each rank, best/mean rank and baselines, in the run's score."""
    task = evaluation_task(evaluation)
    bars = fusion_bars(evaluation)
    fig, ax = _pyplot().subplots(figsize=(max(5.0, 0.75 * len(bars) + 2), 4.2))
    _bar_chart(ax, bars)
    gain = task.gain(bars[0][1], next(value for label, value, _ in bars if label == "best rank"))
    ax.set_ylabel(score_label(task))
    ax.set_title(f"{title}: merged vs ranks (fusion gain {_number(gain, '+')})")
    return fig


def plot_fusion(evaluation: dict[str, Any], title: str, out: Path) -> Path:
    return save_figure(fusion_figure(evaluation, title), out)


def plot_run(run_dir: Path, out_dir: Path, train_dir: Path) -> list[Path]:
    metrics = rank_metrics(train_dir)
    evaluation = read_json(run_dir / "eval.json", "evaluation")
    name = run_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    return [
        plot_curves(metrics, "loss", "training loss", f"{name}: loss per rank", out_dir / "loss.png"),
        plot_curves(
            metrics,
            "samples_per_second",
            "samples / s",
            f"{name}: throughput per rank",
            out_dir / "throughput.png",
        ),
        plot_fusion(evaluation, name, out_dir / "fusion.png"),
    ]


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


def merge_methods_figure(rows: list[dict[str, str]]):
    """Merged score per merge method, a panel per training, the best rank marked in each."""
    panels = score_panels(rows)
    columns = min(3, len(panels))
    num_rows = math.ceil(len(panels) / columns)
    widest = max(len(members) for _, members in panels)
    fig, axes = _pyplot().subplots(
        num_rows, columns, figsize=(columns * max(3.5, 0.9 * widest + 1.5), num_rows * 3.8), squeeze=False
    )
    # Panels of one score share a y range, so their bars compare at a glance.
    values: dict[str, list[float]] = {}
    for task, members in panels:
        for row in members:
            values.setdefault(task.score, []).extend(
                float(row[f"test_{task.score}_{kind}"]) for kind in ("merged", "best_rank")
            )
    previous = ""
    for index, (ax, (task, members)) in enumerate(zip(axes.flat, panels, strict=False)):
        score = task.score
        bars = [(r["merge_method"], float(r[f"test_{score}_merged"]), MERGED_COLOR) for r in members]
        _bar_chart(ax, bars, _value_limits(values[score]))
        ax.tick_params(axis="x", labelrotation=30)
        ax.set_xlim(-0.6, max(len(bars), 3) - 0.4)  # a lone bar stays bar-sized
        best = [float(r[f"test_{score}_best_rank"]) for r in members]
        ax.scatter(
            range(len(bars)), best, marker="_", s=600, color=SUMMARY_COLOR, zorder=3, label="best rank"
        )
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["compare"]:
        parser = StageParser(
            prog="python -m shardfuse.plots compare", description="Merge methods across runs."
        )
        parser.add_argument("--summary", type=Path, required=True, help="results/summary.csv")
        parser.add_argument("--out", type=Path, required=True, help="PNG to write")
        args = parser.parse_args(argv[1:])
        written = [plot_merge_methods(args.summary, args.out)]
    else:
        parser = StageParser(prog="python -m shardfuse.plots", description=__doc__.splitlines()[0])
        parser.add_argument("--run-dir", type=Path, required=True, help="results/runs/{run} (eval.json)")
        parser.add_argument(
            "--train-dir",
            type=Path,
            required=True,
            help="its training's ranks/ (results/trainings/{training}/ranks)",
        )
        parser.add_argument("--out-dir", type=Path, required=True, help="where loss/throughput/fusion.png go")
        args = parser.parse_args(argv)
        written = plot_run(args.run_dir, args.out_dir, args.train_dir)
    print("wrote " + ", ".join(str(path) for path in written))


if __name__ == "__main__":
    run_cli(main)
