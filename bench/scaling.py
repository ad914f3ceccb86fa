"""Benchmark 3: training throughput of the default MLP at world size 1 and 2 on this machine.

    python bench/scaling.py                        # 60k synthetic rows x 32 features, 2 epochs
    python bench/scaling.py --rows 4000 --epochs 1 --reps 1    # smoke size

Each run is ``python -m shardfuse.launch`` (torchrun, gloo) with the run defaults of the config schema
(hidden [64], SGD, batch 32, checkpoints every 100 steps) and OMP_NUM_THREADS=1: one thread per rank,
as torchrun sets for several ranks (set here for W=1 too, so both sizes compare like with like).
samples/s = rows of all shards x epochs / train_seconds (train.json: the slowest rank's training loop,
without process start). Efficiency = samples/s at W=2 / (2 x samples/s at W=1), paired per repetition.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

STRATEGIES = {"ddp": 0, "localsgd": 8}  # strategy -> sync_every (the config's localsgd run: every 8 steps)
WORLD_SIZES = (1, 2)


def train_config(strategy: str, epochs: int) -> dict:
    """The run defaults of the config schema, as the train rule would pass them."""
    from shardfuse.config import TRAIN_KEYS, load_experiment

    experiment = load_experiment(
        {
            "runs": {"bench": {"strategy": strategy, "sync_every": STRATEGIES[strategy], "epochs": epochs}},
            "datasets": {
                "bench": {"source": "synthetic", "num_rows": 10, "num_features": 1, "num_classes": 2}
            },
            "run_defaults": {"dataset": "bench", "world_size": 1, "merge_method": "uniform"},
        }
    )
    run = experiment.runs["bench"]
    return {key: run[key] for key in TRAIN_KEYS if key in run}


def run(
    rows: int, features: int, epochs: int, reps: int, work_dir: Path, strategies: list[str] | None = None
) -> dict:
    strategies = strategies or list(STRATEGIES)
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = work_dir / "dataset"
    common.make_dataset(dataset, rows, features, test_fraction=0.2)
    shard_dirs = {w: common.make_shards(dataset, w, work_dir / f"shards-w{w}") for w in WORLD_SIZES}
    env = common.child_env(OMP_NUM_THREADS="1")
    throughput: dict[tuple[str, int], list[float]] = {}
    wall: dict[tuple[str, int], list[float]] = {}
    for _ in range(reps):
        for strategy in strategies:
            cfg = json.dumps(train_config(strategy, epochs))
            for world_size in WORLD_SIZES:
                out = work_dir / f"run-{strategy}-w{world_size}"
                measured = common.measure(
                    common.python_cmd(
                        "-m",
                        "shardfuse.launch",
                        "--nproc-per-node",
                        world_size,
                        "--out-dir",
                        out,
                        "--",
                        "--run-name",
                        f"{strategy}-w{world_size}",
                        "--shard-dir",
                        shard_dirs[world_size],
                        "--dataset-dir",
                        dataset,
                        "--config-json",
                        cfg,
                    ),
                    env=env,
                )
                info = json.loads((out / "train.json").read_text())
                samples = sum(rank["rows"] for rank in info["ranks"]) * info["epochs"]
                throughput.setdefault((strategy, world_size), []).append(samples / info["train_seconds"])
                wall.setdefault((strategy, world_size), []).append(measured.seconds)
                common.remove(out)
    rows_out, checks, results = [], [], {}
    for strategy in strategies:
        one, two = throughput[(strategy, 1)], throughput[(strategy, 2)]
        efficiency = common.median([b / (2 * a) for a, b in zip(one, two, strict=True)])
        speedup = common.median([b / a for a, b in zip(one, two, strict=True)])
        results[strategy] = {"w1": one, "w2": two, "efficiency": efficiency}
        rows_out.append(
            [
                strategy,
                common.median(one),
                common.median(two),
                f"{speedup:.2f}x",
                f"{efficiency:.2f}",
                f"{common.median(wall[(strategy, 1)]):.1f} / {common.median(wall[(strategy, 2)]):.1f}",
            ]
        )
        checks.append((f"{strategy} efficiency at W=2 (reported, no target)", f"{efficiency:.2f}", None))
    markdown = common.table(
        [
            "strategy",
            "samples/s W=1",
            "samples/s W=2",
            "speed-up",
            "efficiency",
            "launch wall s W=1 / W=2",
        ],
        rows_out,
    )
    train_rows = json.loads((shard_dirs[1] / "manifest.json").read_text())["total_rows"]
    markdown += (
        f"\n\nDataset: synthetic, {train_rows:,} train rows x {features} features, {epochs} epochs, "
        "batch 32, "
        "default MLP [64] (run defaults, checkpoints every 100 steps), gloo, 1 thread per rank. "
        f"Median of {reps} repetitions; ratios paired per repetition. Launch wall time includes torchrun "
        "start, imports and writing outputs."
    )
    return {"title": "3. Scaling on this machine", "markdown": markdown, "checks": checks, "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=60_000, help="rows of the synthetic dataset")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--strategies", nargs="+", choices=list(STRATEGIES), default=list(STRATEGIES))
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/scaling"))
    args = parser.parse_args()
    try:
        section = run(args.rows, args.features, args.epochs, args.reps, args.work_dir, args.strategies)
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])
    for name, value, _ in section["checks"]:
        print(f"{name}: {value}")


if __name__ == "__main__":
    main()
