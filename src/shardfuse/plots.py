"""Plots of one run (loss, throughput, merged vs ranks) and of results/summary.csv across runs, as PNGs.

By hand::

    python -m shardfuse.plots --run-dir results/runs/ddp --train-dir results/trainings/<training>/ranks \\
        --manifest results/shards/digits/w2-seed0/manifest.json --out-dir results/runs/ddp/plots
    python -m shardfuse.plots compare --summary results/summary.csv --out results/plots/merge_methods.png
    python -m shardfuse.plots communication --summary results/summary.csv \\
        --out results/plots/communication.png
    python -m shardfuse.plots heterogeneity --summary results/summary.csv \\
        --out results/plots/heterogeneity.png

The run plots read the training's ``metrics/rank-*.parquet`` (under TRAIN_DIR) and the run's
``eval.json``. ``fusion.png`` is a dot per model (merged, each rank, best and mean rank, the ranks'
ensemble, the ddp baseline, the initial model) on an axis zoomed to them, not anchored at 0; an initial
model far worse than the trained ones is an arrow at the axis's edge with its value. A run of a non-iid
shard set adds a panel: on each rank's own test distribution, the merged model beside that rank's own,
titled with the normalized score (:mod:`shardfuse.report.local_scores`). ``compare`` shows
every run of ``summary.csv`` as a row, best merged score first, against its ranks, ensemble and ddp
baseline; ``communication`` shows each run's merged score against the bytes its training all-reduced per
rank (log scale; independent training at a ``0 B`` tick); ``heterogeneity`` (drawn when some run is not
iid) each run's merged score against its shards' label skew, a line per training mode
(:mod:`shardfuse.report.heterogeneity`). With ``--manifest`` (the run's shard set),
``shards.png``: each rank's rows by class, titled with the heterogeneity numbers. Those figures are drawn by
:mod:`shardfuse.report.figures`. The score is the task's (accuracy, mse, loss: see
:mod:`shardfuse.models.tasks`); every axis says which way is better. Matplotlib's Agg backend, no display
needed; every PNG is written
atomically.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import numpy as np

from shardfuse.console.errors import exit_now, run_cli
from shardfuse.data.manifest import read_manifest
from shardfuse.experiment.records import COLLECTED_MODE, EvalRecord, TrainRecord
from shardfuse.io import StageParser, UserError
from shardfuse.models.tasks import evaluation_task
from shardfuse.report.figures import (
    BASELINE_COLOR,
    ENSEMBLE_COLOR,
    INITIAL_COLOR,
    MERGED_COLOR,
    RANK_COLOR,
    SUMMARY_COLOR,
    far_outside,
    number,
    plot_communication,
    plot_merge_methods,
    pyplot,
    save_figure,
    score_label,
    zoomed_limits,
)
from shardfuse.report.heterogeneity import plot_heterogeneity
from shardfuse.report.local_scores import local_panel, local_points
from shardfuse.report.shards import plot_shard_set
from shardfuse.track.series import read_step_metrics

RUN_PLOTS = ("loss.png", "throughput.png", "fusion.png")
SHARD_PLOT = "shards.png"  # with --manifest: what each rank was dealt
INITIAL = "initial model"  # the model before training: never "base", which reads like the ddp baseline
# Subcommands that draw one figure of summary.csv: name -> (description, default file name, drawer).
SUMMARY_PLOTS = {
    "compare": ("Merge methods across runs.", "merge_methods.png", plot_merge_methods),
    "communication": ("Merged score vs bytes all-reduced per rank.", "communication.png", plot_communication),
    "heterogeneity": ("Merged score vs label skew of the shards.", "heterogeneity.png", plot_heterogeneity),
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


def fusion_bars(evaluation: EvalRecord) -> list[tuple[str, float, str]]:
    """(label, test score, color) for the merged model, each rank, best/mean rank, the ranks' ensemble
    (when eval.json has it) and baselines."""
    task = evaluation_task(evaluation)
    score = task.score
    try:
        bars = [("merged", float(evaluation.required("merged")[score]), MERGED_COLOR)]
        ranks = sorted(evaluation.required("ranks"), key=lambda r: int(r["rank"]))
        if not ranks:
            raise KeyError("ranks")
        values = [float(r[score]) for r in ranks]
        bars += [(f"rank {int(r['rank'])}", v, RANK_COLOR) for r, v in zip(ranks, values, strict=True)]
        # eval.json's figures where it has them; the task's best and the plain mean where it does not.
        best = task.best(values) if evaluation.best_rank is None else evaluation.best_rank
        mean = sum(values) / len(values) if evaluation.mean_rank is None else evaluation.mean_rank
        bars += [("best rank", float(best), SUMMARY_COLOR), ("mean rank", float(mean), SUMMARY_COLOR)]
    except (KeyError, TypeError, ValueError) as exc:
        detail = repr(exc.args[0]) if isinstance(exc, KeyError) else exc  # a MissingField names its file
        raise UserError(f"eval.json lacks {detail}; re-run the evaluate stage") from None
    if (value := ensemble_score(evaluation, score)) is not None:  # older evaluate stages: no ensemble
        bars.append(("ensemble", value, ENSEMBLE_COLOR))
    references = {"ddp baseline": evaluation.ddp_baseline, INITIAL: evaluation.initial_model()}
    for label, with_value in references.items():
        if isinstance(with_value, dict) and isinstance(with_value.get(score), (int, float)):
            run = f"\n({with_value['run']})" if with_value.get("run") else ""
            color = INITIAL_COLOR if label == INITIAL else BASELINE_COLOR
            bars.append((label + run, float(with_value[score]), color))
    return bars


def ensemble_score(evaluation: EvalRecord, score: str) -> float | None:
    """The ranks' ensemble's test score, if eval.json has it (evaluate stages since issue 16)."""
    ensemble = evaluation.ensemble
    value = ensemble.get(score) if isinstance(ensemble, dict) else None
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else None


def dot_chart(ax, bars: list[tuple[str, float, str]]) -> None:
    """Each score a labelled dot on an axis zoomed to the scores, a dotted line at the first (the merged
    model). An initial model far worse than the rest (see :func:`shardfuse.report.figures.far_outside`) would
    flatten them: it is an arrow at the axis's edge with its value instead."""
    values = [value for _, value, _ in bars]
    off_axis = {
        x for x, (label, value, _) in enumerate(bars)
        if label == INITIAL and far_outside(value, values[:x] + values[x + 1 :])
    }  # fmt: skip
    low, high = zoomed_limits([v for x, v in enumerate(values) if x not in off_axis], margin=0.1)
    high += 0.06 * (high - low)  # room for the value labels above the dots
    ax.axhline(values[0], color=MERGED_COLOR, linestyle=":", linewidth=1, alpha=0.7, zorder=1)
    for x, (_, value, color) in enumerate(bars):
        if x in off_axis:
            below = value < low
            edge = ax.get_xaxis_transform()  # x in data, y in axes fractions
            ax.scatter([x], [0.03 if below else 0.97], marker="v" if below else "^", s=90, color=color,
                       transform=edge, zorder=3, clip_on=False)  # fmt: skip
            ax.annotate(f"{number(value)}\noff the axis", (x, 0.03 if below else 0.97), xycoords=edge,
                        xytext=(0, 8 if below else -8), textcoords="offset points", ha="center",
                        va="bottom" if below else "top", fontsize="small", color=SUMMARY_COLOR)  # fmt: skip
            continue
        ax.scatter([x], [value], s=70, color=color, zorder=3)
        ax.annotate(number(value), (x, value), ha="center", va="bottom", fontsize="small",
                    xytext=(0, 6), textcoords="offset points")  # fmt: skip
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=30 if len(bars) > 6 else 0, ha="right")
    ax.set_xlim(-0.6, len(bars) - 0.4)
    ax.set_ylim(low, high)
    ax.grid(axis="y", alpha=0.3)


def fusion_figure(evaluation: EvalRecord, title: str):
    """The merged model against each rank, best/mean rank, the ranks' ensemble and baselines, in the
    run's score, on an axis zoomed to them (:func:`dot_chart`); the title gives the fusion gain (over the
    best rank) and, with an ensemble, the fusion gap (how much better the ensemble scores than the
    merged model)."""
    task = evaluation_task(evaluation)
    bars = fusion_bars(evaluation)
    width = max(5.0, 0.75 * len(bars) + 2)
    local = local_points(evaluation.local or {}, task.score)
    if local is None:
        fig, ax = pyplot().subplots(figsize=(width, 4.2))
    else:  # a non-iid shard set: each rank's own ground beside
        extra = max(3.0, 0.75 * len(local.ranks) + 1.5)
        fig, (ax, side) = pyplot().subplots(
            1, 2, figsize=(width + extra, 4.2), gridspec_kw={"width_ratios": [width, extra], "wspace": 0.3}
        )
        local_panel(side, task, local)
    dot_chart(ax, bars)
    gain = task.gain(bars[0][1], next(value for label, value, _ in bars if label == "best rank"))
    ax.set_ylabel(score_label(task))
    figures = f"fusion gain {number(gain, '+')}"
    if (ensemble := ensemble_score(evaluation, task.score)) is not None:
        figures += f", fusion gap {number(task.gain(ensemble, bars[0][1]), '+')}"
    ax.set_title(f"{title}: merged vs ranks ({figures})")
    return fig


def plot_fusion(evaluation: EvalRecord, title: str, out: Path) -> Path:
    return save_figure(fusion_figure(evaluation, title), out)


NOT_TRAINED = (
    ("loss per rank", "loss.png"),
    ("throughput per rank", "throughput.png"),
    ("shards", SHARD_PLOT),
)


def collected_sources(train_dir: Path) -> list[str] | None:
    """A collection's checkpoints in rank order (shardfuse.collect's train.json); None for a training."""
    path = train_dir / "train.json"
    record = TrainRecord.read(path) if path.is_file() else None
    if record is None or record.mode != COLLECTED_MODE:
        return None
    return [str(entry.get("source")) for entry in record.ranks or []]


def plot_note(title: str, note: str, out: Path) -> Path:
    """A figure that says why there is nothing to draw."""
    fig, ax = pyplot().subplots(figsize=(6, 2.5))
    ax.axis("off")
    ax.set_title(title)
    ax.text(0.5, 0.5, note, ha="center", va="center", fontsize="small", transform=ax.transAxes)
    return save_figure(fig, out)


def plot_run(
    run_dir: Path,
    out_dir: Path,
    train_dir: Path,
    ddp_baseline: Path | None = None,
    manifest: Path | None = None,
) -> list[Path]:
    """The run's plots; with its shard set's ``manifest``, ``shards.png`` too (report/shards.py). A run
    over checkpoints (train.json's mode ``checkpoints``) was not trained: its loss, throughput and shard
    figures say so and list the checkpoints."""
    evaluation = EvalRecord.read_with_baseline(run_dir / "eval.json", ddp_baseline)
    name = run_dir.name
    out_dir.mkdir(parents=True, exist_ok=True)
    sources = collected_sources(train_dir)
    if sources is not None:
        note = "not trained: a run over existing checkpoints\n" + "\n".join(
            f"rank {rank}: {source}" for rank, source in enumerate(sources)
        )
        return [
            *(plot_note(f"{name}: {what}", note, out_dir / file) for what, file in NOT_TRAINED),
            plot_fusion(evaluation, name, out_dir / "fusion.png"),
        ]
    metrics = rank_metrics(train_dir)
    shards = (
        []
        if manifest is None
        else [plot_shard_set(read_manifest(manifest.parent), name, out_dir / SHARD_PLOT)]
    )
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
        *shards,
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
        parser.add_argument(
            "--ddp-baseline", nargs="?", default="", help="eval.json of the ddp run trained alike, if any"
        )
        parser.add_argument("--manifest", type=Path, help="its shard set's manifest.json: shards.png too")
        parser.add_argument("--out-dir", type=Path, required=True, help="where loss/throughput/fusion.png go")
        args = parser.parse_args(argv)
        baseline = Path(args.ddp_baseline) if args.ddp_baseline else None
        written = plot_run(args.run_dir, args.out_dir, args.train_dir, baseline, args.manifest)
    print("wrote " + ", ".join(str(path) for path in written))


if __name__ == "__main__":
    run_cli(main)
    exit_now()  # every file written: skip the interpreter's teardown of torch / matplotlib
