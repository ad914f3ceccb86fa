"""The same mergekit YAML merged by mergekit (0.1.5, ``run_merge``: what ``mergekit-yaml`` runs) and by
``python -m shardfuse.merge --mergekit``, on the same local GPT-2 folders, tensor by tensor: every method
shardfuse reads under mergekit's name, with scalar, gradient and filter parameters. mergekit lives in its
own environment ($SHARDFUSE_MERGEKIT_PYTHON, made by .ci/run; tests/support/mergekit_runner.py runs every
YAML in one process); in CI a missing one fails, elsewhere the test is skipped. The method functions
alone: test_mergekit_reference.py.

The folders: a "pretrained" GPT-2 of three layers made locally (scripts/make-pretrained.py) and three
"fine-tunes" of it (its float tensors plus a shared and an own seeded noise, so task vectors agree in part
as real ones do: model_stock's mean cosine is positive, where shardfuse clamps it and mergekit does not).
Every tensor size is a multiple of 4 and the TIES densities quarters, so TIES keeps the same count under
mergekit's int() and shardfuse's round() (the translation's note says so). mergekit works in float32:
deterministic methods agree within 1e-6. DARE and DELLA draw from different random streams and rescale
differently (1/p against mergekit's L1 norm): compared in distribution (the share of entries left at the
base, the L1 norm of the merged task vector, its correlation with the mean task vector).
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

from tests.support.helpers import call_stage, subprocess_env
from tests.support.hf import require_transformers
from tests.support.tracking import service_unavailable

pytestmark = pytest.mark.bench
REPO = Path(__file__).resolve().parents[2]
WEIGHTS = "model.safetensors"
GRADIENT = [0.2, 0.5, 0.8]
DENSITIES = [{"filter": "mlp", "value": 0.5}, {"value": 0.25}]


def models(*entries):
    return [{"model": name, **({"parameters": p} if p else {})} for name, p in entries]


AB = models(("A", None), ("B", None))
ABC = models(("A", None), ("B", None), ("C", None))
ATTN_FILTER = [{"filter": "attn", "value": 3.0}, {"value": 1.0}]
DENSITY_FILTERS = models(*[(m, {"density": DENSITIES}) for m in "ABC"])
TIES = {"merge_method": "ties", "base_model": "BASE"}
GTA = {"base_model": "BASE", "models": AB}
# name: (the YAML with A, B, C and BASE for the folders, how to compare, the same YAML with one value per
# parameter where the case's gradient or filter must matter)
CASES = {
    "linear_weight_filters": (
        {"merge_method": "linear", "models": models(("A", {"weight": ATTN_FILTER}), ("B", {"weight": 1.0}))},
        "exact",
        {"merge_method": "linear", "models": models(("A", {"weight": 1.0}), ("B", {"weight": 1.0}))},
    ),
    "task_arithmetic_gradient": (
        {"merge_method": "task_arithmetic", "base_model": "BASE",
         "models": models(("A", {"weight": GRADIENT}), ("B", {"weight": GRADIENT}))},
        "exact",
        {"merge_method": "task_arithmetic", "base_model": "BASE",
         "models": models(("A", {"weight": 0.5}), ("B", {"weight": 0.5}))},
    ),
    "ties_density_filters": (
        {**TIES, "parameters": {"lambda": 0.9, "weight": 1.0}, "models": DENSITY_FILTERS},
        "exact",
        {**TIES, "parameters": {"lambda": 0.9, "weight": 1.0, "density": 0.25}, "models": ABC},
    ),
    "breadcrumbs_ties": (
        {**GTA, "merge_method": "breadcrumbs_ties",
         "parameters": {"normalize": True, "weight": 1.0, "density": 0.75, "gamma": 0.125}},
        "exact", None,
    ),
    "breadcrumbs_gradient": (
        {**GTA, "merge_method": "breadcrumbs",
         "parameters": {"weight": 0.5, "density": [0.5, 1.0], "gamma": 0.0625}},
        "exact", None,
    ),
    "slerp_gradient": (
        {"merge_method": "slerp", "base_model": "A", "parameters": {"t": [0.0, 0.5, 1.0]}, "models": AB},
        "exact",
        {"merge_method": "slerp", "base_model": "A", "parameters": {"t": 0.5}, "models": AB},
    ),
    "model_stock": ({"merge_method": "model_stock", "base_model": "BASE", "models": ABC}, "exact", None),
    "sce": (
        {"merge_method": "sce", "base_model": "BASE", "parameters": {"select_topk": 0.5}, "models": ABC},
        "exact", None,
    ),
    "multislerp": (
        {"merge_method": "multislerp",
         "models": models(("A", {"weight": 1.0}), ("B", {"weight": 2.0}), ("C", {"weight": 1.0}))},
        "exact", None,
    ),
    "karcher": ({"merge_method": "karcher", "models": ABC}, "exact", None),
    "nuslerp": (
        {"merge_method": "nuslerp", "models": models(("A", {"weight": 1.0}), ("B", {"weight": 3.0}))},
        "exact", None,
    ),
    "dare_ties": (
        {**GTA, "merge_method": "dare_ties",
         "parameters": {"normalize": True, "weight": 1.0, "density": 0.5}},
        "distribution", None,
    ),
    "dare_linear": (
        {**GTA, "merge_method": "dare_linear", "parameters": {"weight": 0.5, "density": 0.5}},
        "distribution", None,
    ),
    "della": (
        {**GTA, "merge_method": "della", "parameters": {"weight": 1.0, "density": 0.5, "epsilon": 0.1}},
        "distribution", None,
    ),
    "della_linear": (
        {**GTA, "merge_method": "della_linear",
         "parameters": {"weight": 0.5, "density": 0.5, "epsilon": 0.1}},
        "distribution", None,
    ),
}  # fmt: skip


def mergekit_python() -> Path:
    python = Path(os.environ.get("SHARDFUSE_MERGEKIT_PYTHON", "/tmp/mkvenv/bin/python"))
    if not os.access(python.parent / "mergekit-yaml", os.X_OK):
        service_unavailable(
            f"no mergekit-yaml beside {python}: python3 -m venv V && V/bin/pip install torch==2.13.0 "
            "mergekit==0.1.5, then set SHARDFUSE_MERGEKIT_PYTHON=V/bin/python"
        )
    return python


def placed(config: dict, root: Path) -> dict:
    """The YAML with the folders' absolute paths (mergekit reads a relative name as a Hub id)."""
    text = json.dumps(config)
    for key in ("BASE", "A", "B", "C"):
        text = text.replace(f'"{key}"', json.dumps(str(root / key.lower())))
    return json.loads(text)


@pytest.fixture(scope="module")
def merged(tmp_path_factory) -> dict:
    """Every case merged by mergekit (one process) and by shardfuse (the stage's command line)."""
    require_transformers()
    python = mergekit_python()
    root = tmp_path_factory.mktemp("mergekit-folders")
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "make-pretrained.py"), str(root / "base"), "--layers", "3"],
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    base = load_file(str(root / "base" / WEIGHTS))
    shared = np.random.default_rng(0)
    common = {k: shared.normal(0, 0.02, v.shape) for k, v in base.items()}  # what every fine-tune learnt
    for name, seed in (("a", 1), ("b", 2), ("c", 3)):
        shutil.copytree(root / "base", root / name)
        rng = np.random.default_rng(seed)
        tuned = {k: (v + common[k] + rng.normal(0, 0.02, v.shape)).astype(v.dtype) for k, v in base.items()}
        save_file(tuned, str(root / name / WEIGHTS), metadata={"format": "pt"})
    args = []
    for case, (config, _, twin) in CASES.items():
        for suffix, cfg in (("", config), ("-twin", twin)):
            if cfg is not None:
                (root / f"{case}{suffix}.yml").write_text(
                    yaml.safe_dump({**placed(cfg, root), "dtype": "float32"})
                )
        args += [str(root / f"{case}.yml"), str(root / f"mk-{case}")]
    proc = subprocess.run(
        [str(python), str(REPO / "tests" / "support" / "mergekit_runner.py"), *args],
        capture_output=True, text=True, timeout=900, env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {"root": root, "base": base}


def shardfuse_merge(root: Path, name: str) -> dict[str, np.ndarray]:
    out = root / f"sf-{name}"
    proc = call_stage("merge", "--mergekit", root / f"{name}.yml", "--out", out)
    assert proc.returncode == 0, proc.stderr
    assert (
        json.loads((out / "merge.json").read_text())["mergekit_method"]
        == yaml.safe_load((root / f"{name}.yml").read_text())["merge_method"]
    )
    return load_file(str(out / WEIGHTS))


@pytest.mark.parametrize("case", sorted(CASES))
def test_shardfuse_merges_the_yaml_as_mergekit_does(merged, case):
    root, (_, compare, twin) = merged["root"], CASES[case]
    theirs = load_file(str(root / f"mk-{case}" / WEIGHTS))
    mine = shardfuse_merge(root, case)
    assert set(theirs) == set(mine) and all(theirs[k].dtype == mine[k].dtype for k in theirs)
    if compare == "exact":
        worst = max((float(np.max(np.abs(theirs[k].astype(np.float64) - mine[k]))), k) for k in theirs)
        assert worst[0] < 1e-6, worst
        if twin is not None:  # the gradient or filter mattered: one value per parameter merges otherwise
            constant = shardfuse_merge(root, f"{case}-twin")
            assert max(float(np.max(np.abs(constant[k] - mine[k]))) for k in mine) > 1e-4
        return
    base = merged["base"]
    taus = {
        k: np.concatenate([(t[k].astype(np.float64) - base[k]).ravel() for k in sorted(base)])
        for k, t in (("mk", theirs), ("sf", mine))
    }
    tuned = [load_file(str(root / n / WEIGHTS)) for n in "ab"]
    mean_tau = np.concatenate(
        [np.mean([t[k] - base[k] for t in tuned], axis=0).ravel() for k in sorted(base)]
    )
    left = {k: float(np.mean(np.abs(v) < 1e-7)) for k, v in taus.items()}
    assert abs(left["mk"] - left["sf"]) < 0.02, left  # the same share of entries dropped everywhere
    norms = {k: float(np.sum(np.abs(v))) for k, v in taus.items()}
    assert abs(norms["sf"] / norms["mk"] - 1) < 0.05, norms  # rescaled alike on average
    for v in taus.values():
        assert np.corrcoef(v, mean_tau)[0, 1] > 0.5  # both are the mean task vector, thinned
