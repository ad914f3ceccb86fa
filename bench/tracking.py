"""The track stage: its wall time per run against an earlier version, and its throughput in points/s.

    .venv/bin/python bench/tracking.py                    # both parts, fresh SQLite stores in a tmp dir
    .venv/bin/python bench/tracking.py --part per-run     # only the time per run (~1-2 min)
    .venv/bin/python bench/tracking.py --part throughput --points 300000 --tracking-uri http://127.0.0.1:5055

Per run (issue 12: the track job took longer than training): ``python -m shardfuse.tracking`` of one
run of the default experiment's size (2 ranks x 250 steps, merged MLP, plots dir) into a SQLite store
that already exists, wall time from fork to exit, each in its own process, in rotating order:
  new        this checkout's src/
  baseline   src/ of --baseline-ref (git archive; default: the commit before the torch-free track stage)
  floor      a process that imports MLflow, opens the same store and exits: what any process that
             writes to MLflow pays before its first request
Both versions track a fresh run ("created", the case of every run of a new experiment) and then the same
run again ("unchanged", what a re-run of the rule costs). Medians of --repeats; ratios are paired per
repetition. Target: new <= 1.5 s per created run. One extra untimed run of each version with
``-X importtime`` says whether it imports torch.

Throughput:

All three write the same per-step history (two ranks x steps x loss/samples_per_second/lr) into the same
store, one after the other:
  ours       shardfuse.track.sync.track_run end to end (runs, params, history, results, MLflow model);
             "history only" is the part spent in sync_history (the points themselves)
  log_batch  a bare MlflowClient.log_batch loop, 1,000 points per call (Metric objects built in the loop)
  per-point  MlflowClient.log_metric once per point: timed on a sample and extrapolated (it would take
             minutes on the full set), which the output says
Targets (issue "MLflow that HPC users can trust"): ours >= 30x per-point and >= 0.9x bare log_batch.
``--live`` also measures the live logger's cost in a training-like loop (steps/s with and without it).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO), str(REPO / "bench")]

import common  # noqa: E402
from mlflow.entities import Metric  # noqa: E402

from shardfuse.track import client as mlflow_common  # noqa: E402
from shardfuse.track import series as track_series  # noqa: E402
from shardfuse.track import sync as track_sync  # noqa: E402
from tests.support.tracking import make_run_dir, run_config  # noqa: E402

TARGET_VS_PER_POINT = 30.0
TARGET_VS_LOG_BATCH = 0.9
TARGET_SECONDS_PER_RUN = 1.5
# The last commit whose track stage imported torch and built a client per call (issue 12).
BASELINE_REF = "b3c4bbe4d474ad851098251b8d3e06c713ba3bb2"
RUN_STEPS = 250  # about what a rank of the default experiment (digits, 10 epochs, W = 2) logs
EXPERIMENT = "bench-per-run"
# Import MLflow, open the store, leave without the interpreter's teardown (as the stage does).
FLOOR = (
    "import os, sys; from mlflow.tracking import MlflowClient; "
    "MlflowClient(tracking_uri=sys.argv[1]).get_experiment_by_name(sys.argv[2]); os._exit(0)"
)


def history_columns(run_dir: Path) -> dict[int, dict[str, list]]:
    """Per rank, the history as plain column lists (what any loop over a metrics file starts from)."""
    columns = {}
    for path in sorted((run_dir / "train" / "metrics").glob("rank-*.parquet")):
        table = track_series.read_step_metrics(path)
        columns[int(path.stem[5:])] = {name: values.tolist() for name, values in table.items()}
    return columns


def bench_log_batch(client, experiment_id: str, columns: dict[int, dict[str, list]]) -> float:
    """One run per rank, like the track stage's children (one run for all ranks would collide on lr);
    the same point order, 1,000 points per call."""
    keys = track_series.STEP_METRICS
    started = time.perf_counter()
    for rank, table in columns.items():
        run_id = client.create_run(experiment_id, run_name=f"bench/log_batch/rank-{rank}").info.run_id
        steps, stamps = table["step"], table["timestamp_ms"]
        batch = []
        for i in range(len(steps)):
            for key in keys:
                batch.append(Metric(key, table[key][i], stamps[i], steps[i]))
                if len(batch) == 1000:
                    client.log_batch(run_id, metrics=batch)
                    batch = []
        if batch:
            client.log_batch(run_id, metrics=batch)
    return time.perf_counter() - started


def bench_per_point(client, experiment_id: str, columns: dict[int, dict[str, list]], sample: int):
    run_id = client.create_run(experiment_id, run_name="bench/log_metric").info.run_id
    table = columns[0]
    count = 0
    started = time.perf_counter()
    for i in range(len(table["step"])):
        for key in track_series.STEP_METRICS:
            client.log_metric(
                run_id, key, table[key][i], timestamp=table["timestamp_ms"][i], step=table["step"][i]
            )
            count += 1
            if count == sample:
                return time.perf_counter() - started, count
    return time.perf_counter() - started, count


def bench_ours(uri: str, experiment: str, root: Path, name: str) -> tuple[float, float, int]:
    run_dir, manifest = make_run_dir(root, name, num_steps=STEPS)
    spent = [0.0]
    original = track_sync.sync_history

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            spent[0] += time.perf_counter() - started

    track_sync.sync_history = timed
    try:
        started = time.perf_counter()
        result = track_sync.track_run(name, run_dir, manifest, run_config(name), uri, experiment)
        total = time.perf_counter() - started
    finally:
        track_sync.sync_history = original
    assert result["action"] == "created"
    return total, spent[0], result["num_points_pushed"]


def bench_live(uri: str, experiment: str, seconds: float, rounds: int) -> None:
    import torch

    from shardfuse.track.live import LiveLogger

    torch.set_num_threads(1)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    features, labels = torch.randn(256, 64), torch.randint(0, 10, (256,))

    def steps_per_second(live) -> float:
        steps, started = 0, time.perf_counter()
        while time.perf_counter() - started < seconds:
            optimizer.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(features), labels)
            loss.backward()
            optimizer.step()
            steps += 1
            loss_value = loss.item()  # training reads it anyway (metrics file, progress bar)
            if live is not None:
                live.log(steps, {"loss": loss_value, "samples_per_second": 256.0, "lr": 0.01})
        return steps / (time.perf_counter() - started)

    without, with_live, accounted = [], [], []
    for index in range(rounds):  # interleaved, so drift of the machine hits both alike
        without.append(steps_per_second(None))
        live = LiveLogger(uri, experiment, f"bench-live-{index}")
        live.log(0, {"loss": 0.0})
        deadline = time.monotonic() + 60  # steady state: its one-off start (client, store, run) is done
        while live.run_id is None and time.monotonic() < deadline:
            time.sleep(0.1)
        cpu_before, started = live.cpu_seconds, time.perf_counter()
        with_live.append(steps_per_second(live))
        live.close(timeout=30)  # flushes the rest: counted too
        # CPU the logger took from training: its thread's CPU (GIL held at most that long) + log() calls.
        log_cost = _log_call_seconds(live) * with_live[-1] * seconds
        accounted.append(100 * (live.cpu_seconds - cpu_before + log_cost) / (time.perf_counter() - started))
    best_without, best_with = max(without), max(with_live)
    measured = 100 * (1 - best_with / best_without)
    worst = max(accounted)
    verdict = "PASS" if worst < 1 else "FAIL"
    print(
        f"live logging: {best_without:,.0f} steps/s without, {best_with:,.0f} with (best of {rounds} x "
        f"{seconds:g} s after its start): {measured:+.2f}% (A/B, noisy on a shared machine); CPU it took: "
        f"{worst:.2f}% of the time (target < 1%): {verdict}"
    )


def _log_call_seconds(live, calls: int = 100_000) -> float:
    """Seconds per LiveLogger.log call (the rate limit makes most calls the cheap path, as in training)."""
    started = time.perf_counter()
    for step in range(calls):
        live.log(step, {"loss": 0.5, "samples_per_second": 256.0, "lr": 0.01})
    return (time.perf_counter() - started) / calls


def baseline_src(ref: str, dest: Path) -> Path:
    """src/ of ``ref``, unpacked from ``git archive`` (read-only: the checkout is not touched)."""
    proc = subprocess.run(["git", "-C", str(REPO), "archive", ref, "src"], capture_output=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"--baseline-ref {ref}: {proc.stderr.decode().strip()}; pass a commit of this repo")
    with tarfile.open(fileobj=io.BytesIO(proc.stdout)) as archive:
        archive.extractall(dest, filter="data")
    return dest / "src"


def track_cmd(root: Path, run_name: str, uri: str, out: Path) -> list[object]:
    run_dir = root / "results" / "runs" / run_name
    return common.python_cmd(
        "-m", "shardfuse.tracking", "--run", run_name, "--run-dir", run_dir,
        "--manifest", root / "results" / "shards" / "synthetic" / "w2-seed0" / "manifest.json",
        "--config-json", json.dumps(run_config(run_name)), "--tracking-uri", uri,
        "--experiment", EXPERIMENT, "--plots-dir", run_dir / "plots", "--out", out,
    )  # fmt: skip


def imports_torch(cmd: list[object], env: dict[str, str], cwd: Path) -> bool:
    proc = subprocess.run(
        [cmd[0], "-X", "importtime", *cmd[1:]], env=env, cwd=cwd, capture_output=True, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed:\n{proc.stderr[-3000:]}")
    names = {
        line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import ")
    }
    return any(name == "torch" or name.startswith("torch.") for name in names)


def bench_per_run(ref: str, repeats: int, steps: int) -> bool:
    """Wall time of one track job per run, this checkout against ``ref`` and the MLflow floor."""
    with tempfile.TemporaryDirectory(prefix="shardfuse-bench-track-") as tmp:
        root = Path(tmp)
        uri = f"sqlite:///{root}/mlflow.db"
        # Both versions ask the same repository for the commit (the unpacked baseline is no checkout).
        git = {"GIT_DIR": str(REPO / ".git"), "GIT_WORK_TREE": str(REPO)}
        envs = {
            "new": common.child_env(**git, PYTHONPATH=str(REPO / "src")),
            "baseline": common.child_env(**git, PYTHONPATH=str(baseline_src(ref, root / "baseline"))),
        }
        names = [f"warm-{index}" for index in range(len(envs))]
        names += [f"{version}-{index}" for version in envs for index in range(repeats + 1)]
        for name in names:
            make_run_dir(root, name, num_steps=steps)
        # The store and the experiment exist before anything is timed (a first run migrates the store).
        for index, env in enumerate(envs.values()):
            common.measure(track_cmd(root, f"warm-{index}", uri, root / "warm.json"), cwd=root, env=env)
        torch_imported = {
            version: imports_torch(track_cmd(root, f"{version}-{repeats}", uri, root / "x.json"), env, root)
            for version, env in envs.items()
        }
        seconds: dict[str, list[float]] = {"floor": []}
        for index in range(repeats):  # rotating order, so a drifting machine hits every version alike
            order = [*envs, "floor"]
            order = order[index % len(order) :] + order[: index % len(order)]
            for version in order:
                if version == "floor":
                    cmd = common.python_cmd("-c", FLOOR, uri, EXPERIMENT)
                    seconds["floor"].append(common.measure(cmd, cwd=root, env=envs["new"]).seconds)
                    continue
                out = root / f"{version}-{index}.json"
                for action in ("created", "unchanged"):
                    cmd = track_cmd(root, f"{version}-{index}", uri, out)
                    measured = common.measure(cmd, cwd=root, env=envs[version])
                    got = json.loads(out.read_text())["action"]
                    if got != action:
                        raise RuntimeError(f"{version} track of run {index}: {got}, expected {action}")
                    seconds.setdefault(f"{version} {action}", []).append(measured.seconds)
    rows, ok = [], True
    for action in ("created", "unchanged"):
        new, old = seconds[f"new {action}"], seconds[f"baseline {action}"]
        ratio = common.median([o / n for o, n in zip(old, new, strict=True)])
        row = [
            action,
            common.median(old),
            common.median(new),
            f"{ratio:.2f}x",
            common.median(seconds["floor"]),
        ]
        if action == "created":
            ok = common.median(new) <= TARGET_SECONDS_PER_RUN
            row.append(f"<= {TARGET_SECONDS_PER_RUN:g} s: {common.verdict(ok)}")
        else:
            row.append("-")
        rows.append(row)
    print(
        f"\nTrack time per run: 2 ranks x {steps} steps, SQLite store that exists, median of {repeats} "
        f"(wall, fork to exit); baseline {ref[:12]}"
    )
    header = [
        "track of a run",
        "baseline s",
        "new s",
        "baseline / new",
        "floor s (import MLflow, open store)",
    ]
    print(common.table([*header, "target"], rows))
    print(
        "imports torch: "
        + ", ".join(f"{version} {'yes' if hit else 'no'}" for version, hit in torch_imported.items())
    )
    return ok


def bench_throughput(args) -> bool:
    global STEPS
    STEPS = -(-args.points // (2 * len(track_series.STEP_METRICS)))  # two ranks
    with tempfile.TemporaryDirectory(prefix="shardfuse-bench-") as tmp:
        root = Path(tmp)
        uri = args.tracking_uri or f"sqlite:///{root}/mlflow.db"
        experiment = f"bench-{int(time.time())}"
        if not args.tracking_uri:  # artifacts next to the store, not in ./mlruns of the caller
            mlflow_common.tracking_client(uri).create_experiment(experiment, str(root / "artifacts"))
        client, experiment_id = mlflow_common.connect(uri, experiment)
        points = history_columns(make_run_dir(root / "data", "reference", num_steps=STEPS)[0])
        num_points = sum(len(p["step"]) for p in points.values()) * len(track_series.STEP_METRICS)
        print(
            f"store {mlflow_common.redact_uri(uri)}; {num_points:,} history points "
            f"(2 ranks x {STEPS:,} steps x {len(track_series.STEP_METRICS)} metrics)"
        )

        ours, history_only, bare = [], [], []
        for index in range(args.repeat):
            bare.append(num_points / bench_log_batch(client, experiment_id, points))
            total, spent, pushed = bench_ours(uri, experiment, root / f"ours-{index}", f"bench-ours-{index}")
            ours.append(pushed / total)
            history_only.append(num_points / spent)
        seconds, count = bench_per_point(client, experiment_id, points, args.sample)
        per_point = count / seconds

        best_ours, best_bare = max(ours), max(bare)
        print(
            f"per-point log_metric : {per_point:>10,.0f} points/s  (timed on {count:,} points, extrapolated: "
            f"{num_points / per_point:,.0f} s for all)"
        )
        print(f"bare log_batch (1000): {best_bare:>10,.0f} points/s  ({num_points / best_bare:.1f} s)")
        print(f"ours, history only   : {max(history_only):>10,.0f} points/s")
        print(
            f"ours, track_run      : {best_ours:>10,.0f} points/s  ({pushed / best_ours:.1f} s end to end, "
            "incl. runs, params, artifacts, MLflow model)"
        )
        verdicts = []
        for label, ratio, target in (
            ("vs per-point log_metric", best_ours / per_point, TARGET_VS_PER_POINT),
            ("vs bare log_batch", best_ours / best_bare, TARGET_VS_LOG_BATCH),
        ):
            verdicts.append(ratio >= target)
            verdict = "PASS" if ratio >= target else "FAIL"
            print(f"ours {label:<24}: {ratio:6.2f}x (target >= {target:g}x) {verdict}")
        if args.live:
            bench_live(uri, experiment, seconds=6.0, rounds=3)
    return all(verdicts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=("all", "per-run", "throughput"), default="all")
    parser.add_argument("--repeats", type=int, default=5, help="per run: repetitions (medians)")
    parser.add_argument("--steps", type=int, default=RUN_STEPS, help="per run: steps per rank")
    parser.add_argument("--baseline-ref", default=BASELINE_REF, help="per run: the commit compared with")
    parser.add_argument("--points", type=int, default=120_000, help="history points (>= 100,000)")
    parser.add_argument("--sample", type=int, default=2_000, help="points timed for per-point log_metric")
    parser.add_argument(
        "--repeat", type=int, default=2, help="alternating rounds of ours/log_batch; best wins"
    )
    parser.add_argument("--tracking-uri", help="default: a fresh sqlite store in a temporary directory")
    parser.add_argument("--live", action="store_true", help="also measure the live logger's overhead")
    args = parser.parse_args()
    load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    print(f"load average (1/5/15 min) at start: {load}; {os.cpu_count()} cores")
    ok = True
    if args.part in ("all", "throughput"):
        ok &= bench_throughput(args)
    if args.part in ("all", "per-run"):
        ok &= bench_per_run(args.baseline_ref, args.repeats, args.steps)
    return 0 if ok else 1


STEPS = 0
if __name__ == "__main__":
    sys.exit(main())
