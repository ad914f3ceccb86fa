"""Benchmark 2: the shard reader against the naive path, and its share of a training step.

    python bench/reader.py                          # a 4M-row x 32-feature shard
    python bench/reader.py --rows 50000 --reps 1    # smoke size

Paths, each in its own process (peak RSS per process), interleaved and repeated:

* naive: pandas.read_parquet -> tensors -> TensorDataset -> DataLoader(shuffle=True);
* load_shard: the whole shard into tensors first (sha256 checked), then a randperm per epoch and
  ``index_select`` batches (the training data path before ShardReader);
* ShardReader: the training data path (``shardfuse.train``: ``cache=True``): row-group streaming with
  a background prefetch thread and a shuffle window in epoch 0 (sha256 checked in the background),
  which also fills an in-memory copy that later epochs draw full random permutations from.

Time to first batch runs from just before the path starts (imports done) to the first batch in hand;
samples/s is measured over the next ``--batches`` batches of ``--batch-size`` rows (the config's
default batch size). Then the default MLP trains ``--steps`` steps on each in-process path
(one torch thread, as a rank gets under torchrun with two ranks on two cores), in epoch 0 and again in
epoch 1 (ShardReader's streamed and cached halves), and the time spent waiting for the next batch is
reported as a share of the step time (the larger of the two epochs).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_TTFB_SPEEDUP = 5.0
TARGET_WAIT_SHARE = 0.05
# The config's run_defaults: the default model and optimiser.
DEFAULT_RUN = {
    "hidden_sizes": [64],
    "activation": "relu",
    "dropout": 0.0,
    "lr": 0.05,
    "momentum": 0.9,
    "batch_size": 32,
}
PATHS = ("naive", "load_shard", "ShardReader")


def batches_of(path_name: str, shard_dir: Path, batch_size: int, seed: int = 0, epochs: int = 1):
    """An iterator over (features, labels) batches of ``epochs`` epochs of rank 0's shard, started now."""
    import torch

    from shardfuse.data import ShardReader, load_shard
    from shardfuse.manifest import read_manifest

    num_rows = read_manifest(shard_dir)["shards"][0]["rows"]
    num_batches = max(1, -(-num_rows // batch_size))
    if path_name == "naive":
        import numpy as np
        import pandas as pd

        frame = pd.read_parquet(shard_dir / "shard-0.parquet")
        names = [c for c in frame.columns if c != "label"]
        dataset = torch.utils.data.TensorDataset(
            torch.tensor(frame[names].to_numpy(np.float32)), torch.tensor(frame["label"].to_numpy())
        )
        generator = torch.Generator().manual_seed(seed)
        loader = torch.utils.data.DataLoader(dataset, batch_size, shuffle=True, generator=generator)
        return (batch for _ in range(epochs) for batch in loader)
    if path_name == "load_shard":
        features, labels = load_shard(shard_dir, 0, verify=True)
        generator = torch.Generator().manual_seed(seed)
        return (
            (features.index_select(0, batch), labels.index_select(0, batch))
            for _ in range(epochs)
            for batch in torch.tensor_split(torch.randperm(num_rows, generator=generator), num_batches)
        )
    reader = ShardReader(shard_dir, 0, seed=seed, cache=True)
    return (batch for epoch in range(epochs) for batch in reader.epoch(epoch, num_batches))


def measure_path(path_name: str, shard_dir: Path, batch_size: int, num_batches: int) -> dict:
    """Runs in a child process: time to first batch, then samples/s over ``num_batches`` batches."""
    import torch

    torch.set_num_threads(1)
    started = time.perf_counter()
    batches = batches_of(path_name, shard_dir, batch_size)
    next(batches)
    first = time.perf_counter() - started
    started = time.perf_counter()
    samples = 0
    for _, (_, labels) in zip(range(num_batches), batches, strict=False):
        samples += len(labels)
    return {"ttfb_s": first, "samples_per_s": samples / (time.perf_counter() - started)}


def measure_training(path_name: str, shard_dir: Path, num_steps: int) -> dict:
    """Runs in a child process: the default MLP's training step fed by ``path_name``; the share of
    wall time spent waiting for batches."""
    import torch
    import torch.nn.functional as F

    from shardfuse.data import read_dataset_info
    from shardfuse.manifest import read_manifest
    from shardfuse.models import build_model, model_spec

    torch.set_num_threads(1)
    torch.manual_seed(0)
    info = read_dataset_info(shard_dir.parent / "dataset")
    model = build_model(model_spec("mlp", {}, [], info, run_cfg=DEFAULT_RUN))
    optimizer = torch.optim.SGD(model.parameters(), lr=DEFAULT_RUN["lr"], momentum=DEFAULT_RUN["momentum"])
    rows = read_manifest(shard_dir)["shards"][0]["rows"]
    num_batches = -(-rows // DEFAULT_RUN["batch_size"])
    batches = batches_of(path_name, shard_dir, DEFAULT_RUN["batch_size"], epochs=2)
    next(batches)  # start-up is time to first batch, measured above; this is the steady state

    def train(steps: int) -> tuple[float, float]:
        waiting = computing = 0.0
        for _ in range(steps):
            tick = time.perf_counter()
            features, labels = next(batches)
            tock = time.perf_counter()
            optimizer.zero_grad(set_to_none=True)
            F.cross_entropy(model(features), labels).backward()
            optimizer.step()
            waiting += tock - tick
            computing += time.perf_counter() - tock
        return waiting, computing

    epoch0 = train(num_steps)
    for _ in range(num_batches - 1 - num_steps):  # the rest of epoch 0, untimed
        next(batches)
    # Epoch 1 starts with a permutation of the whole shard: timed apart, as epoch 0's first batch is.
    tick = time.perf_counter()
    next(batches)
    epoch_start = time.perf_counter() - tick
    epoch1 = train(num_steps)
    shares = [waiting / (waiting + computing) for waiting, computing in (epoch0, epoch1)]
    return {
        "wait_share": max(shares),
        "wait_share_epochs": shares,
        "epoch_start_s": epoch_start,
        "epoch_share": epoch_start / (epoch_start + sum(epoch1) * (num_batches - 1) / num_steps),
        "step_ms": 1000 * sum(epoch0) / num_steps,
    }


def make_shard(work_dir: Path, num_rows: int, num_features: int) -> Path:
    common.make_dataset(work_dir / "dataset", num_rows, num_features)
    return common.make_shards(work_dir / "dataset", 1, work_dir / "shards")


def child(kind: str, path_name: str, shard_dir: Path, args: argparse.Namespace) -> list[object]:
    return common.python_cmd(
        __file__,
        "--child",
        kind,
        path_name,
        "--shard-dir",
        shard_dir,
        "--batch-size",
        args.batch_size,
        "--batches",
        args.batches,
        "--steps",
        args.steps,
    )


def run(args: argparse.Namespace) -> dict:
    args.work_dir.mkdir(parents=True, exist_ok=True)
    shard_dir = make_shard(args.work_dir, args.rows, args.features)
    shard_mb = (shard_dir / "shard-0.parquet").stat().st_size / 1e6
    samples: dict[str, list[dict]] = {name: [] for name in PATHS}
    training: dict[str, list[dict]] = {name: [] for name in ("load_shard", "ShardReader")}
    for _ in range(args.reps):
        for name in PATHS:
            measured = common.measure(child("read", name, shard_dir, args))
            samples[name].append(
                {**json.loads(measured.stdout.strip().splitlines()[-1]), "rss": measured.peak_rss_mb}
            )
        for name in training:
            measured = common.measure(child("train", name, shard_dir, args))
            training[name].append(json.loads(measured.stdout.strip().splitlines()[-1]))

    def med(name: str, key: str, source=samples) -> float:
        return common.median([s[key] for s in source[name]])

    def paired(name: str, key: str, invert: bool) -> float:
        pairs = zip(samples["naive"], samples[name], strict=True)
        return common.median([(n[key] / o[key]) if invert else (o[key] / n[key]) for n, o in pairs])

    rows = []
    for name in PATHS:
        rows.append(
            [
                name,
                med(name, "ttfb_s"),
                "1x" if name == "naive" else f"{paired(name, 'ttfb_s', invert=True):.1f}x",
                med(name, "samples_per_s"),
                "1x" if name == "naive" else f"{paired(name, 'samples_per_s', invert=False):.1f}x",
                f"{med(name, 'rss'):.0f}",
                " / ".join(
                    f"{100 * common.median([t['wait_share_epochs'][e] for t in training[name]]):.2f}%"
                    for e in (0, 1)
                )
                if name in training
                else "-",
                f"{med(name, 'step_ms', training):.3f}" if name in training else "-",
                (
                    f"{1000 * med(name, 'epoch_start_s', training):.0f} ms "
                    f"({100 * med(name, 'epoch_share', training):.2f}% of the epoch)"
                )
                if name in training
                else "-",
            ]
        )
    ttfb_speedup = paired("ShardReader", "ttfb_s", invert=True)
    throughput_ratio = paired("ShardReader", "samples_per_s", invert=False)
    wait_share = med("ShardReader", "wait_share", training)
    checks = [
        (
            f"ShardReader time to first batch >= {TARGET_TTFB_SPEEDUP:g}x better than naive",
            f"{ttfb_speedup:.1f}x",
            ttfb_speedup >= TARGET_TTFB_SPEEDUP,
        ),
        ("ShardReader samples/s >= naive", f"{throughput_ratio:.1f}x", throughput_ratio >= 1.0),
        (
            f"ShardReader wait share of a training step < {100 * TARGET_WAIT_SHARE:g}%",
            f"{100 * wait_share:.2f}%",
            wait_share < TARGET_WAIT_SHARE,
        ),
    ]
    markdown = common.table(
        [
            "path",
            "time to first batch s",
            "TTFB vs naive",
            "samples/s",
            "samples/s vs naive",
            "peak RSS MB",
            "wait share of train step (epoch 0 / 1)",
            "step ms",
            "epoch 1 start (whole-shard permutation)",
        ],
        rows,
    )
    markdown += (
        f"\n\nShard: {args.rows * 0.99:,.0f} rows x {args.features} float32 features, {shard_mb:,.0f} MB of "
        f"Parquet (one rank, written by partition). Batch size {args.batch_size}; samples/s over "
        f"{args.batches} batches after the first; training: default MLP {DEFAULT_RUN['hidden_sizes']}, SGD, "
        f"{args.steps} steps, 1 torch thread. Median of {args.reps} interleaved repetitions; ratios paired "
        "per repetition."
    )
    return {
        "title": "2. Shard reader",
        "markdown": markdown,
        "checks": checks,
        "results": {"samples": samples, "training": training, "shard_mb": shard_mb},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_RUN["batch_size"])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=3_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/reader"))
    parser.add_argument("--shard-dir", type=Path, help="internal")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help="internal")
    args = parser.parse_args()
    if args.child:
        kind, path_name = args.child
        if kind == "read":
            result = measure_path(path_name, args.shard_dir, args.batch_size, args.batches)
        else:
            result = measure_training(path_name, args.shard_dir, args.steps)
        print(json.dumps(result))
        return
    try:
        section = run(args)
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])
    for name, value, ok in section["checks"]:
        print(f"{common.verdict(ok)}  {name}: {value}")
    sys.exit(0 if all(ok for _, _, ok in section["checks"]) else 1)


if __name__ == "__main__":
    main()
