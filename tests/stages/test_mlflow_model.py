"""The merged model as an MLflow pyfunc model, for every task and for user models with their code.

Models are built from hand-written dataset descriptions (no training), logged with the track stage's
function into a SQLite store, then loaded with ``mlflow.pyfunc.load_model`` (user models and the causal
LM in a fresh Python process whose working directory is elsewhere) and compared with the same weights
run in this process.
"""

# ruff: noqa: F811 (the tests take the imported fixtures store and workdir as arguments)
from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlflow
import numpy as np
import pandas as pd
import pytest
import torch

from shardfuse.checkpoints.weights import save_weights
from shardfuse.io import UserError
from shardfuse.models.registry import build_model
from shardfuse.models.spec import model_spec
from shardfuse.prepare import prepare
from shardfuse.track import model as mlflow_model
from shardfuse.track import model_logging
from tests.support.mlflow_models import (  # noqa: F401 (store, workdir: the fixtures)
    IRIS,
    LOG_WITHOUT_TORCH,
    PREDICT_ELSEWHERE,
    PRICES,
    TEXT,
    USER_CODE,
    _env,
    _features,
    _log,
    _model_dir,
    _outputs,
    _predict_elsewhere,
    _predict_here,
    _save,
    store,
    workdir,
)


def test_classifier_predicts_the_data_labels_and_a_probability_column_per_label(store, tmp_path, monkeypatch):
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], IRIS)
    model, sha = _save(tmp_path / "merged.safetensors", spec)
    uri = _log(store, tmp_path / "merged.safetensors", sha, spec)
    frame = _features(IRIS)
    # Columns are found by name: another order and an extra column change nothing.
    shuffled = frame[frame.columns[::-1]].assign(row_id=np.arange(len(frame)))
    predicted = _predict_here(store, uri, shuffled, monkeypatch)

    expected = torch.softmax(torch.from_numpy(_outputs(model, frame)), dim=1).numpy()
    probability_columns = [f"probability_{label}" for label in IRIS["label_names"]]
    assert list(predicted.columns) == ["prediction", *probability_columns]
    assert predicted["prediction"].tolist() == [IRIS["label_names"][c] for c in expected.argmax(1)]
    np.testing.assert_allclose(predicted[probability_columns].to_numpy(), expected, rtol=1e-6, atol=1e-6)
    signature = mlflow.models.get_model_info(uri).signature
    assert signature.inputs.input_names() == IRIS["feature_names"]
    assert signature.outputs.to_dict()[0] == {"type": "string", "name": "prediction", "required": True}


def test_regressor_returns_one_column_per_named_target_in_the_target_units(store, tmp_path, monkeypatch):
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], PRICES)
    model, sha = _save(tmp_path / "merged.safetensors", spec)
    uri = _log(store, tmp_path / "merged.safetensors", sha, spec)
    frame = _features(PRICES)
    predicted = _predict_here(store, uri, frame, monkeypatch)

    assert list(predicted.columns) == PRICES["target_names"]
    expected = _outputs(model, frame)
    assert np.abs(expected).mean() > 10  # the target scale is applied: not standardised outputs
    np.testing.assert_allclose(predicted.to_numpy(), expected, rtol=1e-6, atol=1e-6)


def test_a_csv_model_with_a_categorical_feature_takes_raw_text_rows_and_predicts_the_label_strings(
    store, tmp_path, monkeypatch
):
    """A CSV with a text feature (categorical_columns) and a text label, prepared as the stage does: the
    logged model takes the original text column, one-hot encodes it with dataset.json's vocabulary (a
    category the train split lacks: all zeros) and names the labels as the file spelled them."""
    rng = np.random.default_rng(3)
    colours, labels = rng.choice(["red", "green", "blue"], 90), rng.choice(["cat", "dog", "eel"], 90)
    lines = [
        "size,colour,animal",
        *(f"{rng.normal():.3f},{c},{a}" for c, a in zip(colours, labels, strict=True)),
    ]
    (tmp_path / "pets.csv").write_text("\n".join(lines) + "\n")
    dataset = {"source": "csv", "path": str(tmp_path / "pets.csv"), "feature_columns": ["size", "colour"]}
    dataset |= {"label_column": "animal", "categorical_columns": ["colour"]}
    info = prepare("pets", dataset, tmp_path / "pets")
    assert info["categories"] == {"colour": ["blue", "green", "red"]}
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], info)
    model, sha = _save(tmp_path / "merged.safetensors", spec)
    uri = _log(store, tmp_path / "merged.safetensors", sha, spec)
    raw = pd.DataFrame({"size": [0.5, -1.0, 2.0, 0.1], "colour": ["red", "blue", "mauve", "green"]})
    predicted = _predict_here(store, uri, raw, monkeypatch)

    one_hot = [[1.0 if c == v else 0.0 for v in ["blue", "green", "red"]] for c in raw["colour"]]
    encoded = pd.DataFrame(np.column_stack([raw["size"], one_hot]), columns=info["feature_names"])
    assert encoded.iloc[2, 1:].sum() == 0  # mauve: an unseen category
    expected = torch.softmax(torch.from_numpy(_outputs(model, encoded)), dim=1).numpy()
    assert info["label_names"] == ["cat", "dog", "eel"]
    assert predicted["prediction"].tolist() == [info["label_names"][c] for c in expected.argmax(1)]
    probability_columns = [f"probability_{label}" for label in info["label_names"]]
    np.testing.assert_allclose(predicted[probability_columns].to_numpy(), expected, rtol=1e-6, atol=1e-6)
    signature = mlflow.models.get_model_info(uri).signature
    assert _typed_names(signature.inputs) == [("size", "double"), ("colour", "string")]


def test_a_model_logged_before_the_package_layout_loads_in_a_process_that_imported_this_version(
    store, tmp_path, monkeypatch
):
    """Models logged before the package layout name ``shardfuse.mlflow_model`` as their loader."""
    spec = model_spec("mlp", {"hidden_sizes": [8]}, [], IRIS)
    model, sha = _save(tmp_path / "merged.safetensors", spec)
    logged = _model_dir(store, _log(store, tmp_path / "merged.safetensors", sha, spec))
    old = shutil.copytree(logged, tmp_path / "old-layout")
    mlmodel = (old / "MLmodel").read_text()
    assert "loader_module: shardfuse.track.model" in mlmodel
    (old / "MLmodel").write_text(mlmodel.replace("shardfuse.track.model", "shardfuse.mlflow_model"))
    frame = _features(IRIS)
    predicted = _predict_here(store, str(old), frame, monkeypatch)
    expected = torch.softmax(torch.from_numpy(_outputs(model, frame)), dim=1).numpy()
    probability_columns = [f"probability_{label}" for label in IRIS["label_names"]]
    np.testing.assert_allclose(predicted[probability_columns].to_numpy(), expected, rtol=1e-6, atol=1e-6)


def _typed_names(schema) -> list[tuple[str, str]]:
    columns = schema.to_dict()
    return [
        (c["name"], c["type"] if c["type"] != "array" else f"array<{c['items']['type']}>") for c in columns
    ]


def _spec(task: str, **description) -> dict:
    """A hand-written spec: only the description matters to the signature."""
    return {
        "model": "mlp",
        "args": {},
        "task": task,
        "code": None,
        "description": {"task": task, **description},
    }


@pytest.mark.parametrize(
    ("spec", "inputs", "outputs"),
    [
        (
            _spec("classification", num_features=2, num_outputs=2, feature_names=["h", "w"],
                  label_names=["no", "yes"]),
            [("h", "double"), ("w", "double")],
            [("prediction", "string"), ("probability_no", "float"), ("probability_yes", "float")],
        ),
        (
            _spec("regression", num_features=2, num_outputs=1, feature_names=[], label_names=["target"]),
            [("x0", "double"), ("x1", "double")],
            [("target", "float")],
        ),
        (
            _spec("causal_lm", num_features=4, num_outputs=3, feature_names=[], label_names=[], block_size=4),
            [("tokens", "array<long>")],
            [("probability_0", "float"), ("probability_1", "float"), ("probability_2", "float")],
        ),
        (
            {"type": "mlp", "num_features": 2, "num_classes": 2, "hidden_sizes": [], "activation": "relu",
             "dropout": 0.0},
            [("x0", "double"), ("x1", "double")],
            [("prediction", "long"), ("probability_0", "float"), ("probability_1", "float")],
        ),
    ],
    ids=["classification", "regression", "causal_lm", "legacy"],
)  # fmt: skip
def test_signature_and_input_example_use_the_data_names_per_task(spec, inputs, outputs):
    signature = mlflow_model.model_signature(spec)
    assert _typed_names(signature.inputs) == inputs
    assert _typed_names(signature.outputs) == outputs
    assert list(mlflow_model.input_example(spec).columns) == [name for name, _ in inputs]


def test_predict_names_the_missing_columns_and_the_expected_ones(tmp_path):
    names = [f"pixel_{i // 8}_{i % 8}" for i in range(64)]
    info = {"task": "classification", "num_features": 64, "num_classes": 2, "feature_names": names}
    spec = model_spec("mlp", {"hidden_sizes": []}, [], {**info, "label_names": ["0", "1"]})
    _save(tmp_path / "merged.safetensors", spec)
    model = mlflow_model.MergedModel(tmp_path / "merged.safetensors")
    legacy = pd.DataFrame(np.zeros((1, 64)), columns=[f"x{i}" for i in range(64)])
    with pytest.raises(UserError) as err:
        model.predict(legacy)
    assert str(err.value) == (
        "input lacks column(s) pixel_0_0, pixel_0_1, pixel_0_2, pixel_0_3, pixel_0_4 (and 59 more); the "
        "model takes 64 column(s): pixel_0_0, pixel_0_1, pixel_0_2, pixel_0_3, …, pixel_7_7"
    )
    assert model.predict(pd.DataFrame(np.zeros((1, 64)), columns=names))["prediction"].tolist() == ["0"]


def test_bad_token_rows_are_refused_with_the_row_named(tmp_path, workdir):
    spec = model_spec("sf_lm.bag:build", {}, ["code"], TEXT)
    _save(tmp_path / "merged.safetensors", spec)
    model = mlflow_model.MergedModel(tmp_path / "merged.safetensors")
    with pytest.raises(UserError, match=r"^row 1 holds token id 11, outside the vocabulary 0\.\.10$"):
        model.predict(pd.DataFrame({"tokens": [[1, 2], [3, 11]]}))
    with pytest.raises(UserError, match=r"^row 0 of column 'tokens' is not a non-empty sequence of int"):
        model.predict(pd.DataFrame({"tokens": [[]]}))


def test_user_code_changed_since_training_is_refused_before_anything_is_logged(tmp_path, workdir):
    spec = model_spec("sf_resmlp:build", {}, ["code"], IRIS)
    _, sha = _save(workdir / "merged.safetensors", spec)
    blocks = workdir / "code" / "sf_blocks.py"
    blocks.write_text(blocks.read_text().replace("tanh", "relu"))
    db = tmp_path / "never.db"
    with pytest.raises(UserError, match=r"^user model code code/sf_blocks\.py changed since training"):
        model_logging.log_merged_model(f"sqlite:///{db}", "0" * 32, workdir / "merged.safetensors", sha, spec)
    assert not db.exists()


def test_a_factory_module_outside_the_code_paths_must_be_importable(tmp_path):
    spec = {
        **model_spec("mlp", {}, [], IRIS),
        "model": "sf_nowhere:build",
        "code": {"paths": [], "files": {}},
    }
    message = (
        "model 'sf_nowhere:build': module 'sf_nowhere' is neither in the run's code paths nor importable "
        "here, so the logged model could not import it; add its directory to `code_paths`"
    )
    with pytest.raises(UserError) as err:
        model_logging.log_merged_model(f"sqlite:///{tmp_path}/x.db", "0" * 32, tmp_path / "w", "0", spec)
    assert str(err.value) == message


def test_a_factory_module_outside_the_code_paths_is_copied_or_if_installed_pinned(tmp_path, monkeypatch):
    outside = tmp_path / "on_pythonpath"
    shutil.copytree(USER_CODE, outside)
    monkeypatch.syspath_prepend(str(outside))
    no_code = {"paths": [], "files": {}}
    staged = model_logging._code_paths({"model": "sf_lm.bag:build", "code": no_code}, tmp_path / "a")
    assert [Path(path).name for path in staged[0]] == ["shardfuse", "sf_lm"] and staged[1] == []
    assert sorted(p.name for p in (tmp_path / "a" / "sf_lm").iterdir()) == ["__init__.py", "bag.py"]
    staged = model_logging._code_paths({"model": "yaml:safe_load", "code": no_code}, tmp_path / "b")
    assert [Path(path).name for path in staged[0]] == ["shardfuse"] and staged[1] == ["PyYAML"]
    assert "PyYAML==" in " ".join(model_logging._requirements(staged[1]))


def test_a_text_classifier_takes_token_rows_pads_them_as_prepare_did_and_predicts_the_label_strings(
    store, tmp_path, monkeypatch
):
    """A JSON Lines text classification dataset (jsonl, task classification) and the built-in
    transformer over it: the logged model takes token id rows of any length, keeps the first block_size
    of each and pads the rest with dataset.json's pad id (as prepare made its rows), and returns the
    labels as the records spelled them."""
    lines = [
        json.dumps({"text": f"{word} number {i}", "kind": word}) for i in range(30) for word in ("cat", "dog")
    ]
    (tmp_path / "pets.jsonl").write_text("\n".join(lines) + "\n")
    dataset = {"source": "jsonl", "task": "classification", "paths": [str(tmp_path / "pets.jsonl")]}
    info = prepare("pets", {**dataset, "label_field": "kind", "block_size": 8}, tmp_path / "pets")
    spec = model_spec("transformer", {"width": 16, "layers": 1, "heads": 2}, [], info)
    torch.manual_seed(0)
    model = build_model(spec).eval()
    sha = save_weights(tmp_path / "merged.safetensors", model.state_dict(), {"model": spec})
    uri = _log(store, tmp_path / "merged.safetensors", sha, spec)
    texts = [b"cat", b"dog number 12345", b"x"]
    predicted = _predict_here(store, uri, pd.DataFrame({"tokens": [list(t) for t in texts]}), monkeypatch)

    rows = torch.full((3, 8), info["pad_id"], dtype=torch.long)  # by hand: the head, then padding
    for index, text in enumerate(texts):
        rows[index, : min(len(text), 8)] = torch.tensor(list(text[:8]))
    with torch.no_grad():
        expected = torch.softmax(model(rows), dim=1).numpy()
    assert info["label_names"] == ["cat", "dog"]
    assert predicted["prediction"].tolist() == [info["label_names"][c] for c in expected.argmax(1)]
    np.testing.assert_allclose(
        predicted[["probability_cat", "probability_dog"]].to_numpy(), expected, rtol=1e-6
    )
    signature = mlflow.models.get_model_info(uri).signature
    assert signature.inputs.to_dict()[0]["name"] == "tokens"
    with pytest.raises(UserError, match=r"outside the vocabulary 0\.\.256"):
        _predict_here(store, uri, pd.DataFrame({"tokens": [[300]]}), monkeypatch)
