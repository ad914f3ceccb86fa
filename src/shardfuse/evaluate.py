"""Evaluate the merged model, every rank's own model, their ensemble and the initial model on named sets.

By hand::

    python -m shardfuse.evaluate --run ddp --test results/datasets/digits/test.parquet \
        --gather results/trainings/<training>/gather.json --merged results/runs/ddp/merged.safetensors \
        --out results/runs/ddp/eval.json [--ddp-baseline results/runs/<ddp run>/eval.json]

Evaluation sets: ``--set KIND=PATH`` names a set by its kind's record (shardfuse.scoring.sets: ``test``,
the global test split; ``local``, a shard set's manifest; ``domain``, a domains dataset's record) and
``--test PATH`` is ``--set test=PATH``. The test set is required: its scores are eval.json's top-level
fields (and summary.csv's, MLflow's), as they always were; ``sets`` holds every set's, the test set's
included, under its name. Scoring is shardfuse.scoring's, shared with greedy soup and recalibration.

Each rank's local distribution (a non-iid shard set; the workflow passes ``--set
local=results/shards/<dataset>/<shard set>/manifest.json``): the sets ``local_rank_<r>`` weigh the test
split's rows as rank r's data was drawn (shardfuse.scoring.local), scored in the test split's pass, exact;
eval.json also holds ``local_<score>_merged_rank_<r>``, ``local_<score>_rank_<r>``,
``local_<score>_merged_mean``, ``local_<score>_merged_worst`` and ``normalized_<score>`` (1.0: the merged
model is as good as each rank on its own data). By hand::

    python -m shardfuse.evaluate --run dirichlet --test results/datasets/digits/test.parquet \
        --set local=results/shards/digits/<shard set>/manifest.json --gather ... --merged ... --out ...

Each part of a domains dataset (the workflow passes ``--set domain=results/datasets/<dataset>/dataset.json``
for its runs of iid shards; a run partitioned by domain has them as its local sets): the sets
``domain_<part>`` are the test rows of each part (shardfuse.scoring.domains), and eval.json holds
``domain_<score>_merged_<part>``, ``domain_<score>_ensemble_<part>``, ``domain_<score>_merged_mean`` and
``domain_<score>_merged_worst``.

Before anything is read: each set's file must be the one the workflow wrote (the test split: the rows and
sha256 of the dataset.json beside it, shardfuse.data.verify.check_split). Before any model is built: every
checkpoint gather.json lists must be this training's (shardfuse.checkpoints.trust.read_gather), the merged
model a merge of it, and each file's model spec must fit its tensors
(shardfuse.models.registry.check_model_fits), so no model larger than its file is ever allocated.

The ensemble is the reference a fused single model is judged against: the ranks' outputs averaged as the
task says (shardfuse.models.tasks: ``combine``; mean probability, mean prediction, renormalised mean
log-probs), scored with the task's metrics. One pass over a set runs every rank on each batch, scores each
rank's outputs and their combination, and drops them before the next batch: memory holds every rank's
model at once, but only one batch of outputs. eval.json records it as ``ensemble`` ({metric: value}),
``ensemble_<score>``, and ``fusion_gap`` = how much better the ensemble scores than the merged model
(the task's sign: positive when the ensemble is better, whatever the score's direction).
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.gather_record import GatherRecord
from shardfuse.checkpoints.trust import (
    RERUN_MERGE,
    RERUN_TRAIN,
    check_merged,
    check_merged_record,
    header_spec,
    read_gather,
)
from shardfuse.console.errors import exit_now, run_cli
from shardfuse.data.verify import check_dataset_of
from shardfuse.experiment.records import EvalRecord, MergeRecord
from shardfuse.io import StageParser, UserError, write_json
from shardfuse.models.registry import check_model_fits, normalized_spec
from shardfuse.models.tasks import task_for
from shardfuse.models.usercode import check_code_unchanged
from shardfuse.scoring.domains import domain_scores
from shardfuse.scoring.evaluation import TrainingModels, load_sets, score_sets
from shardfuse.scoring.local import local_scores
from shardfuse.scoring.mixture import Weighting
from shardfuse.scoring.sets import HEADLINE, EvalSet, SetKind, expand, parse_set, set_kind
from shardfuse.strategies.registry import recorded_strategy


def evaluate(
    run: str,
    sets: list[tuple[SetKind, Path]],
    gather_path: Path,
    merged_path: Path,
    batch_size: int,
    ddp_baseline: Path | None = None,
    merge_json: Path | None = None,
) -> EvalRecord:
    """Score the training's models on every set ``sets`` (kind, file) gives; the record eval.json holds.
    ``merge_json`` (default: the merge.json beside ``merged_path``, where there is one) must describe the
    merged model: this run's, its sha256 and method (a copied or edited file is refused)."""
    named = expand(sets)
    splits = load_sets(named)
    gather = read_gather(gather_path, base=True, need=("model",))
    spec = normalized_spec(gather.model)
    # Once for the training (its ranks, base and merged model share the code): hashing it per file
    # would read the user's code files once per checkpoint.
    check_code_unchanged(spec["model"], spec.get("code"), "evaluate")
    check_merged(merged_path, gather)
    for kind, path in sets:  # the test split of the dataset the ranks trained on, never another's
        if kind.name == HEADLINE:
            check_dataset_of(path, "test", gather.dataset_sha256)
    # An adapter training's ranks hold factors, not the model: the base is checked, and each factor
    # against its base weight when the rank's model is formed (shardfuse.models.lora.dense_weights).
    checkpoints = [] if gather.adapted else [(Path(r.path), RERUN_TRAIN) for r in gather.ranks]
    checkpoints += [(Path(gather.base), RERUN_TRAIN), (merged_path, RERUN_MERGE)]
    for path, rerun in checkpoints:
        check_model_fits(f"the header of {path}", *header_spec(path, rerun), rerun)
    if merge_json is None and (merged_path.parent / MergeRecord.FILE).is_file():
        merge_json = merged_path.parent / MergeRecord.FILE
    if merge_json is not None:
        merge = MergeRecord.read(merge_json)
        if merge.run not in (None, run, gather.run):  # (older merge stages recorded the training's name)
            raise UserError(f"{merge_json} is the merge of run {merge.run!r}, not of {run!r}; {RERUN_MERGE}")
        check_merged_record(merged_path, merge_json, merge.method, merge.sha256)
    weighted = weighting(named, gather)
    models = TrainingModels(merged_path, [(r.rank, Path(r.path)) for r in gather.ranks], Path(gather.base))
    scored = score_sets(splits, models, spec, batch_size, weighted)
    task = task_for(spec["task"])
    score = task.score
    test = scored[HEADLINE]
    merged, ranks, ensemble = test["merged"], test["ranks"], test["ensemble"]
    scores = [r[score] for r in ranks]
    best = task.best(scores)
    baseline = None
    strategy = recorded_strategy(gather.strategy)
    if strategy is not None and strategy.baseline:  # a ddp run is its own baseline
        baseline = {"run": run, **merged}
    elif ddp_baseline is not None:
        ddp = EvalRecord.read(ddp_baseline, "ddp baseline evaluation")
        baseline = {"run": ddp.required("run"), **ddp.required("merged")}
    return EvalRecord(
        run=run,
        training=gather.run,
        test_rows=test["rows"],
        task=task.name,
        score=score,
        lower_is_better=task.lower_is_better,
        metrics=list(task.metrics),
        merged=merged,
        base=test["base"],
        ranks=ranks,
        best_rank=best,
        mean_rank=sum(scores) / len(scores),
        mean_rank_loss=sum(r["loss"] for r in ranks) / len(ranks),
        fusion_gain=task.gain(merged[score], best),
        ensemble=ensemble,
        ensemble_score=ensemble[score],
        fusion_gap=task.gain(ensemble[score], merged[score]),
        ddp_baseline=baseline,
        local=(local_scores(scored, task) | domain_scores(scored, task)) or None,
        sets=scored,
        **rank_loss(gather),
    )


def rank_loss(gather: GatherRecord) -> dict[str, Any]:
    """eval.json's ranks_lost, coverage and steps_discarded when the training lost a rank for good
    (gather.json's membership); nothing otherwise."""
    membership = gather.membership or {}
    lost = membership.get("lost_ranks") or []
    if not lost:
        return {}
    return {
        "ranks_lost": len(lost),
        "coverage": float(membership.get("coverage", 1.0)),
        "steps_discarded": int(membership.get("steps_discarded", 0)),
    }


def weighting(named: list[tuple[SetKind, EvalSet]], gather: GatherRecord) -> tuple[SetKind, Weighting] | None:
    """The requested kind whose sets weigh the test split's rows (each rank's local distribution) and its
    weighting, checked against the test split and the training; None when none was asked for."""
    kinds = {kind.name: (kind, evaluation_set.path) for kind, evaluation_set in named if kind.weighs}
    if not kinds:
        return None
    if len(kinds) > 1:
        raise UserError(
            f"evaluation sets of kinds {', '.join(kinds)} all weigh the test split; pass one of them"
        )
    ((kind, path),) = kinds.values()
    headline = next(evaluation_set.path for _, evaluation_set in named if evaluation_set.name == HEADLINE)
    return kind, kind.weighs(path, headline, gather)


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run name (recorded in eval.json)")
    parser.add_argument("--test", type=Path, help="test split Parquet (the same as --set test=PATH)")
    parser.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KIND=PATH",
        help="an evaluation set by its kind (shardfuse.scoring.sets: test, local); repeat for several",
    )
    parser.add_argument("--gather", type=Path, required=True, help="gather.json of the run")
    parser.add_argument("--merged", type=Path, required=True, help="merged.safetensors of the run")
    parser.add_argument(
        "--merge-json",
        type=Path,
        help="the run's merge.json (default: the one beside --merged), checked against the merged model",
    )
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per forward pass")
    parser.add_argument(
        "--ddp-baseline",
        nargs="?",
        default="",
        help="eval.json of the ddp run trained like this one, recorded in this one (the workflow leaves it "
        "to plots, track and summary, so that evaluate never waits for another run)",
    )
    parser.add_argument("--out", type=Path, required=True, help="eval.json to write")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    sets = requested_sets(args)
    baseline = Path(args.ddp_baseline) if args.ddp_baseline else None
    result = evaluate(args.run, sets, args.gather, args.merged, args.batch_size, baseline, args.merge_json)
    write_json(args.out, result.to_json())
    normalized = (result.local or {}).get(f"normalized_{result.score}")
    print(
        f"{result.run}: merged {result.score} {result.merged[result.score]:.4f}, best rank "
        f"{result.best_rank:.4f}, mean rank {result.mean_rank:.4f}, ensemble {result.ensemble_score:.4f}"
        + ("" if normalized is None else f", normalized {result.score} {normalized:.4f}")
    )


def requested_sets(args: argparse.Namespace) -> list[tuple[SetKind, Path]]:
    """``--test`` first (the headline), then every ``--set`` in order."""
    sets = [] if args.test is None else [(set_kind(HEADLINE), args.test)]
    return sets + [parse_set(text) for text in args.sets]


if __name__ == "__main__":
    run_cli(main)
    exit_now()  # every file written: skip the interpreter's teardown of torch / matplotlib
