"""Helpers and constants shared by the tests (import them from here; conftest.py holds only the
fixtures and hooks)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# Figures measured by integration tests, printed at the end of the run (CI log).
MEASUREMENTS: list[str] = []
# Fast status polling for a SLURM cluster on this machine; the profile's own values suit real clusters.
SLURM_FAST_STATUS = [
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--seconds-between-status-checks",
    "2",
    "--latency-wait",
    "5",
]


def subprocess_env() -> dict[str, str]:
    """Environment for child processes: this checkout's src first, venv binaries on PATH."""
    env = dict(os.environ)
    # Hermetic: a workflow run in a test tracks where its config says, never where an earlier test
    # (mlflow.set_tracking_uri exports this variable) or the developer's shell points.
    env.pop("MLFLOW_TRACKING_URI", None)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(sys.executable).parent), env.get("PATH", "")])
    return env


def snakemake_command(workdir: Path, *args: object) -> list[str]:
    """``snakemake`` on this repository's workflow, run in ``workdir`` (its config/config.yaml)."""
    return [
        sys.executable,
        "-m",
        "snakemake",
        "--snakefile",
        str(REPO / "Snakefile"),
        "--directory",
        str(workdir),
        *map(str, args),
    ]


def run_in(cwd: Path, command: list, timeout: float = 900) -> subprocess.CompletedProcess:
    """``command`` (``python -m`` it when it starts with a module name such as snakemake) as a user
    runs it in ``cwd``: this checkout's environment, output captured."""
    return subprocess.run(
        [sys.executable, "-m", *map(str, command)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )


def snakemake_failure(workdir: Path, proc: subprocess.CompletedProcess, tail: int = 4000) -> str:
    """Assertion message for a failed snakemake run: its stderr tail, then the end of the log of
    every job it reports as failed (the job's own error is there, not in snakemake's output)."""
    parts = [f"snakemake exited {proc.returncode}:", (proc.stderr or "")[-tail:]]
    logs = re.findall(r"^\s*log: (.+?) \(check log file", proc.stderr or "", flags=re.MULTILINE)
    for name in dict.fromkeys(path for entry in logs for path in entry.split(", ")):
        path = Path(workdir) / name
        text = path.read_text(errors="replace") if path.is_file() else "(no such file)"
        parts.append(f"--- {name} (last {tail} chars) ---\n{text[-tail:]}")
    return "\n".join(parts)


def write_train_dir(
    out: Path, base: dict, ranks: int = 2, rank_tensors: Callable[[int], dict] | None = None
) -> Path:
    """A train directory as training writes it (base and rank checkpoints, train.json) from hand-made
    tensors: ``base`` for the base model, ``rank_tensors(rank)`` (default: ``base``) for each rank."""
    from shardfuse.checkpoint import save_weights

    spec = {
        "type": "mlp",
        "num_features": 4,
        "num_classes": 3,
        "hidden_sizes": [],
        "activation": "relu",
        "dropout": 0.0,
    }
    meta = {"run": "t", "world_size": ranks, "strategy": "localsgd", "model": spec}
    save_weights(out / "base.safetensors", base, {**meta, "rank": None})
    for rank in range(ranks):
        tensors = rank_tensors(rank) if rank_tensors else base
        save_weights(
            out / f"rank-{rank}.safetensors", tensors, {**meta, "rank": rank, "rows": 5, "num_steps": 1}
        )
    (out / "train.json").write_text(json.dumps({**meta, "num_steps": 1}))
    return out


def run_stage(stage: str, *args: object, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run ``python -m shardfuse.<stage> ARGS`` as a user would, capturing its output."""
    return subprocess.run(
        [sys.executable, "-m", f"shardfuse.{stage}", *map(str, args)],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )


def slurm_state_dir() -> Path:
    return Path(os.environ.get("SHARDFUSE_SLURM_DIR", "/tmp/shardfuse-slurm"))
