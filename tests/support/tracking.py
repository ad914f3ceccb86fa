"""Fabricate the files the train/gather/merge/evaluate stages leave in a run directory.

The shapes follow what those stages write (the merged weights are a real shardfuse MLP checkpoint), so
tracking, plotting and model-loading tests exercise the real file contracts without running torchrun.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import torch
from mlflow.entities import ViewType

from shardfuse.checkpoints.weights import save_weights
from shardfuse.io import sha256_file
from shardfuse.models.registry import build_model
from shardfuse.track import sync as track_sync
from tests.support.helpers import REPO, missing_in_ci

NUM_FEATURES, NUM_CLASSES = 8, 3
T0_MS = 1_700_000_000_000


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@contextmanager
def mlflow_tracking_uri(uri: str) -> Iterator[None]:
    """``mlflow.set_tracking_uri(uri)`` for the block; afterwards unset, and MLFLOW_TRACKING_URI (which
    set_tracking_uri exports) removed, so later tests' workflows do not inherit it."""
    import mlflow

    mlflow.set_tracking_uri(uri)
    try:
        yield
    finally:
        mlflow.set_tracking_uri(None)
        os.environ.pop("MLFLOW_TRACKING_URI", None)


def service_unavailable(message: str):
    """CI must have every service (there a missing one fails); elsewhere the test is skipped."""
    missing_in_ci(message)


def run_script(
    name: str, env: dict[str, str], *args: str, timeout: float = 600
) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["bash", str(REPO / "scripts" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=timeout,
    )


def service_env(state: Path, **extra: str) -> dict[str, str]:
    """Environment for the scripts: a private state dir and free ports, this checkout's mlflow."""
    from tests.support.helpers import subprocess_env

    mlflow_bin = Path(os.environ.get("VIRTUAL_ENV", REPO / ".venv")) / "bin" / "mlflow"
    env = {k: v for k, v in subprocess_env().items() if not k.startswith("MLFLOW_")}
    env.update(
        SHARDFUSE_PG_DIR=str(state / "pg"),
        SHARDFUSE_PG_PORT=str(free_port()),
        SHARDFUSE_MLFLOW_DIR=str(state / "mlflow"),
        SHARDFUSE_MLFLOW_PORT=str(free_port()),
        SHARDFUSE_MLFLOW_WORKERS="1",
        **extra,
    )
    if mlflow_bin.exists():
        env["SHARDFUSE_MLFLOW_BIN"] = str(mlflow_bin)
    return env


@contextmanager
def mlflow_service(postgres: bool, **extra: str) -> Iterator[dict]:
    """``mlflow server`` on a free loopback port (PostgreSQL-backed, or SQLite), via scripts/*-up.sh."""
    # Not under pytest's 0700 tmp dirs: the postgres user must reach its data directory.
    state = Path(tempfile.mkdtemp(prefix="shardfuse-test-", dir="/tmp"))
    state.chmod(0o755)
    if not postgres:
        extra.setdefault("SHARDFUSE_MLFLOW_BACKEND_URI", f"sqlite:///{state}/mlflow.db")
    env = service_env(state, **extra)
    started = []
    try:
        for script, wanted in (("postgres-up.sh", postgres), ("mlflow-server-up.sh", True)):
            if not wanted:
                continue
            proc = run_script(script, env)
            started.append(script.replace("-up.sh", "-down.sh"))
            if proc.returncode != 0:
                tail = " | ".join(proc.stderr.strip().splitlines()[-6:])
                service_unavailable(
                    f"scripts/{script} failed (needs root or an installed PostgreSQL): {tail}"
                )
        yield {"uri": f"http://127.0.0.1:{env['SHARDFUSE_MLFLOW_PORT']}", "env": env, "state": state}
    finally:
        for script in reversed(started):
            run_script(script, env, "--purge", timeout=120)
        shutil.rmtree(state, ignore_errors=True)


def run_config(run_name: str, merge_method: str = "average", world_size: int = 2) -> dict:
    """A resolved run config as the workflow passes it: nested, with lists and nulls."""
    return {
        "run": run_name,
        "dataset": {
            "name": "synthetic",
            "num_features": NUM_FEATURES,
            "num_classes": NUM_CLASSES,
            "path": None,
        },
        "world_size": world_size,
        "seed": 0,
        "model": {"name": "mlp", "hidden_sizes": [16, 16], "dropout": 0.0},
        "train": {"strategy": "ddp", "sync_every": 1, "epochs": 2, "batch_size": 32, "lr": 0.01},
        "merge": {"method": merge_method, "weights": None},
    }


def model_spec() -> dict:
    return {
        "type": "mlp",
        "num_features": NUM_FEATURES,
        "num_classes": NUM_CLASSES,
        "hidden_sizes": [16, 16],
        "activation": "relu",
        "dropout": 0.0,
    }


# What the train stage writes since grad clipping, validation and DiLoCo (train.json of older trainings
# lacks every field): see make_run_dir(new_train_fields=True).
VAL_EVERY = 3
NEW_TRAIN_FIELDS = {
    "mode": "diloco",
    "grad_accum_steps": 2,
    "effective_batch_size": 128,
    "lr_schedule": "cosine",
    "warmup_steps": 2,
    "bytes_all_reduced_per_rank": 123_456_789,
    "num_syncs": 3,
    "init": "shared",
    "keep": "best",
    "stopped_early": False,
    "validation": {"score": "accuracy", "every": VAL_EVERY},
}


def grad_norm(rank: int, step) -> np.ndarray:
    """The fixtures' pre-clip gradient norm: finite on every step but rank 1's first (NaN: a skipped step)."""
    values = 2.0 + 0.1 * rank + 0.01 * np.asarray(step, dtype=np.float64)
    return np.where((rank == 1) & (np.asarray(step) == 0), np.nan, values)


def val_score(rank: int, step) -> np.ndarray:
    """The fixtures' validation accuracy: every VAL_EVERY-th step (steps 2, 5, ...), NaN elsewhere."""
    step = np.asarray(step, dtype=np.float64)
    return np.where(step % VAL_EVERY == VAL_EVERY - 1, 0.5 + 0.01 * step + 0.001 * rank, np.nan)


def step_table(
    rank: int, steps: np.ndarray, num_steps: int, seed: int = 0, new_columns: bool = False
) -> pa.Table:
    """Rows of metrics/rank-{rank}.parquet for ``steps`` (values depend only on rank, step and seed);
    ``new_columns``: also grad_norm and val_score, in the train stage's column order."""
    rng = np.random.default_rng([seed, rank, int(steps[0]) if len(steps) else 0])
    columns = {
        "step": steps.astype(np.int64),
        "epoch": steps * 2 // num_steps,
        "loss": 1.1 - 0.1 * steps - 0.01 * rank,
        "samples_per_second": 1000.0 + rng.random(len(steps)),
        "lr": np.full(len(steps), 0.01),
    }
    if new_columns:
        columns.update(grad_norm=grad_norm(rank, steps), val_score=val_score(rank, steps))
    return pa.table({**columns, "timestamp_ms": T0_MS + 250 * steps})


def append_steps(train_dir: Path, num_new: int) -> None:
    """Training went on for ``num_new`` more steps: every rank's metrics file gains rows (same prefix)."""
    for path in sorted((train_dir / "metrics").glob("rank-*.parquet")):
        old = pq.read_table(path)
        first = old.column("step")[-1].as_py() + 1
        rank = int(path.stem.split("-")[1])
        steps = np.arange(first, first + num_new)
        new = step_table(rank, steps, first + num_new, seed=1, new_columns="val_score" in old.schema.names)
        pq.write_table(pa.concat_tables([old, new.cast(old.schema)]), path)


def sample_system_metrics(metrics_dir: Path, rank: int, seconds: float = 0.3) -> Path:
    """Real system samples of this process, as a training rank leaves them (consolidated Parquet)."""
    import time

    from shardfuse.metrics.system import SystemSampler

    sampler = SystemSampler(metrics_dir, rank, interval_s=0.05).start()
    time.sleep(seconds)
    return sampler.consolidate()


def write_dataset(out_dir: Path, train_rows: int) -> dict:
    """What the prepare stage leaves for the dataset the shards were cut from: the train and test
    splits (tiny stand-ins) and dataset.json with their sha256 and row counts (created once per root)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = {"train": train_rows, "test": 300}
    for split in rows:
        path = out_dir / f"{split}.parquet"
        if not path.exists():
            pq.write_table(pa.table({"x0": np.zeros(3, dtype=np.float32), "label": [0, 1, 2]}), path)
    info = {
        "name": "synthetic",
        "rows": rows,
        "sha256": {split: sha256_file(out_dir / f"{split}.parquet") for split in rows},
    }
    (out_dir / "dataset.json").write_text(json.dumps(info))
    return {**info, "train": out_dir / "train.parquet", "rows": train_rows}


def remerge(run_dir: Path, method: str, **fields) -> None:
    """The run merged again with ``method``: merged.safetensors (its header names the method) and the
    merge.json that records it (``fields`` added), as the merge stage writes them together."""
    merged = run_dir / "merged.safetensors"
    _save_mlp(merged, 0, {"run": run_dir.name, "rank": None, "merge_method": method}, sidecar=False)
    merge = json.loads((run_dir / "merge.json").read_text())
    merge.update(method=method, sha256=sha256_file(merged), **fields)
    (run_dir / "merge.json").write_text(json.dumps(merge))


def _save_mlp(path: Path, seed: int, meta: dict, sidecar: bool = True) -> None:
    torch.manual_seed(seed)
    save_weights(path, build_model(model_spec()).state_dict(), {**meta, "model": model_spec()}, sidecar)


def make_run_dir(
    root: Path,
    run_name: str,
    world_size: int = 2,
    num_steps: int = 7,
    merge_method: str = "average",
    ddp_baseline: bool = False,
    training: str | None = None,
    new_train_fields: bool = False,
    system_metrics: bool = False,
) -> tuple[Path, Path]:
    """Write a complete run directory plus its shard manifest under ``root``; return both paths.

    With ``system_metrics``, each rank's metrics/system-rank-{r}.parquet holds a few real samples of
    this process (shardfuse.metrics.system.SystemSampler, 50 ms apart).

    With ``training``, the ranks and gather.json go where runs sharing a training keep them:
    results/trainings/{training}/ranks and results/trainings/{training}/gather.json.
    With ``new_train_fields``, train.json has :data:`NEW_TRAIN_FIELDS` and each rank's published_step
    (num_steps - 1 - rank) and best_val_score (rank 0: 0.77, rank 1 and up: null), and the metrics
    files the grad_norm and val_score columns (:func:`grad_norm`, :func:`val_score`).
    """
    run_dir = root / "results" / "runs" / run_name
    run_dir.mkdir(parents=True)
    train_dir, gather_path = run_dir / "train", run_dir / "gather.json"
    if training is not None:
        train_dir = root / "results" / "trainings" / training / "ranks"
        gather_path = train_dir.parent / "gather.json"
    metrics_dir = train_dir / "metrics"
    metrics_dir.mkdir(parents=True, exist_ok=training is not None)
    shard_dir = root / "results" / "shards" / "synthetic" / f"w{world_size}-seed0"
    shard_dir.mkdir(parents=True, exist_ok=True)
    manifest_path = shard_dir / "manifest.json"
    shard_rows = [719 + rank for rank in range(world_size)]
    dataset = write_dataset(root / "results" / "datasets" / "synthetic", sum(shard_rows))
    schema = [{"name": f"x{i}", "type": "float"} for i in range(NUM_FEATURES)]
    manifest = {
        "dataset": "synthetic",
        "world_size": world_size,
        "seed": 0,
        "source": {
            "path": str(dataset["train"]),
            "sha256": dataset["sha256"]["train"],
            "rows": sum(shard_rows),
        },
        "schema": [*schema, {"name": "label", "type": "int64"}],
        "shards": [
            {"rank": r, "path": f"shard-{r}.parquet", "rows": n, "sha256": f"{r:02d}" * 32}
            for r, n in enumerate(shard_rows)
        ],
    }
    manifest_path.write_text(json.dumps(manifest, indent=2))

    ranks = []
    for rank in range(world_size):
        table = step_table(rank, np.arange(num_steps), num_steps, new_columns=new_train_fields)
        pq.write_table(table, metrics_dir / f"rank-{rank}.parquet")
        if system_metrics:
            sample_system_metrics(metrics_dir, rank)
        checkpoint = train_dir / f"rank-{rank}.safetensors"
        _save_mlp(checkpoint, rank + 1, {"run": run_name, "rank": rank, "host": f"node{rank}"})
        ranks.append({"rank": rank, "rows": shard_rows[rank], "checkpoint": str(checkpoint)})

    train = {
        "run": run_name,
        "world_size": world_size,
        "strategy": "ddp",
        "sync_every": 1,
        "num_steps": num_steps,
        "epochs": 2,
        "train_seconds": 12.5,
        "backend": "gloo",
        "hosts": [f"node{r}" for r in range(world_size)],
        "slurm_job_id": "4242",
        "torch_version": "2.13.0",
        "ranks": [
            {"rank": r["rank"], "rows": r["rows"], "checkpoint": Path(r["checkpoint"]).name} for r in ranks
        ],
        "model": model_spec(),
    }
    if new_train_fields:
        train.update(NEW_TRAIN_FIELDS)
        for entry in train["ranks"]:
            best = 0.77 if entry["rank"] == 0 else None
            entry.update(published_step=num_steps - 1 - entry["rank"], best_val_score=best)
    (train_dir / "train.json").write_text(json.dumps(train, indent=2))
    gather = {
        "run": run_name,
        "world_size": world_size,
        "ranks": [
            {
                "rank": r["rank"],
                "path": r["checkpoint"],
                "sha256": sha256_file(r["checkpoint"]),
                "bytes": Path(r["checkpoint"]).stat().st_size,
                "rows": r["rows"],
            }
            for r in ranks
        ],
    }
    gather_path.write_text(json.dumps(gather, indent=2))
    merged = run_dir / "merged.safetensors"
    _save_mlp(merged, 0, {"run": run_name, "rank": None, "merge_method": merge_method}, sidecar=False)
    merge = {
        "run": run_name,
        "method": merge_method,
        "num_ranks": world_size,
        "weights": [r["rows"] / sum(shard_rows) for r in ranks],
        "seconds": 0.25,
        "output": "merged.safetensors",
        "sha256": sha256_file(merged),
    }
    (run_dir / "merge.json").write_text(json.dumps(merge, indent=2))
    rank_results = [
        {"rank": r, "loss": 0.6 + 0.05 * r, "accuracy": 0.70 + 0.02 * r} for r in range(world_size)
    ]
    evaluation = {
        "run": run_name,
        "test_rows": 300,
        "merged": {"loss": 0.5, "accuracy": 0.8},
        "base": {"loss": 1.1, "accuracy": 0.34},
        "ranks": rank_results,
        "best_rank_accuracy": max(r["accuracy"] for r in rank_results),
        "mean_rank_accuracy": float(np.mean([r["accuracy"] for r in rank_results])),
        "mean_rank_loss": float(np.mean([r["loss"] for r in rank_results])),
    }
    if ddp_baseline:
        evaluation["ddp_baseline"] = {"run": "ddp", "accuracy": 0.83, "loss": 0.45}
    (run_dir / "eval.json").write_text(json.dumps(evaluation, indent=2))
    return run_dir, manifest_path


def regression_evaluation(
    run_name: str, world_size: int = 2, ddp_baseline: bool = False, ensemble: bool = False
) -> dict:
    """eval.json as the evaluate stage writes it for a regression run whose merged model has a lower
    test mse (0.25) than every rank (0.30, 0.32, ...): a positive fusion gain of 0.05. With ``ensemble``
    (eval.json of evaluate stages since issue 16), the ranks' ensemble scores mse 0.21: a fusion gap of
    0.04 (the ensemble is better than the merged model); without, eval.json is an older stage's."""
    ranks = [
        {
            "rank": r,
            "loss": 0.31 + 0.02 * r,
            "mse": 0.30 + 0.02 * r,
            "mae": 0.40 + 0.01 * r,
            "r2": 0.7 - 0.02 * r,
        }
        for r in range(world_size)
    ]
    merged = {"loss": 0.26, "mse": 0.25, "mae": 0.38, "r2": 0.75}
    best = min(r["mse"] for r in ranks)
    evaluation = {
        "run": run_name,
        "training": "shared",
        "test_rows": 300,
        "task": "regression",
        "score": "mse",
        "lower_is_better": True,
        "metrics": ["loss", "mse", "mae", "r2"],
        "merged": merged,
        "base": {"loss": 1.02, "mse": 1.0, "mae": 0.8, "r2": -0.01},
        "ranks": ranks,
        "best_rank_mse": best,
        "mean_rank_mse": float(np.mean([r["mse"] for r in ranks])),
        "mean_rank_loss": float(np.mean([r["loss"] for r in ranks])),
        "fusion_gain": best - merged["mse"],
        "ddp_baseline": {"run": "ddp", "loss": 0.23, "mse": 0.22, "mae": 0.36, "r2": 0.78}
        if ddp_baseline
        else None,
    }
    if ensemble:
        scores = {"loss": 0.22, "mse": 0.21, "mae": 0.35, "r2": 0.79}
        evaluation.update(
            ensemble=scores, ensemble_mse=scores["mse"], fusion_gap=merged["mse"] - scores["mse"]
        )
    return evaluation


SRC = REPO / "src"


TRACK_EXPERIMENT = "shardfuse"


def track_into(track_store, tmp_path, run_name, track_kwargs=None, **run_kwargs):
    run_dir, manifest = make_run_dir(tmp_path, run_name, **run_kwargs)
    config = run_config(run_name, merge_method=run_kwargs.get("merge_method", "average"))
    result = track_sync.track_run(
        run_name, run_dir, manifest, config, track_store["uri"], TRACK_EXPERIMENT, **(track_kwargs or {})
    )
    return result, run_dir, manifest, config


def metric_history(track_store, run_id, key):
    return sorted((m.step, m.value) for m in track_store["client"].get_metric_history(run_id, key))


def active_runs(track_store, run_name, view=ViewType.ACTIVE_ONLY):
    runs = track_store["client"].search_runs(
        [track_store["experiment_id"]], f"tags.`shardfuse.run` = '{run_name}'", run_view_type=view
    )
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if "mlflow.parentRunId" in r.data.tags]
    return parents, children


def tracking_env():
    env = {k: v for k, v in os.environ.items() if not k.startswith("MLFLOW_")}
    env["PYTHONPATH"] = str(SRC)
    return env


def track_cli_args(run_name, run_dir, manifest, uri, out):
    return [
        sys.executable, "-m", "shardfuse.tracking", "--run", run_name, "--run-dir", str(run_dir),
        "--manifest", str(manifest), "--config-json", json.dumps(run_config(run_name)),
        "--tracking-uri", uri, "--experiment", TRACK_EXPERIMENT, "--out", str(out),
    ]  # fmt: skip


def git(*args) -> str:
    return subprocess.run(
        ["git", "-C", str(SRC), *args], capture_output=True, text=True, check=True
    ).stdout.strip()
