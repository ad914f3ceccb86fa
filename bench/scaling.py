"""Benchmark 3: training throughput of the default MLP at world size 1 and 2, beside this machine's ceiling.

    python bench/scaling.py                        # 60k synthetic rows x 32 features, 2 epochs
    python bench/scaling.py --rows 4000 --epochs 1 --reps 1    # smoke size

Each run is ``python -m shardfuse.launch`` (torchrun, gloo) with the run defaults of the config schema
(hidden [64], SGD, batch 32, checkpoints every 100 steps) and OMP_NUM_THREADS=1: one thread per rank,
as torchrun sets for several ranks (set here for W=1 too, so both sizes compare like with like).
samples/s = rows of all shards x epochs / train_seconds (train.json: the slowest rank's training loop,
timed from a barrier that starts every rank's loop together, without process start). Efficiency =
samples/s at W=2 / (2 x samples/s at W=1), paired per repetition.
Three variants: ddp, localsgd averaging every 8 steps (the config's localsgd run) and localsgd with
``sync_every`` 0 (no collective in the loop: the ranks only meet at checkpoints), which is always
measured since the target is set on it.

The machine's ceiling is the same kind of work with nothing of shardfuse and no distributed: plain
torch trains the same MLP on batches already in memory (one thread, OMP_NUM_THREADS=1), as one process
and as two independent processes released at the same moment (``common.run_together``), each for the
W=1 run's number of steps. Ceiling = throughput of two / (2 x throughput of one), throughput counted
like the runs' (the slower process's loop time). A 2-core VM whose cores are SMT siblings on the host,
or whose host is busy, shows it here. Target: localsgd without sync reaches >= 0.9 of the ceiling.

The floor of communication, also plain torch: two gloo processes (``common.run_together``) time
localsgd's sync (an all_reduce per parameter tensor) and ddp's (every gradient in one bucket), so the
runs' extra milliseconds per step at W=2 (second table) can be read against what gloo itself costs here.
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

# variant -> (strategy, sync_every); "localsgd" is the config's localsgd run (averages every 8 steps)
STRATEGIES = {"ddp": ("ddp", 0), "localsgd": ("localsgd", 8), "localsgd-nosync": ("localsgd", 0)}
LABELS = {"ddp": "ddp", "localsgd": "localsgd, sync every 8", "localsgd-nosync": "localsgd, no sync"}
NO_SYNC = "localsgd-nosync"
WORLD_SIZES = (1, 2)
TARGET_OF_CEILING = 0.9
NUM_CLASSES = 10  # common.synthetic_spec's

# One process of the machine's references: plain torch, the run defaults' model. "train": the ceiling's
# work (SGD steps on batches already in memory, a pool cycled as a cached epoch reads them, the loss
# read back every step as the training loop does). "allreduce": one of two gloo ranks running
# localsgd's sync (one all_reduce per parameter tensor) and DDP's (one flat bucket). Prints READY
# after a warm-up, works when released, prints its seconds as JSON.
WORKER = """
import json, sys, time
import torch
import torch.nn.functional as F
mode, steps, features, cfg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4])
torch.manual_seed(0)
widths = [features, *cfg["hidden_sizes"], cfg["num_classes"]]
layers = []
for width, out in zip(widths[:-1], widths[1:]):
    layers += [torch.nn.Linear(width, out), torch.nn.ReLU()]
net = torch.nn.Sequential(*layers[:-1])
if mode == "train":
    optimizer = torch.optim.SGD(net.parameters(), lr=cfg["lr"], momentum=cfg["momentum"])
    inputs = torch.randn(64, cfg["batch_size"], features)
    targets = torch.randint(0, cfg["num_classes"], (64, cfg["batch_size"]))
    def work(num_steps):
        started = time.perf_counter()
        for step in range(num_steps):
            optimizer.zero_grad(set_to_none=True)
            loss = F.cross_entropy(net(inputs[step % 64]), targets[step % 64])
            loss.item()
            loss.backward()
            optimizer.step()
        return {"seconds": time.perf_counter() - started}
else:
    import torch.distributed as dist
    rank, port = int(sys.argv[5]), int(sys.argv[6])
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    params = [param.detach() for param in net.parameters()]
    flat = torch.cat([param.flatten() for param in params])
    def work(num_steps):
        dist.barrier()
        started = time.perf_counter()
        for _ in range(num_steps):
            for param in params:
                dist.all_reduce(param)
        middle = time.perf_counter()
        for _ in range(num_steps):
            dist.all_reduce(flat)
        ended = time.perf_counter()
        return {"per_tensor": (middle - started) / num_steps, "flat": (ended - middle) / num_steps}
work(200)
print("ready", flush=True)
sys.stdin.readline()
print(json.dumps(work(steps)))
if mode != "train":
    dist.destroy_process_group()  # gloo's threads abort the exit otherwise
"""


def train_config(strategy: str, epochs: int) -> dict:
    """The run defaults of the config schema for a variant of STRATEGIES, as the train rule would
    pass them."""
    from shardfuse.experiment.keys import TRAIN_KEYS
    from shardfuse.experiment.load import load_experiment

    name, sync_every = STRATEGIES[strategy]
    experiment = load_experiment(
        {
            "runs": {"bench": {"strategy": name, "sync_every": sync_every, "epochs": epochs}},
            "datasets": {
                "bench": {"source": "synthetic", "num_rows": 10, "num_features": 1, "num_classes": 2}
            },
            "run_defaults": {"dataset": "bench", "world_size": 1, "merge_method": "uniform"},
        }
    )
    run = experiment.runs["bench"]
    return {key: run[key] for key in TRAIN_KEYS if key in run}


def train_seconds(strategy: str, world_size: int, shard_dir: Path, dataset: Path, epochs: int, out: Path):
    """One launch of the train stage: (samples trained, train_seconds, launch wall seconds)."""
    measured = common.measure(
        common.python_cmd(
            "-m", "shardfuse.launch", "--nproc-per-node", world_size, "--out-dir", out, "--",
            "--run-name", f"{strategy}-w{world_size}", "--shard-dir", shard_dir, "--dataset-dir", dataset,
            "--config-json", json.dumps(train_config(strategy, epochs)),
        ),
        env=common.child_env(OMP_NUM_THREADS="1"),
    )  # fmt: skip
    info = json.loads((out / "train.json").read_text())
    samples = sum(rank["rows"] for rank in info["ranks"]) * info["epochs"]
    common.remove(out)
    return samples, info["train_seconds"], measured.seconds


def ceiling_seconds(num_procs: int, steps: int, features: int, cfg: dict) -> float:
    """``num_procs`` independent plain-torch processes released together, ``steps`` steps each: the
    slowest one's loop seconds."""
    cmd = common.python_cmd("-c", WORKER, "train", steps, features, _worker_cfg(cfg))
    outputs = common.run_together([cmd] * num_procs, env=common.child_env(OMP_NUM_THREADS="1"))
    return max(json.loads(output)["seconds"] for output in outputs)


def allreduce_seconds(features: int, cfg: dict, num_syncs: int = 300) -> tuple[float, float]:
    """Two plain-torch gloo ranks: seconds of one localsgd sync (an all_reduce per parameter tensor)
    and of one all_reduce of every parameter flattened (DDP's single bucket for a model this small)."""
    with socket.socket() as probe:  # a free port for the rendezvous
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    cmds = [
        common.python_cmd("-c", WORKER, "allreduce", num_syncs, features, _worker_cfg(cfg), rank, port)
        for rank in range(2)
    ]
    outputs = [
        json.loads(output) for output in common.run_together(cmds, env=common.child_env(OMP_NUM_THREADS="1"))
    ]
    return max(o["per_tensor"] for o in outputs), max(o["flat"] for o in outputs)


def _worker_cfg(cfg: dict) -> str:
    return json.dumps({**cfg, "num_classes": NUM_CLASSES})


def run(
    rows: int, features: int, epochs: int, reps: int, work_dir: Path, strategies: list[str] | None = None
) -> dict:
    strategies = [s for s in STRATEGIES if s in (strategies or STRATEGIES) or s == NO_SYNC]
    work_dir.mkdir(parents=True, exist_ok=True)
    dataset = work_dir / "dataset"
    common.make_dataset(dataset, rows, features, test_fraction=0.2)
    shard_dirs = {w: common.make_shards(dataset, w, work_dir / f"shards-w{w}") for w in WORLD_SIZES}
    cfg = train_config(NO_SYNC, epochs)
    train_rows = json.loads((shard_dirs[1] / "manifest.json").read_text())["total_rows"]
    ceiling_steps = max(1, -(-train_rows // cfg["batch_size"])) * epochs  # the W=1 run's steps
    throughput: dict[tuple[str, int], list[float]] = {}
    wall: dict[tuple[str, int], list[float]] = {}
    syncs: dict[str, list[float]] = {"per_tensor": [], "flat": []}
    loads = [common.load_average()]
    for _ in range(reps):
        for world_size in WORLD_SIZES:
            seconds = ceiling_seconds(world_size, ceiling_steps, features, cfg)
            samples = world_size * ceiling_steps * cfg["batch_size"]
            throughput.setdefault(("ceiling", world_size), []).append(samples / seconds)
        per_tensor, flat = allreduce_seconds(features, cfg)
        syncs["per_tensor"].append(per_tensor)
        syncs["flat"].append(flat)
        for strategy in strategies:
            for world_size in WORLD_SIZES:
                out = work_dir / f"run-{strategy}-w{world_size}"
                samples, seconds, launch_seconds = train_seconds(
                    strategy, world_size, shard_dirs[world_size], dataset, epochs, out
                )
                throughput.setdefault((strategy, world_size), []).append(samples / seconds)
                wall.setdefault((strategy, world_size), []).append(launch_seconds)
        loads.append(common.load_average())

    def speedups(name: str) -> list[float]:
        """W=2 throughput / W=1 throughput, per repetition."""
        return [b / a for a, b in zip(throughput[(name, 1)], throughput[(name, 2)], strict=True)]

    def row(label: str, name: str, of_ceiling: str, launch: str) -> list[object]:
        one, two, speedup = throughput[(name, 1)], throughput[(name, 2)], common.median(speedups(name))
        efficiency = common.median([x / 2 for x in speedups(name)])
        return [
            label,
            common.median(one),
            common.median(two),
            f"{speedup:.2f}x",
            f"{efficiency:.2f}",
            of_ceiling,
            launch,
        ]

    ceilings = [x / 2 for x in speedups("ceiling")]
    ceiling = common.median(ceilings)
    rows_out = [row("machine ceiling: plain torch, 1 vs 2 independent processes", "ceiling", "1.00", "-")]
    checks = [("machine ceiling: efficiency of 2 independent processes (reported)", f"{ceiling:.2f}", None)]
    results: dict[str, dict] = {"ceiling": {**_series(throughput, "ceiling"), "efficiency": ceiling}}
    for strategy in strategies:
        per_rep = [x / 2 for x in speedups(strategy)]
        efficiency = common.median(per_rep)
        of_ceiling = common.median([e / c for e, c in zip(per_rep, ceilings, strict=True)])
        results[strategy] = {
            **_series(throughput, strategy),
            "efficiency": efficiency,
            "of_ceiling": of_ceiling,
        }
        launch = f"{common.median(wall[(strategy, 1)]):.1f} / {common.median(wall[(strategy, 2)]):.1f}"
        rows_out.append(row(LABELS[strategy], strategy, f"{of_ceiling:.2f}", launch))
        checks.append(
            (
                f"{LABELS[strategy]}: efficiency at W=2 (reported)",
                f"{efficiency:.2f} ({of_ceiling:.2f} of the ceiling)",
                None,
            )
        )
    no_sync = results[NO_SYNC]["of_ceiling"]
    checks.append(
        (
            f"localsgd (no sync) efficiency / machine ceiling >= {TARGET_OF_CEILING}",
            f"{results[NO_SYNC]['efficiency']:.2f} / {ceiling:.2f} = {no_sync:.2f}",
            no_sync >= TARGET_OF_CEILING,
        )
    )
    markdown = common.table(
        [
            "work",
            "samples/s W=1",
            "samples/s W=2",
            "speed-up",
            "efficiency",
            "efficiency / ceiling",
            "launch wall s W=1 / W=2",
        ],
        rows_out,
    )
    step_ms = [["machine ceiling", *_step_ms(throughput, "ceiling", cfg["batch_size"])]]
    step_ms += [
        [LABELS[strategy], *_step_ms(throughput, strategy, cfg["batch_size"])] for strategy in strategies
    ]
    markdown += "\n\n" + common.table(["ms per step of a rank", "W=1", "W=2", "W=2 - W=1"], step_ms)
    per_tensor_ms, flat_ms = 1000 * common.median(syncs["per_tensor"]), 1000 * common.median(syncs["flat"])
    checks.append(
        (
            "gloo all_reduce of the model between 2 plain-torch processes (reported)",
            f"{per_tensor_ms:.2f} ms per localsgd sync (a call per tensor), "
            f"{flat_ms:.2f} ms per ddp step (one bucket)",
            None,
        )
    )
    markdown += (
        "\n\nCollectives on this machine, plain torch (2 gloo processes, no shardfuse): localsgd's sync "
        f"(an all_reduce per parameter tensor, {len(cfg['hidden_sizes']) * 2 + 2} tensors) takes "
        f"{per_tensor_ms:.2f} ms, every 8 steps in the config's localsgd run; ddp's all_reduce of every "
        f"gradient in one bucket takes {flat_ms:.2f} ms, every step. W=2 - W=1 above, less the ceiling's, "
        "is what a step's communication costs in the runs."
    )
    markdown += (
        f"\n\nDataset: synthetic, {train_rows:,} train rows x {features} features, {epochs} epochs, "
        "batch 32, "
        "default MLP [64] (run defaults, checkpoints every 100 steps), gloo, 1 thread per rank. "
        f"The ceiling's processes train the same MLP in plain torch, {ceiling_steps:,} steps each (the "
        "W=1 run's), on batches already in memory. "
        f"Median of {reps} repetitions; ratios (efficiency / ceiling too) paired per repetition. Launch "
        "wall time includes torchrun start, imports and writing outputs. "
        f"1-minute load average at the start and after each repetition: {', '.join(loads)}."
    )
    return {"title": "3. Scaling on this machine", "markdown": markdown, "checks": checks, "results": results}


def _step_ms(throughput: dict[tuple[str, int], list[float]], name: str, batch_size: int) -> list[float]:
    """Median milliseconds per step of one rank at W=1 and W=2 (each rank trains batch_size rows a step)
    and their difference."""
    one, two = (1000 * batch_size * w / common.median(throughput[(name, w)]) for w in WORLD_SIZES)
    return [one, two, two - one]


def _series(throughput: dict[tuple[str, int], list[float]], name: str) -> dict[str, list[float]]:
    return {"w1": throughput[(name, 1)], "w2": throughput[(name, 2)]}


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
    for name, value, ok in section["checks"]:
        print(f"{name}: {value}" + ("" if ok is None else f" {common.verdict(ok)}"))
    sys.exit(1 if any(ok is False for _, _, ok in section["checks"]) else 0)


if __name__ == "__main__":
    main()
