"""A foreign ``init_from`` checked against its run's model while the config loads, before any job.

The check builds the model, which needs torch, and the Snakefile's process must not import it: so it
runs as ``python -m shardfuse.check_init`` in a subprocess (seconds: torch, and transformers for
``model: hf``). A pass is cached in ``.snakemake/shardfuse/init-checks/`` under the sha256 of all it
read: the weights' headers (names, dtypes, shapes; not the tensor data), the run's model keys and code
digest, the dataset spec (and an hf tokenizer's file), init_from_prefix and the torch and transformers
versions; so a repeated ``snakemake`` pays a few milliseconds. A failure is never cached: it is one line
naming the first misfit tensor and the file, and the same line comes from the train stage should the
file change after this check. ``merge_align`` on a user model is checked the same way (its
``permutation_groups()``, looked up on the model built on the meta device), so merge does not refuse it
after training. Torch-free (the Snakefile imports it).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import shardfuse
from shardfuse.checkpoints.init_weights import header_digest
from shardfuse.console.errors import ERROR_LINE
from shardfuse.data.sources.hf_tokenizer import is_hf, tokenizer_file
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError, sha256_file, write_json

CACHE_DIR = Path(".snakemake") / "shardfuse" / "init-checks"  # under the working directory, as Snakemake's
CHECK_FORMAT = 1  # raise when what a check decides changes, to drop the passes cached before
# The run keys the model is built from (with the dataset's spec), hence what the check reads.
MODEL_KEYS = (
    "model",
    "model_args",
    "code_paths",
    "model_files",
    "hidden_sizes",
    "activation",
    "dropout",
    "model_output",
    "init_from_prefix",
)
TIMEOUT_S = 900


def _version(package: str) -> str | None:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return None


def _digest(record: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()


def _model_record(run: dict[str, Any], dataset_spec: dict[str, Any]) -> dict[str, Any]:
    """What building ``run``'s model reads: its keys and code, the dataset and the library versions."""
    return {
        "format": CHECK_FORMAT,
        "run": {key: run[key] for key in MODEL_KEYS},
        "code_digest": run.get("code_digest"),
        "dataset": dataset_spec,
        "versions": {package: _version(package) for package in ("torch", "transformers")},
    }


def check_key(run: dict[str, Any], dataset_spec: dict[str, Any]) -> str:
    """The sha256 of everything the check of ``run``'s init_from reads."""
    tokenizer = dataset_spec.get("tokenizer")
    return _digest(
        {
            **_model_record(run, dataset_spec),
            "weights": header_digest(run["init_from"]),
            "tokenizer": sha256_file(tokenizer_file(tokenizer)) if is_hf(tokenizer) else None,
        }
    )


def _subprocess_env() -> dict[str, str]:
    """This process's environment with this shardfuse first on the path (the Snakefile puts its
    checkout on sys.path, not in PYTHONPATH)."""
    env = dict(os.environ)
    src = str(Path(shardfuse.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [src, env.get("PYTHONPATH")]))
    return env


def _model_args(run: dict[str, Any], dataset_spec: dict[str, Any], **extra: Any) -> list[str]:
    run_json = json.dumps({**{key: run[key] for key in MODEL_KEYS}, **extra})
    return ["--run-json", run_json, "--dataset-json", json.dumps(dataset_spec)]


def check_foreign_init(
    where: str, run: dict[str, Any], dataset_spec: dict[str, Any], cache_dir: Path = CACHE_DIR
) -> dict[str, Any]:
    """The check's verdict ({"checked": ...}), cached; a misfit is a ConfigError at ``where``.init_from."""
    try:
        key = check_key(run, dataset_spec)
    except UserError as exc:
        raise ConfigError(f"{where}.init_from: {exc}") from None
    args = ["--init-from", run["init_from"], *_model_args(run, dataset_spec)]
    what = f"checking {run['init_from']} against the model"
    return _cached_check(f"{where}.init_from", key, args, what, cache_dir)


def check_model_aligns(
    where: str, run: dict[str, Any], dataset_spec: dict[str, Any], cache_dir: Path = CACHE_DIR
) -> dict[str, Any]:
    """merge_align on a user model: its permutation_groups() is looked up now (on the meta device),
    not by merge after training. Cached like the init_from check; a ConfigError at ``where``.merge_align."""
    key = _digest({**_model_record(run, dataset_spec), "check": "align"})
    what = f"looking up the permutation groups of model {run['model']!r}"
    return _cached_check(
        f"{where}.merge_align", key, ["--align", *_model_args(run, dataset_spec)], what, cache_dir
    )


def check_model_adapter(
    where: str, run: dict[str, Any], dataset_spec: dict[str, Any], cache_dir: Path = CACHE_DIR
) -> dict[str, Any]:
    """A LoRA adapter against its model (built on the meta device): target_modules that match nothing,
    or an r above a target's smaller dimension, is a ConfigError at ``where``.adapter now, not a failed
    training. Cached like the init_from check."""
    fits = {key: run["adapter"][key] for key in ("type", "r", "target_modules")}  # what the check reads
    key = _digest({**_model_record(run, dataset_spec), "check": "adapter", "adapter": fits})
    what = f"checking the adapter against model {run['model']!r}"
    args = ["--adapter", *_model_args(run, dataset_spec, adapter=run["adapter"])]
    return _cached_check(f"{where}.adapter", key, args, what, cache_dir)


def check_model_fsdp(
    where: str, run: dict[str, Any], dataset_spec: dict[str, Any], cache_dir: Path = CACHE_DIR
) -> dict[str, Any]:
    """fsdp > 1 on an hf or user model: its wrap units (an HF model's _no_split_modules, a user model's
    fsdp_units()) are looked up now on the meta device, not by the ranks. Cached like the others; a
    ConfigError at ``where``.fsdp."""
    key = _digest({**_model_record(run, dataset_spec), "check": "fsdp"})
    what = f"looking up the FSDP wrap units of model {run['model']!r}"
    return _cached_check(f"{where}.fsdp", key, ["--fsdp", *_model_args(run, dataset_spec)], what, cache_dir)


def _cached_check(where: str, key: str, args: list[str], what: str, cache_dir: Path) -> dict[str, Any]:
    """Run ``python -m shardfuse.check_init ARGS`` unless its pass is cached under ``key``."""
    cached = cache_dir / f"{key}.json"
    try:
        return json.loads(cached.read_text())
    except (OSError, ValueError):
        pass  # not checked yet (or a broken cache file): check
    command = [sys.executable, "-m", "shardfuse.check_init", *args]
    proc = subprocess.run(
        command, capture_output=True, text=True, env=_subprocess_env(), timeout=TIMEOUT_S, check=False
    )
    if proc.returncode != 0:
        lines = proc.stderr.strip().splitlines() or ["(no output)"]
        found = [match.group(1) for line in lines if (match := ERROR_LINE.match(line))]
        if proc.returncode == 2 and found:
            raise ConfigError(f"{where}: {found[-1].split(': error: ', 1)[1]}")
        raise ConfigError(
            f"{where}: {what} failed (exit status {proc.returncode}: {lines[-1]}); run "
            f"{' '.join(command[2:5])} --run-json ... by hand to see why"
        )
    verdict = json.loads(proc.stdout.strip().splitlines()[-1])
    try:
        cached.parent.mkdir(parents=True, exist_ok=True)
        write_json(cached, verdict)
    except OSError:
        pass  # a read-only working directory: checked again next time
    return verdict
