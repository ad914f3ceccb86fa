"""Benchmark shardfuse against what a user would run instead: mergekit for the merge, a bare torchrun
loop for training.

    python bench/peers.py                      # full sizes (about 15 minutes on two cores)
    python bench/peers.py --quick              # CI smoke: tiny sizes, once (the figures mean nothing)
    python bench/peers.py --only merge         # or --only train

**merge vs mergekit-pytorch** (mergekit 0.1.5's command for plain safetensors files, in the virtual
environment .ci/run makes: $SHARDFUSE_MERGEKIT_PYTHON, else /tmp/shardfuse-mergekit/bin/python; without
it this section says so and measures nothing). The same N rank files (bench/merge.py's: four big float32
tensors, small ones, an int64 counter; plus a base for TIES) are merged by both, each a whole process as a
user runs it, interleaved per repetition: ``python -m shardfuse.merge`` (every input's BLAKE3 verified)
and ``mergekit-pytorch config.yml out/`` (``linear`` with equal weights; ``ties`` with the base, density
0.5, equal weights: shardfuse's uniform and ties). Wall time and peak RSS of the process tree; medians,
ratios paired per repetition. Targets: shardfuse >= 2x faster and <= 1/20 of mergekit's peak RSS at
every size.

**training vs a bare torchrun loop**: the train stage (``python -m shardfuse.launch``, two ranks, DDP,
checkpoints and validation off, step metrics on as users run it) against ``bench/bare_loop.py``, the
loop a user writes by hand: the same model (built by the same factory from the same spec), batch size,
optimiser and number of steps, the rank's shard already in memory as tensors, DDP, nothing logged or
checkpointed. Both time their loop alone (after a barrier, to the last step), paired repetitions in
alternating order. Noise on a shared machine only ever adds time, so each side's best repetition is its
speed: steps/s, the ratio of the bests (the target), the framework's cost per step in microseconds
((shardfuse's best loop - the bare loop's best) / steps), and the paired ratios' median and range beside
them. Two figures say what that difference is made of: the framework's time measured inside the train
stage's loop (train.json's ``framework_seconds``: the slowest rank's time outside forward, backward, the
optimiser's step and the strategy's sync; per step and as a share of the loop, medians), and the bare
loop against itself (a third run per repetition, the ratio of the two bests: how far the same loop's best
moves between processes here). Targets: >= 0.95 of the bare loop's steps/s for the CNN and the
transformer; the MLP's is reported (its step is so short that a fixed per-step cost shows).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import tempfile
from pathlib import Path

import common

MERGE_SIZES = [(2, 100), (8, 100), (16, 100), (4, 1024)]  # (N ranks, MiB per model)
MERGE_QUICK = [(2, 8)]
MERGEKIT_METHODS = {"uniform": ("linear", {}), "ties": ("ties", {"density": 0.5})}
SPEED_TARGET, MEMORY_TARGET = 2.0, 1 / 20


def mergekit_python() -> Path | None:
    found = os.environ.get("SHARDFUSE_MERGEKIT_PYTHON") or "/tmp/shardfuse-mergekit/bin/python"
    path = Path(found)
    if not path.is_file():
        return None
    proc = subprocess.run([str(path), "-c", "import mergekit"], capture_output=True, check=False)
    return path if proc.returncode == 0 else None


def write_base(root: Path, record: dict) -> Path:
    """A base for TIES: rank 0's tensors, slightly moved (the ranks are then task vectors around it),
    with the header merge checks (the run, no rank)."""
    import numpy as np
    from safetensors.numpy import load_file, save_file

    tensors = load_file(record["ranks"][0]["path"])
    gen = np.random.default_rng(1234)
    for name, value in tensors.items():
        if value.dtype == np.float32:
            tensors[name] = (value + 0.1 * gen.standard_normal(value.shape, dtype=np.float32)).astype(
                np.float32
            )
    meta = {"run": record["run"], "rank": None, "model": record["model"]}
    path = root / "base.safetensors"
    save_file(tensors, str(path), metadata={"shardfuse": json.dumps(meta, sort_keys=True)})
    return path


def mergekit_config(path: Path, method: str, ranks: list[str], base: Path) -> Path:
    name, params = MERGEKIT_METHODS[method]
    config = {
        "merge_method": name,
        "dtype": "float32",
        "models": [{"model": rank, "parameters": {"weight": 1.0, **params}} for rank in ranks],
    }
    if method == "ties":
        config["base_model"] = str(base)
    else:
        config["parameters"] = {"normalize": True}
    path.write_text(json.dumps(config))  # YAML is a superset of JSON
    return path


def bench_merge(
    work: Path, sizes: list[tuple[int, int]], reps: int, methods: list[str] | None = None
) -> tuple[str, list[tuple]]:
    """(the Markdown table, target checks)."""
    from merge import gather_for, write_ranks  # bench/merge.py's rank files

    python = mergekit_python()
    if python is None:
        reason = (
            "mergekit is not installed: .ci/run makes its venv (/tmp/shardfuse-mergekit); set "
            "SHARDFUSE_MERGEKIT_PYTHON to another; nothing measured"
        )
        print(f"merge vs mergekit: skipped: {reason}", flush=True)
        return f"Not measured: {reason}.", [("merge vs mergekit-pytorch", "skipped: " + reason, None)]
    cli = python.parent / "mergekit-pytorch"
    # Each side's floor: the peak RSS of a process that imports the merge and exits (an interpreter
    # with numpy and safetensors; mergekit's with torch). Below it no merge of any size can go.
    ours_import = common.python_cmd("-c", "import shardfuse.merge")
    theirs_import = [python, "-c", "import mergekit.scripts.merge_raw_pytorch"]
    floors = {
        "shardfuse": common.median([common.measure(ours_import).peak_rss_mb for _ in range(reps)]),
        "mergekit": common.median([common.measure(theirs_import).peak_rss_mb for _ in range(reps)]),
    }
    print(f"import floors (peak RSS MiB): {floors}", flush=True)
    rows, checks = [], []
    for num_ranks, size_mb in sizes:
        root = work / f"merge-{num_ranks}x{size_mb}"
        root.mkdir(parents=True)
        record = write_ranks(root, size_mb, num_ranks)
        base = write_base(root, record)
        record["base"] = str(base)
        gather = gather_for(root, record, num_ranks)
        paths = [rank["path"] for rank in record["ranks"][:num_ranks]]
        for method in methods or list(MERGEKIT_METHODS):
            params = json.dumps(MERGEKIT_METHODS[method][1])
            config = mergekit_config(root / f"mergekit-{method}.yml", method, paths, base)
            ours, theirs = [], []
            for _ in range(reps):
                for out in (root / "out-sf.safetensors", root / "out-mk"):
                    shutil.rmtree(out, ignore_errors=True) if out.is_dir() else out.unlink(missing_ok=True)
                ours.append(
                    common.measure(
                        common.python_cmd(
                            "-m",
                            "shardfuse.merge",
                            "--gather",
                            gather,
                            "--method",
                            method,
                            "--params-json",
                            params,
                            "--out-weights",
                            root / "out-sf.safetensors",
                            "--out-json",
                            root / "out-sf.json",
                        )
                    )
                )
                theirs.append(
                    common.measure(
                        [cli, config, root / "out-mk", "--quiet", "--random-seed", "0"],
                        env=common.child_env(PATH=f"{python.parent}:{os.environ.get('PATH', '')}"),
                    )
                )
            speed = statistics.median(t.seconds / o.seconds for o, t in zip(ours, theirs, strict=True))
            memory = statistics.median(
                o.peak_rss_mb / t.peak_rss_mb for o, t in zip(ours, theirs, strict=True)
            )
            above = statistics.median(
                max(o.peak_rss_mb - floors["shardfuse"], 1.0) / (t.peak_rss_mb - floors["mergekit"])
                for o, t in zip(ours, theirs, strict=True)
            )
            fast, lean = speed >= SPEED_TARGET, memory <= MEMORY_TARGET
            checks.append(
                (
                    f"merge {method} vs mergekit-pytorch, N = {num_ranks} x {size_mb} MiB: >= 2x faster",
                    f"{speed:.2f}x",
                    fast,
                )
            )
            checks.append(
                (
                    f"merge {method} vs mergekit-pytorch, N = {num_ranks} x {size_mb} MiB: "
                    "<= 1/20 of its peak RSS",
                    f"1/{1 / memory:.0f}",
                    lean,
                )
            )
            rows.append(
                [
                    f"{num_ranks} x {size_mb}",
                    method,
                    f"{statistics.median(o.seconds for o in ours):.2f}",
                    f"{statistics.median(o.peak_rss_mb for o in ours):.0f}",
                    f"{statistics.median(t.seconds for t in theirs):.2f}",
                    f"{statistics.median(t.peak_rss_mb for t in theirs):.0f}",
                    f"{speed:.2f}x",
                    f"1/{1 / memory:.0f}",
                    f"1/{1 / above:.0f}",
                    common.verdict(fast and lean),
                ]
            )
        common.remove(root)
    header = [
        "N x MiB",
        "method",
        "shardfuse s",
        "shardfuse peak MiB",
        "mergekit s",
        "mergekit peak MiB",
        "speed-up",
        "memory",
        "memory above each import floor",
        "targets",
    ]
    note = (
        f"Import floors (peak RSS of a process that imports the merge and exits): shardfuse "
        f"{floors['shardfuse']:.0f} MiB, mergekit {floors['mergekit']:.0f} MiB."
    )
    return common.table(header, rows) + "\n\n" + note, checks


# ---------------------------------------------------------------- training against a bare loop

TRAIN_MODELS = {
    "mlp": {
        "dataset": {
            "source": "synthetic",
            "num_rows": 40_000,
            "num_features": 32,
            "num_classes": 10,
            "seed": 0,
        },
        "run": {"hidden_sizes": [128, 128], "batch_size": 32, "epochs": 1},
    },
    "cnn": {
        "dataset": {"source": "digits_images"},
        "run": {"model": "cnn", "model_args": {"channels": [16, 32]}, "batch_size": 32, "epochs": 20},
    },
    "transformer": {
        "dataset": {
            "source": "text",
            "paths": ["{stdlib}/*.py"],
            "block_size": 64,
            "max_tokens": 400_000,
        },
        "run": {
            "model": "transformer",
            "model_args": {"width": 128, "layers": 2, "heads": 4},
            "batch_size": 16,
            "epochs": 1,
        },
    },
}
TRAIN_TARGET = 0.95  # of the bare loop's steps/s, for the cnn and the transformer
COMMON_RUN = {
    "strategy": "ddp",
    "sync_every": 0,
    "optimizer": "adamw",
    "lr": 0.001,
    "momentum": 0.9,
    "weight_decay": 0.0,
    "seed": 0,
    "checkpoint_every": 0,
    "activation": "relu",
    "dropout": 0.0,
    "hidden_sizes": [64],
}


def prepare(work: Path, name: str, spec: dict, quick: bool) -> tuple[Path, Path]:
    spec = dict(spec)
    if quick and spec["source"] == "synthetic":
        spec["num_rows"] = 4_000
    if quick and spec["source"] == "text":
        spec["max_tokens"] = 40_000
    dataset, shards = work / name, work / f"{name}-shards"
    for stage, *args in (
        ("prepare", "--name", name, "--spec-json", json.dumps(spec), "--out-dir", dataset),
        (
            "partition",
            "--input",
            dataset / "train.parquet",
            "--world-size",
            2,
            "--seed",
            0,
            "--out-dir",
            shards,
        ),
    ):
        subprocess.run(
            list(map(str, common.python_cmd("-m", f"shardfuse.{stage}", *args))),
            check=True,
            env=common.child_env(),
            capture_output=True,
        )
    return dataset, shards


def train_ours(work: Path, dataset: Path, shards: Path, cfg: dict) -> dict:
    out = work / "ours"
    shutil.rmtree(out, ignore_errors=True)
    subprocess.run(
        list(
            map(
                str,
                common.python_cmd(
                    "-m",
                    "shardfuse.launch",
                    "--nproc-per-node",
                    2,
                    "--out-dir",
                    out,
                    "--",
                    "--run-name",
                    "peer",
                    "--shard-dir",
                    shards,
                    "--dataset-dir",
                    dataset,
                    "--config-json",
                    json.dumps(cfg),
                ),
            )
        ),
        check=True,
        env=common.child_env(SHARDFUSE_SYSTEM_METRICS_INTERVAL="0"),
        capture_output=True,
    )
    train = json.loads((out / "train.json").read_text())
    return {
        "seconds": train["train_seconds"],
        "framework_seconds": train["framework_seconds"],
        "steps": train["num_steps"],
        "model": train["model"],
    }


def train_bare(work: Path, shards: Path, cfg: dict, spec: dict, steps: int) -> dict:
    out = work / "bare.json"
    subprocess.run(
        [
            common.PYTHON,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node=2",
            str(Path(__file__).with_name("bare_loop.py")),
            "--shards",
            str(shards),
            "--spec-json",
            json.dumps(spec),
            "--config-json",
            json.dumps(cfg),
            "--steps",
            str(steps),
            "--out",
            str(out),
        ],
        check=True,
        env=common.child_env(),
        capture_output=True,
    )
    return json.loads(out.read_text())


def bench_train(work: Path, quick: bool, reps: int) -> tuple[str, list[tuple]]:
    rows, checks = [], []
    for name, setup in TRAIN_MODELS.items():
        dataset, shards = prepare(work, name, setup["dataset"], quick)
        cfg = {**COMMON_RUN, **setup["run"]}
        if quick:
            cfg["epochs"] = 1
        ratios, ours_s, bare_s, again_s, framework_s = [], [], [], [], []
        ours = train_ours(work, dataset, shards, cfg)  # the model and step count the bare loop follows
        model, steps = ours["model"], ours["steps"]
        for rep in range(reps):  # paired, in alternating order (neither side always runs first)
            if rep % 2:
                bare = train_bare(work, shards, cfg, model, steps)
                ours = train_ours(work, dataset, shards, cfg)
            elif rep:
                ours = train_ours(work, dataset, shards, cfg)
                bare = train_bare(work, shards, cfg, model, steps)
            else:
                bare = train_bare(work, shards, cfg, model, steps)
            # The bare loop once more: how far two runs of the very same loop differ here (A/A); not in
            # --quick, whose figures mean nothing anyway (a third of its training time).
            if not quick:
                again_s.append(train_bare(work, shards, cfg, model, steps)["seconds"])
            ours_s.append(ours["seconds"])
            framework_s.append(ours["framework_seconds"])
            bare_s.append(bare["seconds"])
            ratios.append(bare["seconds"] / ours["seconds"])
        # Noise on a shared machine only ever adds time: each side's best repetition is its speed, and
        # the target is checked on their ratio; the median of the paired ratios is reported beside it.
        best = min(bare_s) / min(ours_s)
        same_loop = min(bare_s) / min(again_s) if again_s else float("nan")
        # Measured inside the train stage's loop: the time outside the step's own work (forward, backward,
        # the optimiser's step, the strategy's sync), the slowest rank's, median over the repetitions.
        framework = statistics.median(framework_s)
        share = statistics.median(f / o for f, o in zip(framework_s, ours_s, strict=True))
        holds = best >= TRAIN_TARGET if name != "mlp" else None
        checks.append(
            (
                f"training vs a bare torchrun loop, {name}: >= {TRAIN_TARGET} of its steps/s (best of {reps})"
                if name != "mlp"
                else "training vs a bare torchrun loop, mlp (reported)",
                f"{best:.3f} (framework code {100 * share:.1f} % of the loop; bare vs bare {same_loop:.3f})",
                holds,
            )
        )
        rows.append(
            [
                name,
                steps,
                f"{steps / min(ours_s):.0f}",
                f"{steps / min(bare_s):.0f}",
                f"{best:.3f}",
                f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f})",
                f"{1e6 * (min(ours_s) - min(bare_s)) / steps:.0f}",
                f"{1e6 * framework / steps:.0f} ({100 * share:.1f} %)",
                f"{same_loop:.3f}",
                "reported" if holds is None else common.verdict(holds),
            ]
        )
    header = [
        "model",
        "steps",
        "shardfuse steps/s (best)",
        "bare loop steps/s (best)",
        "ratio of the bests",
        "paired ratios: median (range)",
        "framework µs per step (bests)",
        "framework µs per step in the loop (share)",
        "bare vs bare (best of each)",
        "target",
    ]
    return common.table(header, rows), checks


def merge_sizes(text: str) -> list[tuple[int, int]]:
    """'4x1024,2x100' -> [(4, 1024), (2, 100)]."""
    try:
        return [tuple(int(part) for part in item.split("x", 1)) for item in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes as NxMiB, e.g. 4x1024,2x100") from None


def merge_methods(text: str) -> list[str]:
    methods = text.split(",")
    unknown = [m for m in methods if m not in MERGEKIT_METHODS]
    if unknown:
        raise argparse.ArgumentTypeError(f"{unknown[0]!r}: choose from {', '.join(MERGEKIT_METHODS)}")
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny sizes, once (CI smoke)")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--only", choices=["merge", "train"])
    parser.add_argument(
        "--sizes", type=merge_sizes, help="merge sizes as NxMiB, comma-separated (default: all; e.g. 4x1024)"
    )
    parser.add_argument("--methods", type=merge_methods, help="merge methods, comma-separated (uniform,ties)")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    reps = 1 if args.quick else args.reps
    work = Path(tempfile.mkdtemp(prefix="shardfuse-bench-peers-", dir=args.work_dir))
    checks: list[tuple] = []
    try:
        if args.only in (None, "merge"):
            sizes = args.sizes or (MERGE_QUICK if args.quick else MERGE_SIZES)
            table, found = bench_merge(work, sizes, reps, args.methods)
            print("## merge vs mergekit-pytorch\n\n" + table + "\n", flush=True)
            checks += found
        if args.only in (None, "train"):
            table, found = bench_train(work, args.quick, reps)
            print("## training vs a bare torchrun loop\n\n" + table + "\n", flush=True)
            checks += found
    finally:
        common.remove(work)
    print(
        common.table(
            ["target", "measured", "verdict"],
            [[n, v, "reported" if ok is None else common.verdict(ok)] for n, v, ok in checks],
        )
    )
    failed = any(ok is False for _, _, ok in checks)
    raise SystemExit(1 if args.strict and failed else 0)


if __name__ == "__main__":
    main()
