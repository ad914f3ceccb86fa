"""Benchmark 2: the shard reader against the naive path, and its share of a training step.

    python bench/reader.py                          # a 4M-row x 32-feature shard
    python bench/reader.py --rows 50000 --reps 1    # smoke size
    python bench/reader.py --rows 20000 --batches 3000 --token-blocks 62500 --images 10000 --reps 1
                                                    # token and image figures at full size, quickly

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

Two more sample kinds (``shardfuse.data.shard_format``):

* token blocks: a causal-LM shard (``tokens``, uint16, block size 256; ``--token-blocks`` blocks,
  default ``--rows`` / 64), read in batches of 32 blocks as int64 from ShardReader's cache (epoch 1;
  epoch 0 fills it), against a naive loader: pandas.read_parquet -> Python lists -> torch.tensor per
  batch. Each in its own process; tokens/s per rank and time to first batch.
* images: decoding a tensor column (``x``, [1, 28, 28] float32; ``--images`` rows, default ``--rows``
  / 400) into a float32 array with the zero-copy view the reader uses, against a per-row
  ``np.array(row)`` loop over the same in-memory Arrow column, in this process.

And the wait share of a training step for those two kinds with the examples' built-in models, measured
as the MLP's above (ShardReader cache=True, epochs 0 and 1, the larger share): the ``transformer``
(width 64, 2 layers, 4 heads) on token blocks of 64 + 1 uint16 ids, and the ``cnn`` (channels 16, 32)
on [1, 8, 8] float32 images with int64 labels; batch 32, the task's loss, AdamW. Each shard holds
``--model-rows`` rows (default ``--rows`` / 64) written by partition; ``--model-steps`` steps an epoch.
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_TTFB_SPEEDUP = 5.0
TARGET_WAIT_SHARE = 0.05
TARGET_TOKENS_PER_S = 5e6
TARGET_IMAGE_SPEEDUP = 10.0
TOKEN_BLOCK_SIZE = 256
IMAGE_SHAPE = (1, 28, 28)
TOKEN_PATHS = ("naive", "ShardReader")
# The built-in models of the examples, each fed by ShardReader (its training step's wait share): the kind
# of sample, the model and its args, the batch size and the dataset.json it trains on.
MODEL_BLOCK_SIZE = 64
MODEL_VOCAB_SIZE = 256
MODEL_IMAGE_SHAPE = (1, 8, 8)
MODEL_RUNS = {
    "tokens": {
        "model": "transformer",
        "args": {"width": 64, "layers": 2, "heads": 4},
        "batch_size": 32,
        "info": {
            "task": "causal_lm",
            "num_features": MODEL_BLOCK_SIZE + 1,
            "num_classes": 0,
            "label_names": [],
            "feature_names": [],
            "vocab_size": MODEL_VOCAB_SIZE,
            "block_size": MODEL_BLOCK_SIZE,
            "input": {"kind": "tokens", "shape": [MODEL_BLOCK_SIZE + 1], "dtype": "uint16"},
        },
    },
    "images": {
        "model": "cnn",
        "args": {"channels": [16, 32]},
        "batch_size": 32,
        "info": {
            "task": "classification",
            "num_features": 64,
            "num_classes": 10,
            "label_names": [str(i) for i in range(10)],
            "feature_names": [],
            "input": {"kind": "tensor", "shape": list(MODEL_IMAGE_SHAPE), "dtype": "float32"},
        },
    },
}
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

    from shardfuse.data.manifest import read_manifest
    from shardfuse.data.reader import ShardReader, load_shard

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


def timed_steps(batches, step, num_batches: int, num_steps: int) -> dict:
    """Times ``num_steps`` training steps (``step(batch)``) in epoch 0 and again in epoch 1 of
    ``batches`` (``num_batches`` an epoch, the first already taken): the share of wall time spent
    waiting for the next batch (the larger of the two epochs), epoch 1's start and the step time."""

    def train(steps: int) -> tuple[float, float]:
        waiting = computing = 0.0
        for _ in range(steps):
            tick = time.perf_counter()
            batch = next(batches)
            tock = time.perf_counter()
            step(batch)
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


def measure_training(path_name: str, shard_dir: Path, num_steps: int) -> dict:
    """Runs in a child process: the default MLP's training step fed by ``path_name``; the share of
    wall time spent waiting for batches."""
    import torch
    import torch.nn.functional as F

    from shardfuse.data.dataset_info import read_dataset_info
    from shardfuse.data.manifest import read_manifest
    from shardfuse.models.registry import build_model
    from shardfuse.models.spec import model_spec

    torch.set_num_threads(1)
    torch.manual_seed(0)
    info = read_dataset_info(shard_dir.parent / "dataset")
    model = build_model(model_spec("mlp", {}, [], info, run_cfg=DEFAULT_RUN))
    optimizer = torch.optim.SGD(model.parameters(), lr=DEFAULT_RUN["lr"], momentum=DEFAULT_RUN["momentum"])
    rows = read_manifest(shard_dir)["shards"][0]["rows"]
    num_batches = -(-rows // DEFAULT_RUN["batch_size"])
    batches = batches_of(path_name, shard_dir, DEFAULT_RUN["batch_size"], epochs=2)
    next(batches)  # start-up is time to first batch, measured above; this is the steady state

    def step(batch) -> None:
        features, labels = batch
        optimizer.zero_grad(set_to_none=True)
        F.cross_entropy(model(features), labels).backward()
        optimizer.step()

    return timed_steps(batches, step, num_batches, num_steps)


def measure_model_training(kind: str, shard_dir: Path, num_steps: int) -> dict:
    """Runs in a child process: a built-in model's training step (``MODEL_RUNS[kind]``: transformer on
    token blocks, cnn on images; the task's loss, AdamW) fed by ShardReader (cache=True, as train
    reads); the share of wall time spent waiting for batches, as :func:`measure_training`."""
    import torch

    from shardfuse.data.manifest import read_manifest
    from shardfuse.models.registry import build_model
    from shardfuse.models.spec import model_spec
    from shardfuse.models.tasks import task_for

    run_cfg = MODEL_RUNS[kind]
    torch.set_num_threads(1)
    torch.manual_seed(0)
    info = run_cfg["info"]
    model = build_model(model_spec(run_cfg["model"], run_cfg["args"], [], info))
    task = task_for(info["task"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    rows = read_manifest(shard_dir)["shards"][0]["rows"]
    num_batches = -(-rows // run_cfg["batch_size"])
    batches = batches_of("ShardReader", shard_dir, run_cfg["batch_size"], epochs=2)
    next(batches)  # start-up is time to first batch; this is the steady state

    def step(batch) -> None:
        x, y = task.batch(*batch)
        optimizer.zero_grad(set_to_none=True)
        task.loss(model(x), y).backward()
        optimizer.step()

    return timed_steps(batches, step, num_batches, num_steps)


def token_batches(path_name: str, shard_dir: Path, batch_size: int, seed: int = 0):
    """An endless iterator over int64 [batch_size, block_size + 1] token batches of rank 0's shard,
    started now: epochs 0, 1, ... (ShardReader: epoch 0 streams and fills the cache)."""
    import torch

    from shardfuse.data.manifest import read_manifest
    from shardfuse.data.reader import ShardReader

    num_rows = read_manifest(shard_dir)["shards"][0]["rows"]
    num_batches = max(1, num_rows // batch_size)
    if path_name == "naive":
        import pandas as pd

        rows = [row.tolist() for row in pd.read_parquet(shard_dir / "shard-0.parquet")["tokens"]]
        generator = torch.Generator().manual_seed(seed)

        def naive():
            while True:
                order = torch.randperm(num_rows, generator=generator).tolist()
                for start in range(0, num_batches * batch_size, batch_size):
                    yield torch.tensor(
                        [rows[i] for i in order[start : start + batch_size]], dtype=torch.int64
                    )

        return naive()
    reader = ShardReader(shard_dir, 0, seed=seed, cache=True)
    return (features for epoch in itertools.count() for features, _ in reader.epoch(epoch, num_batches))


def measure_tokens(path_name: str, shard_dir: Path, batch_size: int, max_batches: int) -> dict:
    """Runs in a child process: time to first batch, then tokens/s over an epoch (at most
    ``max_batches`` batches) of the cached shard (ShardReader's epoch 1; naive: its second epoch)."""
    import torch

    from shardfuse.data.manifest import read_manifest

    torch.set_num_threads(1)
    num_batches = max(1, read_manifest(shard_dir)["shards"][0]["rows"] // batch_size)
    started = time.perf_counter()
    batches = token_batches(path_name, shard_dir, batch_size)
    first = next(batches)
    ttfb = time.perf_counter() - started
    assert first.dtype == torch.int64 and first.shape[1] == TOKEN_BLOCK_SIZE + 1
    for _ in range(num_batches - 1):  # the rest of epoch 0: ShardReader fills its cache
        next(batches)
    count = min(num_batches, max_batches)
    started = time.perf_counter()
    tokens = sum(next(batches).numel() for _ in range(count))
    return {"ttfb_s": ttfb, "tokens_per_s": tokens / (time.perf_counter() - started)}


def measure_images(num_images: int, reps: int, work_dir: Path) -> dict:
    """Decoding a tensor column: the reader's zero-copy view (+ one copy into a float32 array, as into
    a shuffle window) against a per-row np.array loop, interleaved ``reps`` times in this process."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardfuse.data.shard_format import SHAPE_KEY, list_values, recognise_layout

    size = int(np.prod(IMAGE_SHAPE))
    pixels = np.random.default_rng(0).integers(0, 256, num_images * size).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(pixels), size)
    field = pa.field("x", column.type, metadata={SHAPE_KEY: json.dumps(list(IMAGE_SHAPE)).encode()})
    labels = pa.array(np.zeros(num_images, np.int64))
    path = work_dir / "images.parquet"
    table = pa.Table.from_arrays([column, labels], schema=pa.schema([field, pa.field("label", pa.int64())]))
    pq.write_table(table, path, row_group_size=4096)
    table = pq.read_table(path)  # both decode the same in-memory column (several chunks)
    spec = recognise_layout(table.schema, path).features[0]
    seconds: dict[str, list[float]] = {"per-row loop": [], "tensor column": []}
    for _ in range(reps):
        started = time.perf_counter()
        rows = table["x"].to_pylist()
        loop = np.stack([np.array(row, dtype=np.float32).reshape(IMAGE_SHAPE) for row in rows])
        seconds["per-row loop"].append(time.perf_counter() - started)
        started = time.perf_counter()
        decoded = np.array(list_values(table["x"], spec, path), dtype=np.float32)
        seconds["tensor column"].append(time.perf_counter() - started)
        assert np.array_equal(loop, decoded)
    return seconds


def write_model_split(kind: str, path: Path, num_rows: int) -> Path:
    """A prepared split for ``MODEL_RUNS[kind]``: ``tokens`` (fixed_size_list<uint16>[block_size + 1],
    ids below the model's vocabulary) or ``x`` (fixed_size_list<float32>, its shape in the field metadata)
    and an int64 ``label`` of 10 classes; written in row groups, as prepare writes them."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    from shardfuse.data.shard_format import SHAPE_KEY

    rng = np.random.default_rng(0)
    if kind == "tokens":
        width = MODEL_BLOCK_SIZE + 1
        ids = pa.array(rng.integers(0, MODEL_VOCAB_SIZE, num_rows * width, dtype=np.uint16))
        table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(ids, width)})
    else:
        size = int(np.prod(MODEL_IMAGE_SHAPE))
        x = pa.FixedSizeListArray.from_arrays(pa.array(rng.random(num_rows * size, dtype=np.float32)), size)
        shape = json.dumps(list(MODEL_IMAGE_SHAPE)).encode()
        schema = pa.schema(
            [pa.field("x", x.type, metadata={SHAPE_KEY: shape}), pa.field("label", pa.int64())]
        )
        table = pa.Table.from_arrays([x, pa.array(rng.integers(0, 10, num_rows))], schema=schema)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path, row_group_size=16_384)
    return path


def make_shard(work_dir: Path, num_rows: int, num_features: int) -> Path:
    common.make_dataset(work_dir / "dataset", num_rows, num_features)
    return common.make_shards(work_dir / "dataset", 1, work_dir / "shards")


def child(
    kind: str, path_name: str, shard_dir: Path, args: argparse.Namespace, steps: int | None = None
) -> list[object]:
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
        steps or args.steps,
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
    kinds_markdown, kinds_checks, kinds_results = sample_kinds(args)
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
        "markdown": markdown + "\n\n" + kinds_markdown,
        "checks": checks + kinds_checks,
        "results": {"samples": samples, "training": training, "shard_mb": shard_mb, **kinds_results},
    }


def sample_kinds(args: argparse.Namespace) -> tuple[str, list, dict]:
    """The token-block and image benchmarks: Markdown, checks and raw results."""
    # run_all passes only the numeric sizes: the others follow --rows unless given.
    num_blocks = getattr(args, "token_blocks", None) or max(256, args.rows // 64)
    num_images = getattr(args, "images", None) or max(50, args.rows // 400)
    corpus_dir = args.work_dir / "tokens"
    corpus_dir.mkdir(parents=True, exist_ok=True)
    common.write_token_corpus(corpus_dir / "train.parquet", num_blocks, TOKEN_BLOCK_SIZE)
    shard_dir = common.make_shards(corpus_dir, 1, args.work_dir / "token-shards")
    corpus_mb = (shard_dir / "shard-0.parquet").stat().st_size / 1e6
    tokens: dict[str, list[dict]] = {name: [] for name in TOKEN_PATHS}
    for _ in range(args.reps):
        for name in TOKEN_PATHS:
            measured = common.measure(child("tokens", name, shard_dir, args))
            tokens[name].append(
                {**json.loads(measured.stdout.strip().splitlines()[-1]), "rss": measured.peak_rss_mb}
            )
    images = measure_images(num_images, args.reps, args.work_dir)
    model_rows = getattr(args, "model_rows", None) or max(1_000, args.rows // 64)
    model_steps = getattr(args, "model_steps", None) or max(10, min(200, model_rows // 64))
    model_shards = {}
    for kind in MODEL_RUNS:
        write_model_split(kind, args.work_dir / f"{kind}-model" / "train.parquet", model_rows)
        model_shards[kind] = common.make_shards(
            args.work_dir / f"{kind}-model", 1, args.work_dir / f"{kind}-model-shards"
        )
    models: dict[str, list[dict]] = {kind: [] for kind in MODEL_RUNS}
    for _ in range(args.reps):
        for kind in MODEL_RUNS:
            measured = common.measure(child("model", kind, model_shards[kind], args, steps=model_steps))
            models[kind].append(json.loads(measured.stdout.strip().splitlines()[-1]))

    def med(name: str, key: str) -> float:
        return common.median([sample[key] for sample in tokens[name]])

    token_ratio = common.median(
        [
            o["tokens_per_s"] / n["tokens_per_s"]
            for n, o in zip(tokens["naive"], tokens["ShardReader"], strict=True)
        ]
    )
    token_rows = [
        [
            name,
            med(name, "ttfb_s"),
            med(name, "tokens_per_s"),
            "1x" if name == "naive" else f"{token_ratio:.1f}x",
            f"{med(name, 'rss'):.0f}",
        ]
        for name in TOKEN_PATHS
    ]
    image_speedup = common.median(
        [loop / view for loop, view in zip(images["per-row loop"], images["tensor column"], strict=True)]
    )
    image_rows = [
        [
            name,
            common.median(times),
            num_images / common.median(times),
            "1x" if name == "per-row loop" else f"{image_speedup:.1f}x",
        ]
        for name, times in images.items()
    ]
    reader_tokens = med("ShardReader", "tokens_per_s")

    def model_med(kind: str, key: str) -> float:
        return common.median([sample[key] for sample in models[kind]])

    model_rows_md = [
        [
            "token blocks" if kind == "tokens" else "images",
            f"{run_cfg['model']} {json.dumps(run_cfg['args'])}",
            " / ".join(
                f"{100 * common.median([m['wait_share_epochs'][e] for m in models[kind]]):.2f}%"
                for e in (0, 1)
            ),
            f"{model_med(kind, 'step_ms'):.3f}",
            f"{1000 * model_med(kind, 'epoch_start_s'):.0f} ms "
            f"({100 * model_med(kind, 'epoch_share'):.2f}% of the epoch)",
        ]
        for kind, run_cfg in MODEL_RUNS.items()
    ]
    markdown = (
        "Token blocks (causal LM):\n\n"
        + common.table(
            ["path", "time to first batch s", "tokens/s per rank", "tokens/s vs naive", "peak RSS MB"],
            token_rows,
        )
        + f"\n\n{num_blocks:,} blocks of {TOKEN_BLOCK_SIZE} + 1 uint16 tokens, {corpus_mb:,.0f} MB of "
        f"Parquet (one rank); batches of {args.batch_size} blocks as int64, tokens/s over one epoch (at most "
        f"{args.batches} batches) after the first (ShardReader: from its cache), 1 torch thread.\n\n"
        "Images (tensor column):\n\n"
        + common.table(["decode", "seconds", "images/s", "vs per-row loop"], image_rows)
        + f"\n\n{num_images:,} images {list(IMAGE_SHAPE)} float32 in memory (Arrow, several chunks) -> one "
        "float32 array; the per-row loop is to_pylist + np.array(row) per image. Median of "
        f"{args.reps} interleaved repetitions; ratios paired per repetition.\n\n"
        "Built-in models fed by ShardReader (wait share of a training step):\n\n"
        + common.table(
            [
                "samples",
                "model",
                "wait share of train step (epoch 0 / 1)",
                "step ms",
                "epoch 1 start (whole-shard permutation)",
            ],
            model_rows_md,
        )
        + f"\n\n{model_rows:,} rows each, one rank, written by partition: token blocks of "
        f"{MODEL_BLOCK_SIZE} + 1 uint16 ids (vocabulary {MODEL_VOCAB_SIZE}), causal_lm loss; images "
        f"{list(MODEL_IMAGE_SHAPE)} float32 with 10 classes, cross-entropy. Batch size "
        f"{MODEL_RUNS['tokens']['batch_size']}, AdamW, {model_steps} steps in epoch 0 and in epoch 1 "
        "(ShardReader cache=True: streamed, then cached), 1 torch thread; the larger share is checked. "
        f"Median of {args.reps} repetitions."
    )
    checks = [
        (
            f"ShardReader token blocks >= {TARGET_TOKENS_PER_S / 1e6:g} M tokens/s per rank (cached, block "
            f"{TOKEN_BLOCK_SIZE}, batch {args.batch_size})",
            f"{reader_tokens / 1e6:.1f} M/s ({token_ratio:.1f}x naive)",
            reader_tokens >= TARGET_TOKENS_PER_S,
        ),
        (
            f"tensor column decode >= {TARGET_IMAGE_SPEEDUP:g}x a per-row np.array loop",
            f"{image_speedup:.1f}x",
            image_speedup >= TARGET_IMAGE_SPEEDUP,
        ),
    ]
    for kind, step_name in (("tokens", "transformer step"), ("images", "CNN step")):
        share = model_med(kind, "wait_share")
        checks.append(
            (
                f"ShardReader < {100 * TARGET_WAIT_SHARE:g}% wait share, {step_name}",
                f"{100 * share:.2f}%",
                share < TARGET_WAIT_SHARE,
            )
        )
    return markdown, checks, {"tokens": tokens, "images": images, "models": models}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=4_000_000)
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--batch-size", type=int, default=DEFAULT_RUN["batch_size"])
    parser.add_argument("--batches", type=int, default=10_000)
    parser.add_argument("--steps", type=int, default=3_000)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--token-blocks", type=int, help="token blocks of the causal-LM shard (--rows / 64)")
    parser.add_argument("--images", type=int, help="images of the tensor decode (--rows / 400)")
    parser.add_argument(
        "--model-rows", type=int, help="rows of the transformer and cnn wait-share shards (--rows / 64)"
    )
    parser.add_argument(
        "--model-steps", type=int, help="timed steps per epoch of the transformer and cnn (<= 200)"
    )
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/reader"))
    parser.add_argument("--shard-dir", type=Path, help="internal")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help="internal")
    args = parser.parse_args()
    if args.child:
        kind, path_name = args.child
        if kind == "read":
            result = measure_path(path_name, args.shard_dir, args.batch_size, args.batches)
        elif kind == "tokens":
            result = measure_tokens(path_name, args.shard_dir, args.batch_size, args.batches)
        elif kind == "model":
            result = measure_model_training(path_name, args.shard_dir, args.steps)
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
