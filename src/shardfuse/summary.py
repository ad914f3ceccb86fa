"""Every run side by side: one row per run in results/summary.csv.

By hand::

    python -m shardfuse.summary --runs-json '{"ddp": {"dataset": "digits", ..., "training": "<training>"}}' \
        --results-dir results/runs --out results/summary.csv

The header depends on the tasks of the runs listed. Runs that all classify get :data:`COLUMNS`, then
the training columns below. Other tasks insert, after ``test_accuracy_ddp_baseline``, the five
:data:`SCORE_COLUMNS` of their score (``test_mse_merged``, ``test_mse_best_rank``, ...; one that already
exists, such as causal_lm's ``test_loss_merged``, is not repeated), then ``test_<metric>_merged`` for their
other metrics (regression: mae, r2), all preceded by a ``task`` column when the runs mix tasks. A run
leaves the cells of other tasks' columns empty, and without a run ranked by accuracy (classification)
the accuracy columns are left out; ``fusion_gain`` is eval.json's, positive when merging helped
whatever the direction of the score.

Every header ends with :data:`TRAINING_COLUMNS` (those not already in it), read from the training's
train.json: ``mode`` (ddp, localsgd, independent, diloco; derived from strategy and sync_every for
trainings from before train.json said it), ``effective_batch_size`` (samples per optimiser step over all
ranks) and ``bytes_all_reduced_per_rank`` (payload of the collectives on model state, per rank: 0 for
independent training). Older train.json files lack the last two: their cells are empty, never 0.

Last come :data:`ENSEMBLE_COLUMNS`: ``test_<score>_ensemble`` for each task's score (the output-averaged
ensemble of the ranks, see :mod:`shardfuse.evaluate`), then ``fusion_gap`` (eval.json's: how much better
the ensemble scores than the merged model, positive when it is better). eval.json files from before the
evaluate stage scored the ensemble leave both empty.

When some run of the experiment is not iid, the workflow gives every run its shard set's manifest
(``manifest`` in ``--runs-json``) and the header ends with :data:`HETEROGENEITY_COLUMNS`: the label
Jensen-Shannon divergence of the ranks to the pooled labels (mean, max; empty without class labels) and
the spread of the shards' rows (:mod:`shardfuse.data.heterogeneity`; an iid run's computed from its
manifest). Without a manifest, no such column: an all-iid experiment keeps its bytes.

Runs of non-iid shard sets then add their scores on each rank's local test distribution (eval.json's,
:mod:`shardfuse.scoring.local`): :data:`LOCAL_COLUMNS` of their score (``local_accuracy_merged_mean``,
``local_accuracy_merged_worst``, ``normalized_accuracy``). Only when a run has them: a summary of iid
runs keeps its header; other runs leave those cells empty.

A run whose training lost a rank for good adds :data:`RANK_LOSS_COLUMNS` (how many, the share of the
training rows its fused model holds, the lost ranks' steps no model holds); only then.

A run that failed in the workflow (``--failed-runs FILE``, or the file ``SHARDFUSE_FAILED_RUNS`` names:
{run: its one-line error}; :mod:`shardfuse.experiment.outcome`) gets a row of its config's cells and an
``error`` column, appended last when some run failed; it reads none of the run's files.
"""

from __future__ import annotations

import csv
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from shardfuse.console.errors import run_cli
from shardfuse.data.heterogeneity import shard_metrics
from shardfuse.experiment.outcome import failed_runs
from shardfuse.experiment.records import EvalRecord, MergeRecord, TrainRecord
from shardfuse.io import StageParser, UserError, atomic_path, parse_json_arg, read_json
from shardfuse.models import tasks
from shardfuse.models.tasks import evaluation_task, score_first, task_for

# The header when every run classifies: the one summary.csv has always had, kept byte for byte.
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
# Appended to every header (those not in it yet): what the training cost in communication and time.
TRAINING_COLUMNS = ("mode", "effective_batch_size", "bytes_all_reduced_per_rank", "train_seconds")
# What each score (bar accuracy, already above) adds: test_<score>_<kind>.
SCORE_COLUMNS = ("merged", "best_rank", "mean_rank", "base", "ddp_baseline")
# Appended after the training columns: the ensemble of the ranks, test_<score>_ensemble per task first.
ENSEMBLE_COLUMNS = ("fusion_gap",)
# Appended after the ensemble's, for the runs that have them: the merged model on each rank's local
# test distribution (mean, worst) and against each rank's own model there (normalized).
LOCAL_COLUMNS = (
    "local_{score}_merged_mean",
    "local_{score}_merged_worst",
    "normalized_{score}",
    "domain_{score}_merged_mean",  # runs of a domains dataset: the merged model over its parts
    "domain_{score}_merged_worst",
)
_INSERT_AFTER = "test_accuracy_ddp_baseline"
# Appended last where runs name their manifests (some run of the experiment is not iid).
HETEROGENEITY_COLUMNS = ("shard_label_jsd_mean", "shard_label_jsd_max", "shard_rows_cv")
# Appended when some run's training lost a rank for good (eval.json's; shardfuse.rank.loss).
RANK_LOSS_COLUMNS = ("ranks_lost", "coverage", "steps_discarded")
ERROR = "error"  # appended last when some run failed: its one-line error (empty for the others)
ACCURACY = "accuracy"  # the score of the header every summary had before tasks (COLUMNS)


def summary_columns(task_names: Iterable[str]) -> tuple[str, ...]:
    """The header for runs of these tasks (see the module docstring for the rule)."""
    names = set(task_names)
    present = [task_for(name) for name in tasks.task_names() if name in names]
    extra = ["task"] if len(present) > 1 else []
    for task in present:
        extra += [f"test_{task.score}_{kind}" for kind in SCORE_COLUMNS]
        extra += [f"test_{metric}_merged" for metric in task.metrics if metric not in (task.score, "loss")]
    extra = [column for column in dict.fromkeys(extra) if column not in COLUMNS]
    at = COLUMNS.index(_INSERT_AFTER) + 1
    columns = (*COLUMNS[:at], *extra, *COLUMNS[at:])
    if not any(task.score == ACCURACY for task in present):  # no columns empty in every row
        columns = tuple(column for column in columns if not column.startswith(f"test_{ACCURACY}_"))
    columns = (*columns, *(column for column in TRAINING_COLUMNS if column not in columns))
    return (*columns, *(f"test_{task.score}_ensemble" for task in present), *ENSEMBLE_COLUMNS)


def _count(value: Any) -> int | str:
    """An integer field of train.json, or an empty cell when it is absent (older train stages)."""
    return value if isinstance(value, int) and not isinstance(value, bool) else ""


def scored(metrics: dict[str, float], score: str, key: str, eval_path: Path) -> float:
    """The run's score among eval.json's ``key`` metrics (types are checked as the record is read)."""
    if score not in metrics:
        raise UserError(f"{eval_path}: '{key}' has no {score}; re-run the evaluate stage")
    return metrics[score]


# What summary_row reads of each run's resolved config (the workflow passes them all), and its kind.
RUN_KEYS = {"training": "string", "dataset": "string", "world_size": "integer", "strategy": "string"}
KIND_OF = {"string": str, "integer": int}


def checked_runs(runs: Any) -> dict[str, dict[str, Any]]:
    """``--runs-json``: {run: its resolved config}, each with the :data:`RUN_KEYS` summary reads."""
    fix = "pass {run: its resolved config}, as the workflow's summary rule does"
    if not isinstance(runs, dict) or not all(isinstance(cfg, dict) for cfg in runs.values()):
        raise UserError(f"--runs-json must be a JSON object of objects; {fix}")
    for run, cfg in runs.items():
        for key in (*RUN_KEYS, "sync_every"):
            if key not in cfg:
                raise UserError(f"--runs-json: run {run!r} has no {key!r}; {fix}")
        for key, kind in RUN_KEYS.items():
            value = cfg[key]
            if not isinstance(value, KIND_OF[kind]) or isinstance(value, bool):
                raise UserError(f"--runs-json: run {run!r} has {key} {value!r}, not a {kind}; {fix}")
        if not isinstance(cfg.get("manifest", ""), str):
            raise UserError(f"--runs-json: run {run!r} has manifest {cfg['manifest']!r}, not a path; {fix}")
    return runs


def heterogeneity_cells(cfg: dict[str, Any]) -> dict[str, Any]:
    """The run's shard set heterogeneity from its manifest (label cells empty without class labels)."""
    if "manifest" not in cfg:
        return {}
    manifest = read_json(cfg["manifest"], "shard manifest")
    shards = manifest.get("shards") if isinstance(manifest, dict) else None
    if not isinstance(shards, list) or not all(
        isinstance(shard, dict) and "rows" in shard for shard in shards
    ):
        raise UserError(
            f"shard manifest {cfg['manifest']} has no shards with rows; re-run the partition stage"
        )
    return {column: shard_metrics(manifest).get(column, "") for column in HETEROGENEITY_COLUMNS}


def summary_row(
    run: str, cfg: dict[str, Any], run_dir: Path, trainings_dir: Path, failed: Iterable[str] = ()
) -> dict[str, Any]:
    """The run's cells by column name, plus ``task`` (a column only when tasks mix); a ddp baseline
    among the ``failed`` runs leaves its cells empty."""
    eval_path = run_dir / "eval.json"
    baseline = cfg.get("ddp_baseline")  # the ddp run trained alike (not this run itself)
    has_baseline = baseline and baseline != run and baseline not in failed
    baseline_path = run_dir.parent / baseline / "eval.json" if has_baseline else None
    evaluation = EvalRecord.read_with_baseline(eval_path, baseline_path)
    task = evaluation_task(evaluation, eval_path)
    score = task.score
    training = TrainRecord.read(trainings_dir / cfg["training"] / "ranks" / "train.json", "training summary")
    baseline = evaluation.ddp_baseline or {}
    merging = MergeRecord.read(run_dir / "merge.json", "merge record")
    merged = evaluation.required("merged")
    merged_score = scored(merged, score, "merged", eval_path)
    gain = evaluation.fusion_gain
    if gain is None:  # eval.json from before the evaluate stage wrote it
        gain = task.gain(merged_score, evaluation.required("best_rank"))
    ensemble = evaluation.ensemble or {}  # absent from eval.json of older evaluate stages
    gap = evaluation.fusion_gap
    if gap is None and score in ensemble:
        gap = task.gain(ensemble[score], merged_score)
    return {
        "run": run,
        "task": task.name,
        "training": cfg["training"],
        "dataset": cfg["dataset"],
        "world_size": cfg["world_size"],
        "strategy": cfg["strategy"],
        "sync_every": cfg["sync_every"],
        "merge_method": merging.required("method"),
        # .get: an eval.json written before a task gained a metric lacks it (an empty cell, not an error).
        **{f"test_{metric}_merged": merged.get(metric, "") for metric in score_first(task)},
        f"test_{score}_best_rank": evaluation.required("best_rank"),
        f"test_{score}_mean_rank": evaluation.required("mean_rank"),
        f"test_{score}_base": scored(evaluation.required("base"), score, "base", eval_path),
        f"test_{score}_ddp_baseline": baseline.get(score, ""),
        "fusion_gain": gain,
        "max_abs_diff_between_ranks": merging.max_abs_diff_between_ranks,
        "num_steps": training.num_steps,
        "train_seconds": round(training.required("train_seconds"), 3),
        "mode": training.training_mode(cfg.get("strategy"), cfg.get("sync_every")),
        "effective_batch_size": _count(training.effective_batch_size),
        "bytes_all_reduced_per_rank": _count(training.bytes_all_reduced_per_rank),
        f"test_{score}_ensemble": ensemble.get(score, ""),
        "fusion_gap": "" if gap is None else gap,
        **heterogeneity_cells(cfg),
        **local_cells(evaluation.local or {}, score),
        **{name: value for name in RANK_LOSS_COLUMNS if (value := getattr(evaluation, name)) is not None},
    }


def failed_row(run: str, cfg: dict[str, Any], error: str) -> dict[str, Any]:
    """A failed run's row: what its config says, and its error (its files are not read)."""
    keys = ("training", "dataset", "world_size", "strategy", "sync_every")
    return {"run": run, **{key: cfg[key] for key in keys}, ERROR: error}


def local_cells(local: dict[str, float], score: str) -> dict[str, float]:
    """The run's :data:`LOCAL_COLUMNS` that its eval.json has (none for a run of an iid shard set)."""
    names = (template.format(score=score) for template in LOCAL_COLUMNS)
    return {name: local[name] for name in names if name in local}


def write_summary(
    runs: dict[str, dict[str, Any]],
    results_dir: Path,
    trainings_dir: Path,
    out: Path,
    failed: dict[str, str] | None = None,
) -> list[dict[str, Any]]:
    failed = failed or {}
    rows = [
        failed_row(run, cfg, failed[run])
        if run in failed
        else summary_row(run, cfg, results_dir / run, trainings_dir, failed)
        for run, cfg in runs.items()
    ]
    columns = summary_columns(row["task"] for row in rows if ERROR not in row)
    if any("manifest" in cfg for cfg in runs.values()):
        columns = (*columns, *HETEROGENEITY_COLUMNS)
    local = [key for row in rows for key in row if key.startswith(EvalRecord.LOCAL_PREFIXES)]
    columns = (*columns, *dict.fromkeys(local))
    if any(name in row for row in rows for name in RANK_LOSS_COLUMNS):  # some training lost a rank
        columns = (*columns, *RANK_LOSS_COLUMNS)
    if any(run in failed for run in runs):
        columns = (*columns, ERROR)
    with atomic_path(out) as tmp, open(tmp, "w", newline="") as fh:
        # restval: a run leaves other tasks' columns empty; ignore: "task" when it is no column.
        writer = csv.DictWriter(fh, fieldnames=columns, restval="", extrasaction="ignore")
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
    parser.add_argument(
        "--failed-runs",
        type=Path,
        help="JSON {run: one-line error} of runs that failed (default: the file "
        "$SHARDFUSE_FAILED_RUNS names, if set): rows with their error",
    )
    args = parser.parse_args(argv)
    runs = checked_runs(parse_json_arg(args.runs_json, "--runs-json"))
    rows = write_summary(runs, args.results_dir, args.trainings_dir, args.out, failed_runs(args.failed_runs))
    for row in rows:
        if ERROR in row:
            print(f"{row['run']:>20}  failed: {row[ERROR]}")
            continue
        score = task_for(row["task"]).score
        print(
            f"{row['run']:>20}  merged {score} {row[f'test_{score}_merged']:.4f}  best rank "
            f"{row[f'test_{score}_best_rank']:.4f}  ({row['strategy']}, {row['merge_method']})"
        )


if __name__ == "__main__":
    run_cli(main)
