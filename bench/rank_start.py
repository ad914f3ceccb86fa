"""What starting the ranks costs: a whole training through the launcher (``python -m shardfuse.launch``,
torchrun's agent, the ranks, checkpoints, train.json) with the ranks forked from the agent (the default,
shardfuse/cluster/agent.py) against ranks started as fresh interpreters, as ``torchrun`` starts them
(``SHARDFUSE_RANK_START=spawn``: the baseline). scikit-learn's digits, an MLP [64], AdamW, batch 32,
10 epochs (the label-skew example's training), at world sizes 2 and 4.

    python bench/rank_start.py              # 5 repetitions, interleaved
    python bench/rank_start.py --reps 1     # smoke

Each launch is one child process measured with ``os.wait4`` (wall time, CPU time of it and every rank
it waited for); the two starts run interleaved, in turn first, so a busy machine slows both alike;
medians. Both must publish the same rank files, byte for byte (checked every repetition).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

CONFIG = {
    "activation": "relu", "batch_size": 32, "checkpoint_every": 100, "dropout": 0.0, "epoch_steps": "min",
    "epochs": 10, "hidden_sizes": [64], "keep_checkpoints": 2, "lr": 0.003, "momentum": 0.9,
    "nonfinite_loss": "error", "optimizer": "adamw", "precision": "auto", "seed": 0, "strategy": "ddp",
    "sync_every": 0, "weight_decay": 0.0,
}  # fmt: skip
STARTS = ("spawn", "fork")


def prepare(work: Path, world_sizes: list[int]) -> tuple[Path, dict[int, Path]]:
    dataset = work / "digits"
    spec = json.dumps({"source": "digits", "test_fraction": 0.2, "seed": 0})
    common.measure(common.python_cmd("-m", "shardfuse.prepare", "--name", "digits", "--spec-json", spec,
                                     "--out-dir", dataset))  # fmt: skip
    return dataset, {w: common.make_shards(dataset, w, work / f"shards-w{w}") for w in world_sizes}


def launch(out: Path, dataset: Path, shards: Path, world_size: int, start: str) -> common.Measured:
    cmd = common.python_cmd(
        "-m", "shardfuse.launch", "--nproc-per-node", world_size, "--out-dir", out, "--",
        "--run-name", "bench", "--shard-dir", shards, "--dataset-dir", dataset,
        "--config-json", json.dumps(CONFIG),
    )  # fmt: skip
    env = common.child_env(SHARDFUSE_RANK_START=start, SHARDFUSE_SYSTEM_METRICS_INTERVAL="0")
    return common.measure(cmd, env=env)


def rank_bytes(out: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(out.glob("rank-*.safetensors"))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[2, 4])
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="shardfuse-bench-rank-start-") as tmp:
        work = Path(tmp)
        dataset, shards = prepare(work, args.world_sizes)
        for world_size in args.world_sizes:
            runs: dict[str, list[common.Measured]] = {start: [] for start in STARTS}
            for rep in range(args.reps):
                order = STARTS if rep % 2 == 0 else STARTS[::-1]
                published = {}
                for start in order:
                    out = work / f"w{world_size}-{start}-{rep}"
                    runs[start].append(launch(out, dataset, shards[world_size], world_size, start))
                    published[start] = rank_bytes(out)
                    common.remove(out)
                if published["spawn"] != published["fork"] or not published["fork"]:
                    raise SystemExit(f"world size {world_size}: forked ranks published other bytes")
            wall = {start: common.median([m.seconds for m in runs[start]]) for start in STARTS}
            cpu = {start: common.median([m.cpu_seconds for m in runs[start]]) for start in STARTS}
            rows.append([
                world_size, wall["spawn"], wall["fork"], wall["fork"] / wall["spawn"],
                cpu["spawn"], cpu["fork"], cpu["fork"] / cpu["spawn"], "yes",
            ])  # fmt: skip
    print(
        common.table(
            [
                "world size",
                "wall s, spawn",
                "wall s, fork",
                "wall fork/spawn",
                "CPU s, spawn",
                "CPU s, fork",
                "CPU fork/spawn",
                "same bytes",
            ],
            rows,
        )
    )
    print(f"\n{args.reps} repetitions, medians; load average now {common.load_average()}")


if __name__ == "__main__":
    main()
