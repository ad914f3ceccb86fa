"""Every run side by side: one row per run in results/summary.csv.

By hand::

    python -m shardfuse.summary --runs-json '{"ddp": {"dataset": "digits", ..., "training": "<training>"}}' \
        --results-dir results/runs --out results/summary.csv
"""

from __future__ import annotations

import csv
from pathlib import Path
from typing import Any

from shardfuse.io import StageParser, atomic_path, parse_json_arg, read_json, run_cli

COLUMNS = (
    "run",
    "training",
    "dataset",
    "world_size",
    "strategy",
    "sync_every",
    "merge_method",
    "test_accuracy_merged",
    "test_loss_merged",
    "test_accuracy_best_rank",
    "test_accuracy_mean_rank",
    "test_accuracy_base",
    "test_accuracy_ddp_baseline",
    "fusion_gain",
    "max_abs_diff_between_ranks",
    "num_steps",
    "train_seconds",
)


def summary_row(run: str, cfg: dict[str, Any], run_dir: Path, trainings_dir: Path) -> dict[str, Any]:
    evaluation = read_json(run_dir / "eval.json", "evaluation")
    training = read_json(trainings_dir / cfg["training"] / "ranks" / "train.json", "training summary")
    baseline = evaluation.get("ddp_baseline") or {}
    merging = read_json(run_dir / "merge.json", "merge record")
    return {
        "run": run,
        "training": cfg["training"],
        "dataset": cfg["dataset"],
        "world_size": cfg["world_size"],
        "strategy": cfg["strategy"],
        "sync_every": cfg["sync_every"],
        "merge_method": merging["method"],
        "test_accuracy_merged": evaluation["merged"]["accuracy"],
        "test_loss_merged": evaluation["merged"]["loss"],
        "test_accuracy_best_rank": evaluation["best_rank_accuracy"],
        "test_accuracy_mean_rank": evaluation["mean_rank_accuracy"],
        "test_accuracy_base": evaluation["base"]["accuracy"],
        "test_accuracy_ddp_baseline": baseline.get("accuracy", ""),
        "fusion_gain": evaluation["fusion_gain"],
        "max_abs_diff_between_ranks": merging["max_abs_diff_between_ranks"],
        "num_steps": training["num_steps"],
        "train_seconds": round(training["train_seconds"], 3),
    }


def write_summary(
    runs: dict[str, dict[str, Any]], results_dir: Path, trainings_dir: Path, out: Path
) -> list[dict[str, Any]]:
    rows = [summary_row(run, cfg, results_dir / run, trainings_dir) for run, cfg in runs.items()]
    with atomic_path(out) as tmp, open(tmp, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    return rows


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.summary", description=__doc__.splitlines()[0])
    parser.add_argument("--runs-json", required=True, help="{run: resolved config} of the runs to list")
    parser.add_argument("--results-dir", type=Path, default=Path("results/runs"), help="default: %(default)s")
    parser.add_argument(
        "--trainings-dir", type=Path, default=Path("results/trainings"), help="default: %(default)s"
    )
    parser.add_argument("--out", type=Path, required=True, help="CSV to write")
    args = parser.parse_args(argv)
    runs = parse_json_arg(args.runs_json, "--runs-json")
    rows = write_summary(runs, args.results_dir, args.trainings_dir, args.out)
    for row in rows:
        print(
            f"{row['run']:>20}  merged {row['test_accuracy_merged']:.4f}  best rank "
            f"{row['test_accuracy_best_rank']:.4f}  ({row['strategy']}, {row['merge_method']})"
        )


if __name__ == "__main__":
    run_cli(main)
