"""Where a pushed run came from and whether it changed: the provenance tags (git commit, tool
versions, hosts, SLURM job id, config hash) and the fingerprint over the config and every input file
that tells an unchanged run from one to sync again (:mod:`shardfuse.track.plan`).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.metadata
import json
import subprocess
from pathlib import Path

from shardfuse.io import sha256_file
from shardfuse.track.inputs import RunFiles, RunInputs

LAYOUT_VERSION = "4"  # the fingerprint and a parent tag: a new layout replaces every run once
CONFIG_HASH_TAG = "shardfuse.config_hash"


def fingerprint(config: dict, files: RunFiles, registered_model: str | None = None) -> str:
    """sha256 over the layout version, the config (sorted keys), the registry name and every file's sha256."""
    digest = hashlib.sha256(f"{LAYOUT_VERSION}\n{registered_model}\n".encode())
    digest.update(json.dumps(config, sort_keys=True).encode())
    named = files.by_name()
    for name in sorted(named):
        digest.update(f"\n{name}:{sha256_file(named[name])}".encode())
    return digest.hexdigest()


def config_hash(config: dict) -> str:
    return hashlib.sha256(json.dumps(config, sort_keys=True).encode()).hexdigest()


def _git_state(directory: Path) -> tuple[str | None, bool | None]:
    def git(*args: str) -> str | None:
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            proc = subprocess.run(
                ["git", "-C", str(directory), *args], capture_output=True, text=True, timeout=10
            )
            return proc.stdout.strip() if proc.returncode == 0 else None
        return None

    commit = git("rev-parse", "HEAD")
    status = git("status", "--porcelain", "--untracked-files=no") if commit else None
    return commit, None if status is None else bool(status)


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def provenance_tags(inputs: RunInputs, run_config_hash: str) -> dict[str, str]:
    """Where the results came from: code, tools, machines, scheduler."""
    train = inputs.train
    commit, dirty = train.git_commit, train.git_dirty
    if commit is None:  # the code that is pushing is the code that ran, unless train.json says otherwise
        commit, dirty = _git_state(Path(__file__).resolve().parent)
    tags = {
        CONFIG_HASH_TAG: run_config_hash,
        "shardfuse.git_commit": commit or "unknown",
        "shardfuse.git_dirty": "unknown" if dirty is None else str(bool(dirty)).lower(),
        "shardfuse.snakemake_version": _version("snakemake"),
        "shardfuse.torch_version": str(train.torch_version or _version("torch")),
        "shardfuse.mlflow_version": _version("mlflow"),
    }
    if commit:
        tags["mlflow.source.git.commit"] = commit  # shown by the MLflow UI
    if hosts := inputs.hosts:
        tags["shardfuse.hosts"] = ",".join(sorted(set(hosts.values())))
    if train.slurm_job_id:
        tags["shardfuse.slurm_job_id"] = str(train.slurm_job_id)
    if isinstance(train.adapter, dict):  # LoRA: the frozen base every rank's adapter was trained over
        tags["shardfuse.adapter"] = f"lora r={train.adapter.get('r')} alpha={train.adapter.get('alpha')}"
        tags["shardfuse.adapter_base_sha256"] = str(train.adapter.get("base_sha256"))
    return tags
