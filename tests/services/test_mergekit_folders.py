"""Whole folders merged by `mergekit-yaml` (0.1.5) and by shardfuse from the same YAML's settings, tensor by
tensor: a run over checkpoints (the collect, gather and merge stages) with per-layer and per-tensor
parameters against mergekit's own command on the same local GPT-2 folders. mergekit lives in its own
environment ($SHARDFUSE_MERGEKIT_PYTHON, made by .ci/run); in CI a missing one fails, elsewhere the test is
skipped. The method functions alone: test_mergekit_reference.py.

The folders: a "pretrained" GPT-2 of three layers made locally (scripts/make-pretrained.py) and two
"fine-tunes" of it (its float tensors plus seeded noise). Every tensor size is a multiple of 4 and the
densities quarters, so TIES keeps the same count under mergekit's int() and shardfuse's round()
(bench/MERGEKIT.md lists that difference). mergekit works in float32: agreement within 1e-6.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml
from safetensors.numpy import load_file, save_file

from shardfuse.data.shard_set import partition_parquet
from shardfuse.prepare import prepare
from tests.support.helpers import call_stage, subprocess_env
from tests.support.hf import require_transformers
from tests.support.tracking import service_unavailable

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"

# (mergekit's method and per-model parameters, shardfuse's method and params, and the same with one value
# per parameter, which must not agree): the conventions of bench/MERGEKIT.md (task arithmetic: scale =
# lambda x weight x N; ties: weight 1, lambda the scale).
GRADIENT = [0.2, 0.5, 0.8]
DENSITIES = [{"filter": "mlp", "value": 0.5}, {"value": 0.25}]
CASES = {
    "task_arithmetic_gradient": (
        "task_arithmetic", [{"weight": GRADIENT}, {"weight": GRADIENT}],
        "task_arithmetic", {"scale": [2 * w for w in GRADIENT]}, {"scale": 1.0},
    ),
    "ties_density_filters": (
        "ties", [{"weight": 1.0, "density": DENSITIES}, {"weight": 1.0, "density": DENSITIES}],
        "ties", {"density": DENSITIES, "scale": 1.0}, {"density": 0.25, "scale": 1.0},
    ),
    "linear_weight_filters": (
        "linear", [{"weight": [{"filter": "attn", "value": 3.0}, {"value": 1.0}]}, {"weight": 1.0}],
        "weighted", {"weights": [[{"filter": "attn", "value": 3.0}, {"value": 1.0}], 1.0]},
        {"weights": [1.0, 1.0]},
    ),
}  # fmt: skip


def mergekit_yaml() -> Path:
    python = Path(os.environ.get("SHARDFUSE_MERGEKIT_PYTHON", "/tmp/mkvenv/bin/python"))
    command = python.parent / "mergekit-yaml"
    if not os.access(command, os.X_OK):
        service_unavailable(
            f"no mergekit-yaml beside {python}: python3 -m venv V && V/bin/pip install torch==2.13.0 "
            "mergekit==0.1.5, then set SHARDFUSE_MERGEKIT_PYTHON=V/bin/python"
        )
    return command


@pytest.fixture(scope="module")
def folders(tmp_path_factory) -> dict:
    require_transformers()
    command = mergekit_yaml()
    root = tmp_path_factory.mktemp("mergekit-folders")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make-pretrained.py"), str(root / "base"), "--layers", "3"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = load_file(str(root / "base" / WEIGHTS))
    for name, seed in (("a", 1), ("b", 2)):
        shutil.copytree(root / "base", root / name)
        rng = np.random.default_rng(seed)
        tuned = {k: (v + rng.normal(0, 0.02, v.shape)).astype(v.dtype) for k, v in base.items()}
        save_file(tuned, str(root / name / WEIGHTS), metadata={"format": "pt"})
    spec = {"source": "text", "paths": ["{stdlib}/json/*.py"], "tokenizer": f"hf:{root / 'base'}"}
    prepare("json", {**spec, "block_size": 32, "max_tokens": 4000}, root / "json")
    partition_parquet(root / "json" / "train.parquet", root / "w1", 1, 0)
    config = {"model": "hf", "model_args": {"pretrained": str(root / "base")}, "seed": 0}
    args = ["--run-name", "json-c2-checkpoints-0123456789", "--shard-dir", root / "w1", "--dataset-dir"]
    args += [root / "json", "--config-json", json.dumps(config), "--out-dir", root / "ranks"]
    proc = call_stage("collect", *args, "--checkpoint", root / "a", "--checkpoint", root / "b")
    assert proc.returncode == 0, proc.stderr
    proc = call_stage(
        "gather", "--train-dir", root / "ranks", "--world-size", 2, "--out", root / "gather.json"
    )
    assert proc.returncode == 0, proc.stderr
    return {"root": root, "command": command}


@pytest.mark.parametrize("case", sorted(CASES))
def test_shardfuse_merges_the_folders_as_mergekit_yaml_does(folders, case):
    root, (mk_method, per_model, method, params, constant) = folders["root"], CASES[case]
    config = {
        "merge_method": mk_method,
        "base_model": str(root / "base"),
        "models": [
            {"model": str(root / name), "parameters": p} for name, p in zip("ab", per_model, strict=True)
        ],
        "dtype": "float32",
    }
    if mk_method == "linear":
        del config["base_model"]
    (root / f"{case}.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        [str(folders["command"]), str(root / f"{case}.yaml"), str(root / f"mk-{case}"), "--allow-crimes"],
        capture_output=True, text=True, timeout=600, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert (root / f"mk-{case}" / WEIGHTS).is_file(), proc.stderr[-3000:]
    theirs = load_file(str(root / f"mk-{case}" / WEIGHTS))

    def worst_difference(values: dict, name: str) -> tuple[float, str]:
        ours = root / f"{case}-{name}.safetensors"
        args = ["--gather", root / "gather.json", "--method", method, "--params-json", json.dumps(values)]
        proc = call_stage("merge", *args, "--out-weights", ours, "--out-json", root / f"{case}-{name}.json")
        assert proc.returncode == 0, proc.stderr
        mine = load_file(str(ours))
        assert set(theirs) == set(mine)
        return max((float(np.max(np.abs(theirs[k].astype(np.float64) - mine[k]))), k) for k in theirs)

    assert worst_difference(params, "layered")[0] < 1e-6
    assert worst_difference(constant, "constant")[0] > 1e-4  # the per-layer / per-tensor settings mattered
