"""Benchmark 5: what metric logging costs a training step (target: the time inside the logging calls
< 1% of any step of 1 ms or more; the system metrics sampler < 0.5%).

    python bench/logging_overhead.py                      # 240k rows, 2 epochs (~15k steps a run)
    python bench/logging_overhead.py --rows 4000 --reps 1 # smoke size

The real training loop (``shardfuse.train.train_rank``, run defaults: MLP [64], SGD, batch 32,
checkpoints every 100 steps) runs in this process as a one-rank gloo group, one torch thread, in five
modes, interleaved per repetition in a rotating order so drift of a shared machine hits all alike:

- ``off``: ``step_metrics=False`` (``--no-step-metrics``): no per-step metrics, progress, live points or
  system metrics;
- ``metrics``: one metrics row per step on disk (append-only, flushed every 2 s and at every
  checkpoint) and the rank-0 progress reporter, with the system metrics sampler off;
- ``metrics + live``: also ``tracking.live``: rank 0 streams points to MLflow (a SQLite store here) from
  a background thread. The store exists before the timed runs: its one-off creation is not a step cost;
- ``metrics + system 5 s`` (the default of a training: ``shardfuse.metrics.system`` samples CPU, memory and
  GPU from a daemon thread at start, every 5 s and at stop) and ``metrics + system 0.1 s`` (a stress
  setting, 50 times the rate, to see what one sample costs): compared with ``metrics``, their only
  difference. The sampler thread's own CPU time inside its samples is accounted too (a share of the
  loop's time, all samples counted, the start and stop ones included), and from the stress setting's
  CPU per sample the share at 5 s is projected for a run of any length.

steps/s = num_steps / train_seconds from train.json (the training loop alone: no process start, no shard
load). Cost = 1 - (best steps/s with logging / best steps/s off) over the repetitions (best of N, as
timeit takes it: interference only ever slows a run down; reported, not a target: it moves by several
percent from run to run here); the median of the per-repetition ratios is shown too. Running in one
process is what makes a sub-1% difference measurable at all (no process start-up, no second copy of torch
competing for the two cores), but a shared 2-core machine still moves single runs by several percent, so
the time spent inside the logging calls is also accounted directly (each call timed in the first
repetition, plus the live logger thread's CPU: while it runs Python it holds the GIL) as a share of the
loop's time: the steadiest figure, and the target's: those calls cost the same per step whatever the
model, so their microseconds per step against a 1 ms step bound their share of every step of 1 ms or more
(this MLP's step is shorter: its share is reported beside).
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import os
import sys
import time
from collections.abc import Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

TARGET_PERCENT = 1.0
FLOOR_STEP_MS = 1.0  # the logging target holds for steps of at least this long (issue 33)
SYSTEM_TARGET_PERCENT = 0.5
PRODUCTION_INTERVAL_S = 5.0
# Seconds between system metric samples per mode (0: the sampler is off).
SAMPLE_INTERVAL_S = {
    "off": 0.0,
    "metrics": 0.0,
    "metrics + live": 0.0,
    "metrics + system 5 s": PRODUCTION_INTERVAL_S,
    "metrics + system 0.1 s": 0.1,
}
MODES = tuple(SAMPLE_INTERVAL_S)
LOGGING_MODES = ("off", "metrics", "metrics + live")
SYSTEM_MODES = ("metrics + system 5 s", "metrics + system 0.1 s")


def train_config(epochs: int) -> dict:
    """The run defaults of the config schema for a one-rank ddp run (as the train rule passes them)."""
    from shardfuse.experiment.keys import TRAIN_KEYS
    from shardfuse.experiment.load import load_experiment

    experiment = load_experiment(
        {
            "runs": {"bench": {"strategy": "ddp", "epochs": epochs}},
            "datasets": {
                "bench": {"source": "synthetic", "num_rows": 10, "num_features": 1, "num_classes": 2}
            },
            "run_defaults": {"dataset": "bench", "world_size": 1, "merge_method": "consolidate"},
        }
    )
    run = experiment.runs["bench"]
    return {key: run[key] for key in TRAIN_KEYS if key in run}


def prepare_data(work_dir: Path, rows: int, features: int) -> tuple[Path, Path]:
    dataset = work_dir / "dataset"
    common.make_dataset(dataset, rows, features)
    return dataset, common.make_shards(dataset, 1, work_dir / "shards")


def _timer(method, spent: list[float]):
    """``method`` wrapped to add its seconds to ``spent[0]`` and count its calls in ``spent[1]``."""

    @functools.wraps(method)
    def wrapper(*args, **kwargs):
        started = time.perf_counter()
        try:
            return method(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started
            spent[1] += 1

    return wrapper


def _timer_cost(calls: int = 200_000) -> float:
    """Seconds a timed call adds by itself (measured on a no-op), to subtract per call."""
    spent = [0.0, 0]
    noop = _timer(lambda: None, spent)
    for _ in range(calls):
        noop()
    bare = time.perf_counter()
    for _ in range(calls):
        (lambda: None)()
    # What the timer recorded for a call that does nothing, less what calling nothing costs.
    return max(0.0, (spent[0] - (time.perf_counter() - bare)) / calls)


@contextlib.contextmanager
def timed_logging_calls() -> Iterator[list[float]]:
    """Accumulate the seconds spent inside every per-step logging call while the block runs
    (``[seconds, calls]``)."""
    from shardfuse.metrics.steps import MetricsLog
    from shardfuse.rank.progress import Progress
    from shardfuse.track.live import LiveLogger

    spent = [0.0, 0]
    targets = [(MetricsLog, "append"), (MetricsLog, "flush"), (Progress, "update"), (LiveLogger, "log")]
    originals = [getattr(cls, name) for cls, name in targets]
    for (cls, name), method in zip(targets, originals, strict=True):
        setattr(cls, name, _timer(method, spent))
    try:
        yield spent
    finally:
        for (cls, name), method in zip(targets, originals, strict=True):
            setattr(cls, name, method)


@contextlib.contextmanager
def system_sampling(interval_s: float) -> Iterator[list]:
    """Training in the block samples system metrics every ``interval_s`` s (0: off, through the
    environment variable train_rank's sampler reads); yields the samplers started, for their CPU time."""
    from shardfuse.metrics.system import INTERVAL_ENV, SystemSampler

    started: list[SystemSampler] = []
    original_start, previous = SystemSampler.start, os.environ.get(INTERVAL_ENV)

    def start(self):
        started.append(self)
        return original_start(self)

    SystemSampler.start = start
    os.environ[INTERVAL_ENV] = f"{interval_s:g}"
    try:
        yield started
    finally:
        SystemSampler.start = original_start
        if previous is None:
            os.environ.pop(INTERVAL_ENV, None)
        else:
            os.environ[INTERVAL_ENV] = previous


def run(work_dir: Path, rows: int, features: int, epochs: int, reps: int) -> dict:
    import torch
    import torch.distributed as torch_dist

    from shardfuse.experiment.run_config import TrainConfig
    from shardfuse.rank.dist import DistContext
    from shardfuse.track.client import connect
    from shardfuse.track.live import LiveLogger
    from shardfuse.train import train_rank

    work_dir.mkdir(parents=True, exist_ok=True)
    dataset, shards = prepare_data(work_dir, rows, features)
    typed = TrainConfig.from_flat(train_config(epochs))
    uri = f"sqlite:///{work_dir / 'mlflow.db'}"
    connect(uri, "bench-logging")  # the store and experiment exist before any timed run
    torch.set_num_threads(1)
    timer_cost = _timer_cost()
    torch_dist.init_process_group("gloo", store=torch_dist.HashStore(), rank=0, world_size=1)
    ctx = DistContext(0, 1, 0, torch.device("cpu"), "gloo")
    steps_per_second: dict[str, list[float]] = {mode: [] for mode in MODES}
    accounted: dict[str, float] = {}
    per_step_us: dict[str, float] = {}  # time inside the logging calls per step
    step_us: dict[str, float] = {}  # the step itself
    live_start: dict[str, float] = {}
    live_points = []
    # Per system-metrics mode and repetition: (samples, sampler CPU seconds, loop seconds).
    sampling: dict[str, list[tuple[int, float, float]]] = {mode: [] for mode in SYSTEM_MODES}
    try:
        for rep in range(reps):
            for mode in MODES[rep % len(MODES) :] + MODES[: rep % len(MODES)]:
                out = work_dir / "train"
                live = LiveLogger(uri, "bench-logging", f"live-{rep}", enabled=mode == "metrics + live")
                timing = timed_logging_calls() if rep == 0 else contextlib.nullcontext([0.0, 0])
                with timing as spent, live, system_sampling(SAMPLE_INTERVAL_S[mode]) as samplers:
                    train_rank(ctx, "bench", shards, dataset, typed, out, live, step_metrics=mode != "off")
                info = json.loads((out / "train.json").read_text())
                steps_per_second[mode].append(info["num_steps"] / info["train_seconds"])
                if mode in SYSTEM_MODES:
                    sampling[mode].append(
                        (
                            sum(s.num_samples for s in samplers),
                            sum(s.cpu_seconds for s in samplers),
                            info["train_seconds"],
                        )
                    )
                if rep == 0:  # one timed repetition: the timers cost a little themselves
                    # The live thread's CPU after its one-off start (client, store, run: reported apart).
                    steady = live.cpu_seconds - live.start_cpu_seconds
                    inside = max(0.0, spent[0] - spent[1] * timer_cost)  # the timers' own cost left out
                    accounted[mode] = 100 * (inside + steady) / info["train_seconds"]
                    per_step_us[mode] = 1e6 * (inside + steady) / info["num_steps"]
                    step_us[mode] = 1e6 * info["train_seconds"] / info["num_steps"]
                    live_start[mode] = live.start_cpu_seconds
                if live.enabled:
                    live_points.append(live.num_logged)
                common.remove(out)
    finally:
        torch_dist.destroy_process_group()

    off = steps_per_second["off"]
    rows_out, checks = [], []
    for mode in LOGGING_MODES:
        paired = common.median(
            [100 * (1 - on / base) for on, base in zip(steps_per_second[mode], off, strict=True)]
        )
        # Best of the repetitions, as timeit takes: interference from other processes only ever slows a
        # run down, so the fastest run of each mode is the closest to its own cost.
        overhead = 100 * (1 - max(steps_per_second[mode]) / max(off))
        rows_out.append(
            [
                mode,
                max(steps_per_second[mode]),
                common.median(steps_per_second[mode]),
                "-" if mode == "off" else f"{overhead:+.2f}%",
                "-" if mode == "off" else f"{paired:+.2f}%",
                "-" if mode == "off" else f"{accounted[mode]:.2f}%",
            ]
        )
        if mode != "off":
            # Reported: run-to-run noise on a shared machine moves the A/B figure by several percent.
            checks.append((f"{mode}: steps/s cost vs off (A/B, best of reps)", f"{overhead:+.2f}%", None))
            # The logging calls cost the same per step whatever the model: against a 1 ms step (so
            # against every step of 1 ms or more) their time must stay under 1%; this MLP's own step is
            # shorter, and its share is reported beside.
            share_1ms = 100 * per_step_us[mode] / (1000 * FLOOR_STEP_MS)  # percent
            checks.append(
                (
                    f"{mode}: time inside the logging calls < {TARGET_PERCENT:g}% of any step >= "
                    f"{FLOOR_STEP_MS:g} ms",
                    f"{per_step_us[mode]:.2f} µs per step: {share_1ms:.2f}% of {FLOOR_STEP_MS:g} ms "
                    f"({accounted[mode]:.2f}% of this MLP's {step_us[mode]:.0f} µs step)",
                    share_1ms < TARGET_PERCENT,
                )
            )
    num_steps = info["num_steps"]
    markdown = common.table(
        [
            "logging",
            "steps/s (best)",
            "steps/s (median)",
            "cost vs off (best of reps)",
            "cost vs off (median of paired reps)",
            "time inside logging calls",
        ],
        rows_out,
    )
    markdown += (
        f"\n\n{num_steps:,} steps a run ({rows:,} synthetic rows x {features} features, {epochs} epochs, "
        f"batch 32, MLP [64], checkpoints every 100 steps), one rank, one thread, {reps} repetitions in "
        f"rotating order; the system metrics sampler off in these three (its cost: the next table). "
        f"Live logging pushed {common.median(live_points) if live_points else 0:,.0f} "
        f"points a run (rate-limited to 2 rows/s); its thread's one-off start (MLflow client, store, run) "
        f"took {live_start.get('metrics + live', 0.0):.2f} s of CPU, left out of the accounted share (a "
        "run of minutes spreads it to nothing). The A/B figure moves by a few percent from run to run on "
        "a shared machine (a negative cost is such noise); the time inside the logging calls (the "
        f"timers' own cost, {1e9 * timer_cost:.0f} ns a call, subtracted) is the steadier figure."
    )
    system_markdown, system_checks = system_metrics_report(steps_per_second, sampling)
    return {
        "title": "5. Metric logging during training",
        "markdown": markdown + "\n\n" + system_markdown,
        "checks": checks + system_checks,
    }


def system_metrics_report(
    steps_per_second: dict[str, list[float]], sampling: dict[str, list[tuple[int, float, float]]]
) -> tuple[str, list]:
    """The sampler's cost against the same training with step metrics alone: the A/B figures, and the
    sampler thread's CPU time inside its samples (its GIL time: while it runs Python the loop waits)."""
    base = steps_per_second["metrics"]
    rows_out, checks, per_sample = [], [], {}
    for mode in SYSTEM_MODES:
        paired = common.median(
            [100 * (1 - on / plain) for on, plain in zip(steps_per_second[mode], base, strict=True)]
        )
        overhead = 100 * (1 - max(steps_per_second[mode]) / max(base))
        samples = sum(n for n, _, _ in sampling[mode])
        per_sample[mode] = sum(cpu for _, cpu, _ in sampling[mode]) / max(samples, 1)
        share = common.median([100 * cpu / loop for _, cpu, loop in sampling[mode]])
        rows_out.append(
            [
                mode,
                max(steps_per_second[mode]),
                f"{overhead:+.2f}%",
                f"{paired:+.2f}%",
                f"{samples / len(sampling[mode]):.1f}",
                f"{1e6 * per_sample[mode]:.0f}",
                f"{share:.3f}%",
            ]
        )
        checks.append(
            (
                f"{mode}: sampler thread's time inside samples < {SYSTEM_TARGET_PERCENT:g}% of the loop",
                f"{share:.3f}%",
                share < SYSTEM_TARGET_PERCENT if mode == SYSTEM_MODES[0] else None,
            )
        )
        checks.append(
            (
                f"{mode}: steps/s cost vs metrics alone (A/B, median of paired reps)",
                f"{paired:+.2f}%",
                None,
            )
        )
    # What a sample costs, taken from the stress setting (most samples), at the production rate: the
    # share a run of any length pays, however few samples a short benchmark run takes.
    projected = 100 * per_sample[SYSTEM_MODES[1]] / PRODUCTION_INTERVAL_S
    checks.append(
        (
            f"system metrics every {PRODUCTION_INTERVAL_S:g} s: CPU per sample (from the 0.1 s setting) / "
            f"interval < {SYSTEM_TARGET_PERCENT:g}%",
            f"{projected:.4f}%",
            projected < SYSTEM_TARGET_PERCENT,
        )
    )
    markdown = common.table(
        [
            "system metrics (vs metrics alone)",
            "steps/s (best)",
            "cost (best of reps)",
            "cost (median of paired reps)",
            "samples a run",
            "sampler CPU per sample (µs)",
            "sampler time / loop time",
        ],
        rows_out,
    )
    markdown += (
        f"\n\nThe system metrics sampler (shardfuse.metrics.system) at the production interval of "
        f"{PRODUCTION_INTERVAL_S:g} s and at 0.1 s, each against step metrics alone in the same "
        "repetition (the A/B figures are reported, not checked: a shared machine moves them by more "
        "than the target). Its thread's CPU time inside its samples (the start and stop samples "
        "included) resolves a fraction of a percent. At "
        f"{1e6 * per_sample[SYSTEM_MODES[1]]:.0f} µs a sample, sampling every "
        f"{PRODUCTION_INTERVAL_S:g} s costs {projected:.4f}% of a rank's time (one core)."
    )
    return markdown, checks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=240_000, help="rows of the synthetic dataset")
    parser.add_argument("--features", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--work-dir", type=Path, default=Path("/tmp/shardfuse-bench/logging"))
    args = parser.parse_args()
    started = time.perf_counter()
    try:
        section = run(args.work_dir, args.rows, args.features, args.epochs, args.reps)
    finally:
        common.remove(args.work_dir)
    print(section["markdown"])
    for name, value, ok in section["checks"]:
        print(f"{name}: {value} {'reported' if ok is None else common.verdict(ok)}")
    print(f"({time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
