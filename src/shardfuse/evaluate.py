"""Evaluate the merged model, every rank's own model, their ensemble and the initial model on the test split.

By hand::

    python -m shardfuse.evaluate --run ddp --test results/datasets/digits/test.parquet \
        --gather results/trainings/<training>/gather.json --merged results/runs/ddp/merged.safetensors \
        --out results/runs/ddp/eval.json [--ddp-baseline results/runs/<ddp run>/eval.json]

Before anything is read: the test split must be the one prepare wrote (the rows and sha256 of the
dataset.json beside it, shardfuse.data.verify.check_split). Before any model is built: every checkpoint
gather.json lists must be this training's
(shardfuse.checkpoints.trust.read_gather), the merged model a merge of it, and each file's model spec must fit
its tensors (shardfuse.models.registry.check_model_fits), so no model larger than its file is ever allocated.

The ensemble is the reference a fused single model is judged against: the ranks' outputs averaged as the
task says (shardfuse.models.tasks: ``combine``; mean probability, mean prediction, renormalised mean
log-probs), scored with the task's metrics. One pass over the test split runs every rank on each batch, scores
each
rank's outputs and their combination, and drops them before the next batch: memory holds every rank's
model at once, but only one batch of outputs. eval.json records it as ``ensemble`` ({metric: value}),
``ensemble_<score>``, and ``fusion_gap`` = how much better the ensemble scores than the merged model
(the task's sign: positive when the ensemble is better, whatever the score's direction).
"""

from __future__ import annotations

from pathlib import Path

import torch

from shardfuse.checkpoints.trust import RERUN_MERGE, RERUN_TRAIN, check_merged, header_spec, read_gather
from shardfuse.data.reader import load_table
from shardfuse.data.verify import check_split
from shardfuse.experiment.records import EvalRecord
from shardfuse.io import StageParser, UserError, run_cli, write_json
from shardfuse.models.adapter import file_ties, load_state
from shardfuse.models.lora import load_model_weights
from shardfuse.models.registry import (
    build_model,
    check_model_fits,
    normalized_spec,
    score_state_dict,
    task_of,
)
from shardfuse.models.tasks import Task, Totals, task_for
from shardfuse.models.usercode import check_code_unchanged
from shardfuse.strategies.registry import recorded_strategy


def evaluate_weights(
    path: Path, features: torch.Tensor, labels: torch.Tensor, batch_size: int
) -> dict[str, float]:
    tensors, metadata = load_model_weights(path)
    return score_state_dict(tensors, metadata["model"], features, labels, batch_size)


def _load_model(path: Path) -> tuple[torch.nn.Module, Task]:
    tensors, metadata = load_model_weights(path)
    model = build_model(metadata["model"])
    load_state(model, tensors, str(path), file_ties(metadata))
    model.eval()
    return model, task_of(metadata["model"], tensors)


@torch.no_grad()
def score_ranks_and_ensemble(
    paths: list[Path], features: torch.Tensor, labels: torch.Tensor, batch_size: int
) -> tuple[list[dict[str, float]], dict[str, float]]:
    """(each rank's metrics, the ensemble's) in one pass: every batch goes through every rank's model,
    each rank's outputs are scored as :func:`evaluate_weights` scores them (same batches, same sums, so
    the same figures), and their combination is scored as the ensemble's. The features must already
    fit the models (the merged model, of the same training, is scored first and checks that)."""
    models = [_load_model(path) for path in paths]
    task = models[0][1]  # the ranks of one training share the task and the target scale
    totals = [Totals() for _ in models]
    ensemble = Totals()
    for start in range(0, features.shape[0], batch_size):
        inputs, targets = task.batch(features[start : start + batch_size], labels[start : start + batch_size])
        outputs = []
        for (model, rank_task), rank_totals in zip(models, totals, strict=True):
            outputs.append(model(inputs))
            rank_task.accumulate(rank_totals, outputs[-1], targets)
        task.accumulate(ensemble, task.combine(outputs), targets)
    return [rank_task.finish(t) for (_, rank_task), t in zip(models, totals, strict=True)], task.finish(
        ensemble
    )


def evaluate(
    run: str,
    test_path: Path,
    gather_path: Path,
    merged_path: Path,
    batch_size: int,
    ddp_baseline: Path | None = None,
) -> EvalRecord:
    check_split(test_path, "test")  # the split prepare wrote, not another file in its place
    features, labels = load_table(test_path)
    if features.shape[0] == 0:
        raise UserError(f"test split {test_path} has no rows; raise the dataset's test_fraction")
    info = read_gather(gather_path, base=True, need=("model",))
    spec = normalized_spec(info["model"])
    # Once for the training (its ranks, base and merged model share the code): hashing it per file
    # would read the user's code files once per checkpoint.
    check_code_unchanged(spec["model"], spec.get("code"), "evaluate")
    check_merged(merged_path, info)
    # An adapter training's ranks hold factors, not the model: the base is checked, and each factor
    # against its base weight when the rank's model is formed (shardfuse.models.lora.dense_weights).
    adapted = info.get("adapter") is not None
    checkpoints = [] if adapted else [(Path(r["path"]), RERUN_TRAIN) for r in info["ranks"]]
    checkpoints += [(Path(info["base"]), RERUN_TRAIN), (merged_path, RERUN_MERGE)]
    for path, rerun in checkpoints:
        check_model_fits(f"the header of {path}", *header_spec(path, rerun), rerun)
    task = task_for(spec["task"])
    score = task.score
    # The merged model first: scoring it checks that the features fit the training's model.
    merged = evaluate_weights(merged_path, features, labels, batch_size)
    rank_metrics, ensemble = score_ranks_and_ensemble(
        [Path(r["path"]) for r in info["ranks"]], features, labels, batch_size
    )
    ranks = [{"rank": r["rank"], **metrics} for r, metrics in zip(info["ranks"], rank_metrics, strict=True)]
    scores = [r[score] for r in ranks]
    best = task.best(scores)
    base = evaluate_weights(Path(info["base"]), features, labels, batch_size)
    baseline = None
    strategy = recorded_strategy(info.get("strategy"))
    if strategy is not None and strategy.baseline:  # a ddp run is its own baseline
        baseline = {"run": run, **merged}
    elif ddp_baseline is not None:
        ddp = EvalRecord.read(ddp_baseline, "ddp baseline evaluation")
        baseline = {"run": ddp.required("run"), **ddp.required("merged")}
    return EvalRecord(
        run=run,
        training=info["run"],
        test_rows=int(features.shape[0]),
        task=task.name,
        score=score,
        lower_is_better=task.lower_is_better,
        metrics=list(task.metrics),
        merged=merged,
        base=base,
        ranks=ranks,
        best_rank=best,
        mean_rank=sum(scores) / len(scores),
        mean_rank_loss=sum(r["loss"] for r in ranks) / len(ranks),
        fusion_gain=task.gain(merged[score], best),
        ensemble=ensemble,
        ensemble_score=ensemble[score],
        fusion_gap=task.gain(ensemble[score], merged[score]),
        ddp_baseline=baseline,
    )


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run name (recorded in eval.json)")
    parser.add_argument("--test", type=Path, required=True, help="test split Parquet")
    parser.add_argument("--gather", type=Path, required=True, help="gather.json of the run")
    parser.add_argument("--merged", type=Path, required=True, help="merged.safetensors of the run")
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
    baseline = Path(args.ddp_baseline) if args.ddp_baseline else None
    result = evaluate(args.run, args.test, args.gather, args.merged, args.batch_size, baseline)
    write_json(args.out, result.to_json())
    print(
        f"{result.run}: merged {result.score} {result.merged[result.score]:.4f}, best rank "
        f"{result.best_rank:.4f}, mean rank {result.mean_rank:.4f}, ensemble {result.ensemble_score:.4f}"
    )


if __name__ == "__main__":
    run_cli(main)
