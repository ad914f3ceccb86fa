"""Plots of one run (loss, throughput, merged vs ranks) and of results/summary.csv across runs, as PNGs.

By hand::

    python -m shardfuse.plots --run-dir results/runs/ddp --train-dir results/trainings/<training>/ranks \\
        --out-dir results/runs/ddp/plots
    python -m shardfuse.plots compare --summary results/summary.csv --out results/plots/merge_methods.png
    python -m shardfuse.plots communication --summary results/summary.csv \\
        --out results/plots/communication.png

The run plots read the training's ``metrics/rank-*.parquet`` (under TRAIN_DIR) and the run's
``eval.json``. ``compare`` groups the rows of ``summary.csv`` that share their training (a ``training``
column if there is one, else dataset, world size and strategy) and shows each group's merged score per
run/merge method; ``communication`` shows each run's merged score against the bytes its training
all-reduced per rank (log scale; independent training at a ``0 B`` tick). Those two figures are drawn by
:mod:`shardfuse.figures`. The score is the task's (accuracy, mse, loss: see :mod:`shardfuse.tasks`);
every axis says which way is better. Matplotlib's Agg backend, no display needed; every PNG is written
atomically.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.figures import (
    BASELINE_COLOR,
    ENSEMBLE_COLOR,
    MERGED_COLOR,
    RANK_COLOR,
    SUMMARY_COLOR,
    bar_chart,
    number,
    plot_communication,
    plot_merge_methods,
    pyplot,
    save_figure,
    score_label,
)
from shardfuse.io import StageParser, UserError, read_json, run_cli
from shardfuse.tasks import evaluation_task
from shardfuse.tracking_inputs import read_step_metrics

RUN_PLOTS = ("loss.png", "throughput.png", "fusion.png")
# Subcommands that draw one figure of summary.csv: name -> (description, default file name, drawer).
SUMMARY_PLOTS = {
    "compare": ("Merge methods across runs.", "merge_methods.png", plot_merge_methods),
    "communication": ("Merged score vs bytes all-reduced per rank.", "communication.png", plot_communication),
}


def smooth(values: np.ndarray, window: int | None = None) -> np.ndarray:
    """Centred moving average (about 2% of the points); the ends average over what exists."""
    values = np.asarray(values, dtype=np.float64)
    if window is None:
        window = max(1, len(values) // 50)
    if window <= 1 or len(values) < 3:
        return values
    kernel = np.ones(window)
    return np.convolve(values, kernel, mode="same") / np.convolve(np.ones(len(values)), kernel, mode="same")


def rank_metrics(train_dir: Path) -> dict[int, dict[str, np.ndarray]]:
    paths = sorted((train_dir / "metrics").glob("rank-*.parquet"), key=lambda p: int(p.stem[5:]))
    if not paths:
        raise UserError(f"{train_dir}/metrics has no rank-*.parquet; re-run the train stage first")
    return {int(path.stem[5:]): read_step_metrics(path) for path in paths}


def _rank_colors(num_ranks: int) -> list:
    cmap = pyplot().get_cmap("tab10" if num_ranks <= 10 else "viridis")
    return [cmap(i if num_ranks <= 10 else i / max(num_ranks - 1, 1)) for i in range(num_ranks)]


def plot_curves(
    metrics: dict[int, dict[str, np.ndarray]], key: str, ylabel: str, title: str, out: Path
) -> Path:
    """One line per rank vs step: raw (faint) and smoothed; log scale when the values span decades."""
    plt = pyplot()
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


def fusion_bars(evaluation: dict[str, Any]) -> list[tuple[str, float, str]]:
    """(label, test score, color) for the merged model, each rank, best/mean rank, the ranks' ensemble
    (when eval.json has it) and baselines."""
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
    if (value := ensemble_score(evaluation, score)) is not None:  # older evaluate stages: no ensemble
        bars.append(("ensemble", value, ENSEMBLE_COLOR))
    for key, label in (("ddp_baseline", "ddp baseline"), ("base", "initial model")):
        with_value = evaluation.get(key)
        if isinstance(with_value, dict) and isinstance(with_value.get(score), (int, float)):
            run = f"\n({with_value['run']})" if with_value.get("run") else ""
            bars.append((label + run, float(with_value[score]), BASELINE_COLOR))
    return bars


def ensemble_score(evaluation: dict[str, Any], score: str) -> float | None:
    """The ranks' ensemble's test score, if eval.json has it (evaluate stages since issue 16)."""
    ensemble = evaluation.get("ensemble")
    value = ensemble.get(score) if isinstance(ensemble, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def fusion_figure(evaluation: dict[str, Any], title: str):
    """The merged model against each rank, best/mean rank, the ranks' ensemble and baselines, in the
    run's score; the title gives the fusion gain (over the best rank) and, with an ensemble, the fusion
    gap (how much better the ensemble scores than the merged model)."""
    task = evaluation_task(evaluation)
    bars = fusion_bars(evaluation)
    fig, ax = pyplot().subplots(figsize=(max(5.0, 0.75 * len(bars) + 2), 4.2))
    bar_chart(ax, bars)
    gain = task.gain(bars[0][1], next(value for label, value, _ in bars if label == "best rank"))
    ax.set_ylabel(score_label(task))
    figures = f"fusion gain {number(gain, '+')}"
    if (ensemble := ensemble_score(evaluation, task.score)) is not None:
        figures += f", fusion gap {number(task.gain(ensemble, bars[0][1]), '+')}"
    ax.set_title(f"{title}: merged vs ranks ({figures})")
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


def main(argv: list[str] | None = None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] and argv[0] in SUMMARY_PLOTS:
        description, default_name, draw = SUMMARY_PLOTS[argv[0]]
        parser = StageParser(prog=f"python -m shardfuse.plots {argv[0]}", description=description)
        parser.add_argument("--summary", type=Path, required=True, help="results/summary.csv")
        parser.add_argument(
            "--out", type=Path, required=True, help=f"PNG to write (results/plots/{default_name})"
        )
        args = parser.parse_args(argv[1:])
        written = [draw(args.summary, args.out)]
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
