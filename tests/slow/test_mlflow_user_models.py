"""The logged models of user models (a ``package.module:function`` factory under a code path): each is
loaded and predicts in a fresh process in another directory, where the original code is unreachable
(mlflow.pyfunc from the logged code alone). Slow tier: each test starts Python processes that import
MLflow and torch (about 19 s together); the built-in models' logged models are tested in the fast tier
(tests/stages/test_mlflow_model.py, whose helpers and fixtures these share)."""

# ruff: noqa: F811 (the tests take the imported fixtures store and workdir as arguments)
from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import torch

from shardfuse.models.spec import model_spec
from tests.support.mlflow_models import (  # noqa: F401 (store, workdir: the fixtures)
    IRIS,
    LOG_WITHOUT_TORCH,
    TEXT,
    _env,
    _features,
    _log,
    _model_dir,
    _outputs,
    _predict_elsewhere,
    _save,
    store,
    workdir,
)


def test_user_model_loads_from_its_logged_code_where_the_original_code_is_unreachable(
    store, tmp_path, workdir
):
    info = {**IRIS, "feature_names": ["a", "b", "c", "d"], "label_names": ["cat", "dog", "emu"]}
    spec = model_spec("sf_resmlp:build", {"width": 12}, ["code"], info)
    model, sha = _save(workdir / "merged.safetensors", spec)
    # Logged as the track job logs it: a process that imports neither torch nor the user's code.
    run_id = store["client"].create_run(store["experiment_id"]).info.run_id
    proc = subprocess.run(
        [sys.executable, "-c", LOG_WITHOUT_TORCH, store["uri"], run_id, "merged.safetensors", sha],
        cwd=workdir, env=_env(store), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert logged["heavy"] == []
    uri = f"models:/{logged['model_id']}"
    code = _model_dir(store, uri) / "code"
    assert sorted(p.name for p in code.iterdir()) == [
        "sf_blocks.py",
        "sf_filed.py",
        "sf_lm",
        "sf_resmlp.py",
        "shardfuse",
    ]

    (workdir / "code").rename(workdir / "code-moved")
    elsewhere = tmp_path / "elsewhere"
    (elsewhere / "code").mkdir(parents=True)  # the spec's relative code path, here holding a decoy
    for name in ("sf_resmlp.py", "sf_blocks.py"):
        (elsewhere / "code" / name).write_text("raise RuntimeError('decoy: not the logged code')\n")
    frame = _features(info)
    predicted = _predict_elsewhere(store, uri, frame, elsewhere)

    expected = torch.softmax(torch.from_numpy(_outputs(model, frame)), dim=1).numpy()
    assert predicted["prediction"].tolist() == [info["label_names"][c] for c in expected.argmax(1)]
    np.testing.assert_allclose(predicted.iloc[:, 1:].to_numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_user_model_ships_its_model_files_and_pins_its_third_party_imports(store, tmp_path, workdir):
    (workdir / "assets").mkdir()
    (workdir / "assets" / "shape.yaml").write_text("width: 7\n")
    spec = model_spec("sf_filed:build", {}, ["code"], IRIS, model_files=["assets"])
    assert spec["code"]["model_files"] == ["assets"] and "assets/shape.yaml" in spec["code"]["files"]
    model, sha = _save(workdir / "merged.safetensors", spec)
    uri = _log(store, workdir / "merged.safetensors", sha, spec)
    requirements = (_model_dir(store, uri) / "requirements.txt").read_text().split()
    assert any(line.startswith("PyYAML==") for line in requirements), requirements

    (workdir / "assets").rename(workdir / "assets-moved")  # the source folder is gone
    (workdir / "code").rename(workdir / "code-moved")
    frame = _features(IRIS)
    predicted = _predict_elsewhere(store, uri, frame, tmp_path / "elsewhere")
    expected = torch.softmax(torch.from_numpy(_outputs(model, frame)), dim=1).numpy()
    np.testing.assert_allclose(predicted.iloc[:, 1:].to_numpy(), expected, rtol=1e-6, atol=1e-6)


def test_causal_lm_user_model_gives_next_token_probabilities_of_the_last_block(store, tmp_path, workdir):
    spec = model_spec("sf_lm.bag:build", {"width": 8}, ["code"], TEXT)
    model, sha = _save(workdir / "merged.safetensors", spec)
    uri = _log(store, workdir / "merged.safetensors", sha, spec)
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, 11, size=n).tolist() for n in (1, 3, 3, 6, 9, 14)]  # 9, 14: truncated
    predicted = _predict_elsewhere(store, uri, pd.DataFrame({"tokens": sequences}), tmp_path / "elsewhere")

    assert list(predicted.columns) == [f"probability_{token}" for token in range(11)]
    probabilities = predicted.to_numpy()
    np.testing.assert_allclose(probabilities.sum(axis=1), 1.0, atol=1e-5)
    with torch.no_grad():
        expected = [torch.softmax(model(torch.tensor([s[-6:]]))[0, -1], dim=0).numpy() for s in sequences]
    np.testing.assert_allclose(probabilities, np.stack(expected), rtol=1e-6, atol=1e-6)
    with torch.no_grad():  # the context counts: the last token alone predicts otherwise
        alone = torch.softmax(model(torch.tensor([sequences[4][-1:]]))[0, -1], dim=0).numpy()
    assert np.abs(alone - probabilities[4]).max() > 1e-3
