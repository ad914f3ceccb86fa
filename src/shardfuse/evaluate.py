"""Evaluate the merged model, every rank's own model and the shared initial model on the test split.

By hand::

    python -m shardfuse.evaluate --run ddp --test results/datasets/digits/test.parquet \
        --gather results/trainings/<training>/gather.json --merged results/runs/ddp/merged.safetensors \
        --out results/runs/ddp/eval.json [--ddp-baseline results/runs/<ddp run>/eval.json]

Before any model is built: every checkpoint gather.json lists must be this training's
(shardfuse.trust.read_gather), the merged model a merge of it, and each file's model spec must fit its
tensors (shardfuse.models.check_model_fits), so no model larger than its file is ever allocated.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from shardfuse.checkpoint import load_weights
from shardfuse.data import load_table
from shardfuse.io import StageParser, UserError, read_json, run_cli, write_json
from shardfuse.models import check_model_fits, normalized_spec, score_state_dict
from shardfuse.tasks import task_for
from shardfuse.trust import RERUN_MERGE, RERUN_TRAIN, check_merged, header_spec, read_gather
from shardfuse.usercode import check_code_unchanged


def evaluate_weights(
    path: Path, features: torch.Tensor, labels: torch.Tensor, batch_size: int
) -> dict[str, float]:
    tensors, metadata = load_weights(path)
    return score_state_dict(tensors, metadata["model"], features, labels, batch_size)


def evaluate(
    run: str,
    test_path: Path,
    gather_path: Path,
    merged_path: Path,
    batch_size: int,
    ddp_baseline: Path | None = None,
) -> dict[str, Any]:
    features, labels = load_table(test_path)
    if features.shape[0] == 0:
        raise UserError(f"test split {test_path} has no rows; raise the dataset's test_fraction")
    info = read_gather(gather_path, base=True, need=("model",))
    spec = normalized_spec(info["model"])
    # Once for the training (its ranks, base and merged model share the code): hashing it per file
    # would read the user's code files once per checkpoint.
    check_code_unchanged(spec["model"], spec.get("code"), "evaluate")
    check_merged(merged_path, info)
    checkpoints = [(Path(r["path"]), RERUN_TRAIN) for r in info["ranks"]]
    checkpoints += [(Path(info["base"]), RERUN_TRAIN), (merged_path, RERUN_MERGE)]
    for path, rerun in checkpoints:
        check_model_fits(f"the header of {path}", *header_spec(path, rerun), rerun)
    task = task_for(spec["task"])
    score = task.score
    ranks = [
        {"rank": r["rank"], **evaluate_weights(Path(r["path"]), features, labels, batch_size)}
        for r in info["ranks"]
    ]
    scores = [r[score] for r in ranks]
    merged = evaluate_weights(merged_path, features, labels, batch_size)
    best = task.best(scores)
    result = {
        "run": run,
        "training": info["run"],
        "test_rows": int(features.shape[0]),
        "task": task.name,
        "score": score,
        "lower_is_better": task.lower_is_better,
        "metrics": list(task.metrics),
        "merged": merged,
        "base": evaluate_weights(Path(info["base"]), features, labels, batch_size),
        "ranks": ranks,
        f"best_rank_{score}": best,
        f"mean_rank_{score}": sum(scores) / len(scores),
        "mean_rank_loss": sum(r["loss"] for r in ranks) / len(ranks),
        "fusion_gain": task.gain(merged[score], best),
        "ddp_baseline": None,
    }
    if info.get("strategy") == "ddp":
        result["ddp_baseline"] = {"run": run, **merged}
    elif ddp_baseline is not None:
        baseline = read_json(ddp_baseline, "ddp baseline evaluation")
        result["ddp_baseline"] = {"run": baseline["run"], **baseline["merged"]}
    return result


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.evaluate", description=__doc__.splitlines()[0])
    parser.add_argument("--run", required=True, help="run name (recorded in eval.json)")
    parser.add_argument("--test", type=Path, required=True, help="test split Parquet")
    parser.add_argument("--gather", type=Path, required=True, help="gather.json of the run")
    parser.add_argument("--merged", type=Path, required=True, help="merged.safetensors of the run")
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per forward pass")
    parser.add_argument(
        "--ddp-baseline", nargs="?", default="", help="eval.json of the ddp run trained like this one, if any"
    )
    parser.add_argument("--out", type=Path, required=True, help="eval.json to write")
    args = parser.parse_args(argv)
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    baseline = Path(args.ddp_baseline) if args.ddp_baseline else None
    result = evaluate(args.run, args.test, args.gather, args.merged, args.batch_size, baseline)
    write_json(args.out, result)
    score = result["score"]
    print(
        f"{result['run']}: merged {score} {result['merged'][score]:.4f}, best rank "
        f"{result[f'best_rank_{score}']:.4f}, mean rank {result[f'mean_rank_{score}']:.4f}"
    )


if __name__ == "__main__":
    run_cli(main)
