"""What a merge-search trial costs, against one in-memory merge plus one validation pass measured alone.

    snakemake --cores all --until gather        # the default experiment's trainings, once
    python bench/search.py                      # its world-size-4 localsgd training; 50 trials
    python bench/search.py --training results/trainings/NAME --dataset results/datasets/digits

Measured in this process, after one warm-up of each (imports, first allocations):
  merge     TrialMerger.tensors: the ranks held in memory merged by the method's plan, tensor by tensor
  score     Scorer.score on the validation split: the model built and one pass over the split
  trial     a study of --trials trials (TPE, a fresh SQLite storage) run by run_study, divided by the
            number of trials: sampling, storage writes, merge and score
and, as a whole process, ``python -m shardfuse.merge ... --search-json`` with the same study: the
merge stage as the workflow runs it (imports, the study, the final streamed merge, merge.json).
Targets (issue 51): trial <= 1.5 x (merge + score); the whole 50-trial merge <= 60 s on two cores.
Medians of --reps repetitions of merge and score.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def default_training() -> Path:
    found = sorted((REPO / "results" / "trainings").glob("digits-w4-localsgd-*/gather.json"))
    if not found:
        sys.exit(
            "bench/search.py: no digits-w4-localsgd training; run `snakemake --cores all --until gather`"
        )
    return found[0].parent


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--training", type=Path, help="results/trainings/NAME (with gather.json)")
    parser.add_argument("--dataset", type=Path, default=REPO / "results" / "datasets" / "digits")
    parser.add_argument("--method", default="task_arithmetic")
    parser.add_argument("--trials", type=int, default=50)
    parser.add_argument("--reps", type=int, default=20)
    args = parser.parse_args()
    training = args.training or default_training()

    from shardfuse.checkpoints.trust import read_gather
    from shardfuse.fusion.search import TrialMerger, parse, run_study
    from shardfuse.scoring.scorer import Scorer
    from shardfuse.scoring.split import load_split

    gather = read_gather(training / "gather.json", base=True, need=("tensors", "model"))
    split = load_split(args.dataset / "val.parquet", "val")
    scorer = Scorer(split, gather.model or {}, 4096)
    search = {"trials": args.trials, "seed": 0, "space": {"merge_scale": [0.2, 4.0]}}
    spec = parse(search, args.method, {"scale": "number"}, "merge_search")
    with TrialMerger(gather, args.method) as merger:
        tensors = merger.tensors({"scale": 1.0})
        scorer.score(tensors)  # warm-up
        merge_s, score_s = [], []
        for _ in range(args.reps):
            started = time.perf_counter()
            tensors = merger.tensors({"scale": 1.0})
            merge_s.append(time.perf_counter() - started)
            started = time.perf_counter()
            scorer.score(tensors)
            score_s.append(time.perf_counter() - started)
        with tempfile.TemporaryDirectory() as work:
            started = time.perf_counter()
            run_study(
                spec, args.method, Path(work) / "search.db", {},
                lambda p: float(scorer.score(merger.tensors(p))[scorer.task.score]),
                scorer.task.lower_is_better, len(merger.readers),
            )  # fmt: skip
            study_s = time.perf_counter() - started
        in_memory = merger.in_memory
    merge_m, score_m = statistics.median(merge_s), statistics.median(score_s)
    trial = study_s / args.trials
    with tempfile.TemporaryDirectory() as work:
        command = [
            sys.executable, "-m", "shardfuse.merge", "--gather", str(training / "gather.json"),
            "--method", args.method, "--val-split", str(args.dataset / "val.parquet"),
            "--search-json", json.dumps(search), "--search-db", f"{work}/search.db",
            "--out-weights", f"{work}/merged.safetensors", "--out-json", f"{work}/merge.json",
        ]  # fmt: skip
        started = time.perf_counter()
        subprocess.run(command, check=True, capture_output=True, env={"PYTHONPATH": str(REPO / "src")})
        whole = time.perf_counter() - started
    numel = sum(info.numel for info in merger.info.values())
    rows = {
        "training": training.name,
        "ranks": len(gather.ranks),
        "parameters": numel,
        "val_rows": split.rows,
        "in_memory": in_memory,
        "merge_ms": round(merge_m * 1000, 2),
        "score_ms": round(score_m * 1000, 2),
        "trial_ms": round(trial * 1000, 2),
        "trial_over_merge_plus_score": round(trial / (merge_m + score_m), 2),
        f"study_{args.trials}_trials_s": round(study_s, 2),
        "whole_merge_process_s": round(whole, 2),
    }
    print(json.dumps(rows, indent=2))
    ok = trial <= 1.5 * (merge_m + score_m) and (args.trials != 50 or whole <= 60)
    print(f"targets (trial <= 1.5 x merge + score; 50-trial merge <= 60 s): {'met' if ok else 'NOT met'}")


if __name__ == "__main__":
    main()
