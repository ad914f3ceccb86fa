"""Categorical feature columns of a csv or parquet dataset (``categorical_columns``): one-hot encoded with
a vocabulary of the train split's values only, recorded in dataset.json with the unseen categories of each
split; a text feature column without it, and bad ``categorical_columns``, refused by the config check
before any job (and by prepare); missing values and other types refused by prepare. The logged model's
side: tests/stages/test_mlflow_model.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfuse.data.sources.spec import validate_spec
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError
from shardfuse.prepare import prepare
from tests.support.helpers import base_config

SPLITS = ("train", "val", "test")
# Three common colours and 30 rare ones, a row each: some rare ones fall outside the train split.
RARE = [f"rare{i:02d}" for i in range(30)]


def colour_rows(num_rows: int = 240) -> dict[str, list]:
    rng = np.random.default_rng(7)
    colours = rng.choice(["red", "green", "blue"], num_rows).tolist()
    colours[: len(RARE)] = RARE
    return {
        "a": rng.normal(size=num_rows).tolist(),
        "colour": colours,
        "b": rng.normal(size=num_rows).tolist(),
        "y": ["yes" if i % 2 else "no" for i in range(num_rows)],
    }


def write_csv(path: Path, columns: dict[str, list]) -> Path:
    names = list(columns)
    lines = [",".join(names)] + [",".join(str(v) for v in row) for row in zip(*columns.values(), strict=True)]
    path.write_text("\n".join(lines) + "\n")
    return path


def csv_spec(path: Path, **changes) -> dict:
    spec = {
        "source": "csv",
        "path": str(path),
        "feature_columns": ["a", "colour", "b"],
        "label_column": "y",
        "categorical_columns": ["colour"],
    }
    return {**spec, **changes}


def split_tables(out_dir: Path) -> dict[str, pa.Table]:
    return {split: pq.read_table(out_dir / f"{split}.parquet") for split in SPLITS}


def test_the_vocabulary_is_the_train_splits_values_and_unseen_values_are_zeros_counted_per_split(tmp_path):
    path = write_csv(tmp_path / "data.csv", colour_rows())
    # keep_columns carries the raw colour beside the one-hot block, so each row can be checked.
    info = prepare("d", csv_spec(path, keep_columns=["colour"]), tmp_path / "out")
    tables = split_tables(tmp_path / "out")
    vocabulary = info["categories"]["colour"]
    assert vocabulary == sorted(set(tables["train"]["colour"].to_pylist()))
    assert info["feature_names"] == ["a", *[f"colour={value}" for value in vocabulary], "b"]
    assert info["num_features"] == len(vocabulary) + 2
    unseen = {}
    for split, table in tables.items():
        colours = table["colour"].to_pylist()
        block = np.stack([table[f"x{1 + j}"].to_numpy() for j in range(len(vocabulary))], axis=1)
        expected = np.array([[float(c == v) for v in vocabulary] for c in colours], dtype=np.float32)
        np.testing.assert_array_equal(block, expected)  # a 1 at its category, or all zeros if unseen
        unseen[split] = {"colour": sum(c not in vocabulary for c in colours)}
    assert info["unseen_categories"] == unseen
    assert unseen["train"]["colour"] == 0 and unseen["test"]["colour"] > 0
    recorded = json.loads((tmp_path / "out" / "dataset.json").read_text())
    assert recorded["categories"] == info["categories"]


def test_the_numeric_columns_keep_their_values_beside_the_one_hot_block(tmp_path):
    columns = colour_rows()
    path = write_csv(tmp_path / "data.csv", columns)
    prepare("d", csv_spec(path, keep_columns=["a", "b"]), tmp_path / "out")
    for table in split_tables(tmp_path / "out").values():
        np.testing.assert_allclose(table["x0"].to_numpy(), table["a"].to_numpy(), rtol=1e-6)
        last = table.schema.names[table.schema.names.index("label") - 1]
        np.testing.assert_allclose(table[last].to_numpy(), table["b"].to_numpy(), rtol=1e-6)


def test_integer_and_boolean_categories_sort_as_values_and_are_named_by_their_text(tmp_path):
    num_rows = 60
    path = tmp_path / "data.parquet"
    pq.write_table(
        pa.table(
            {
                "size": pa.array([10, 2, 3] * (num_rows // 3), pa.int64()),
                "member": pa.array([True, False] * (num_rows // 2)),
                "kind": pa.array(["p", "q", "r"] * (num_rows // 3)).dictionary_encode(),
                "y": [i % 2 for i in range(num_rows)],
            }
        ),
        path,
    )
    names = ["size", "member", "kind"]
    spec = {"source": "parquet", "path": str(path), "feature_columns": names, "label_column": "y"}
    info = prepare("d", {**spec, "categorical_columns": names}, tmp_path / "out")
    assert info["categories"] == {
        "size": ["2", "3", "10"],
        "member": ["False", "True"],
        "kind": ["p", "q", "r"],
    }
    assert info["feature_names"][:3] == ["size=2", "size=3", "size=10"]


def test_a_class_filter_keeps_the_categorical_rows_of_the_kept_classes(tmp_path):
    columns = colour_rows()
    columns["y"] = [f"c{i % 3}" for i in range(len(columns["y"]))]
    path = write_csv(tmp_path / "data.csv", columns)
    info = prepare("d", csv_spec(path, classes=["c0", "c1"], keep_columns=["colour"]), tmp_path / "out")
    train = split_tables(tmp_path / "out")["train"]
    assert info["categories"]["colour"] == sorted(set(train["colour"].to_pylist()))
    assert sum(info["rows"].values()) == 160


def test_a_spec_without_categorical_columns_records_no_categories(tmp_path):
    path = write_csv(tmp_path / "data.csv", colour_rows())
    spec = csv_spec(path, feature_columns=["a", "b"])
    del spec["categorical_columns"]
    info = prepare("d", spec, tmp_path / "out")
    assert "categories" not in info and "unseen_categories" not in info
    assert info["feature_names"] == ["a", "b"]


def test_the_parts_of_a_domains_dataset_add_up_their_unseen_categories(tmp_path):
    path = write_csv(tmp_path / "data.csv", colour_rows())
    part = prepare("p", csv_spec(path), tmp_path / "p")
    prepare("q", csv_spec(path), tmp_path / "q")
    union = prepare("u", {"source": "domains", "parts": ["p", "q"]}, tmp_path / "u")
    assert union["categories"] == part["categories"]
    assert union["unseen_categories"]["test"]["colour"] == 2 * part["unseen_categories"]["test"]["colour"]


# ---------------------------------------------------------------- refused by prepare


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (
            lambda c: c["colour"].__setitem__(40, ""),
            "categorical column 'colour' in {path} has 1 missing value(s); fill them with a category of "
            "their own (e.g. 'unknown') or drop those rows",
        ),
        (
            lambda c: c.__setitem__("colour", [0.5 * i for i in range(len(c["colour"]))]),
            "categorical column 'colour' in {path} has type double; a categorical column holds strings, "
            "integers or booleans: drop it from categorical_columns",
        ),
        (
            lambda c: c.__setitem__("colour=red", c.pop("b")),
            "feature name 'colour=red' of a categorical column's one-hot block is also a feature column of "
            "{path}; rename that column in the file",
        ),
    ],
    ids=["missing", "float", "name_taken"],
)
def test_prepare_refuses_a_missing_category_another_type_and_a_taken_name(tmp_path, change, message):
    columns = colour_rows()
    change(columns)
    path = write_csv(tmp_path / "data.csv", columns)
    features = ["a", "colour", "colour=red" if "colour=red" in columns else "b"]
    with pytest.raises(UserError) as caught:
        prepare("d", csv_spec(path, feature_columns=features), tmp_path / "out")
    assert str(caught.value) == message.format(path=path)
    assert not (tmp_path / "out" / "dataset.json").exists()


def test_prepare_refuses_a_text_feature_column_naming_categorical_columns(tmp_path):
    path = write_csv(tmp_path / "data.csv", colour_rows())
    spec = csv_spec(path)
    del spec["categorical_columns"]
    with pytest.raises(UserError) as caught:
        prepare("d", spec, tmp_path / "out")
    assert str(caught.value) == (
        f"feature column 'colour' in {path} has type string, not a number; list it in categorical_columns "
        "(one-hot encoded) or drop it from feature_columns"
    )


# ---------------------------------------------------------------- refused before any job


def config_of(dataset: dict) -> dict:
    config = base_config({"r": {}})
    config["datasets"] = {"d": dataset}
    config["run_defaults"]["dataset"] = "d"
    return config


def parquet_with_text(tmp_path: Path) -> Path:
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table(colour_rows()), path)
    return path


@pytest.mark.parametrize("source", ["csv", "parquet"])
def test_the_config_refuses_a_text_feature_column_without_categorical_columns(tmp_path, source):
    path = write_csv(tmp_path / "data.csv", colour_rows()) if source == "csv" else parquet_with_text(tmp_path)
    spec = csv_spec(path, source=source)
    load_experiment(config_of(spec), environ={})  # categorical: fine
    del spec["categorical_columns"]
    with pytest.raises(ConfigError) as caught:
        load_experiment(config_of(spec), environ={})
    assert str(caught.value) == (
        f"config error at datasets.d.feature_columns: column 'colour' of {path} has type string, not a "
        "number; list it in categorical_columns (one-hot encoded) or drop it from feature_columns"
    )


def test_the_config_reads_a_csvs_first_mib_and_prepare_catches_text_further_down(tmp_path):
    num_rows = 120_000  # over 1 MiB of rows whose colour is a number
    columns = {
        "a": list(range(num_rows)),
        "colour": list(range(num_rows)),
        "y": [i % 2 for i in range(num_rows)],
    }
    columns["colour"][-1] = "red"
    path = write_csv(tmp_path / "data.csv", columns)
    assert path.stat().st_size > 1 << 20
    spec = {"source": "csv", "path": str(path), "feature_columns": ["a", "colour"], "label_column": "y"}
    load_experiment(config_of(spec), environ={})  # the first MiB holds numbers
    with pytest.raises(UserError, match=r"feature column 'colour' in .* has type string, not a number"):
        prepare("d", spec, tmp_path / "out")


def test_the_config_check_passes_a_file_it_cannot_read_yet(tmp_path):
    spec = csv_spec(tmp_path / "made_by_another_rule.csv")
    load_experiment(config_of(spec), environ={})


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"categorical_columns": ["colour", "z"]},
            "categorical_columns: names 'z', which is not among feature_columns; list it in feature_columns "
            "too, or drop it from categorical_columns",
        ),
        (
            {"categorical_columns": ["y"]},
            "categorical_columns: names 'y', a target column (labels are coded by their own vocabulary, "
            "label_names); drop it from categorical_columns",
        ),
        (
            {"feature_shape": [3]},
            "categorical_columns: cannot go with feature_shape (a tensor has no one-hot block); drop one",
        ),
        (
            {"categorical_columns": ["colour", "a"]},
            "categorical_columns: column 'a' of {path} has type double; a categorical column holds "
            "strings, integers or booleans: drop it from categorical_columns",
        ),
    ],
    ids=["not_a_feature", "the_label", "feature_shape", "float_column"],
)
def test_bad_categorical_columns_are_refused_before_any_job(tmp_path, changes, message):
    path = parquet_with_text(tmp_path)
    spec = csv_spec(path, source="parquet", **changes)
    with pytest.raises(ConfigError) as caught:
        load_experiment(config_of(spec), environ={})
    assert str(caught.value) == f"config error at datasets.d.{message.format(path=path)}"


@pytest.mark.parametrize(
    ("categorical", "message"),
    [
        (["colour", "colour"], "must be a non-empty list of distinct column names, got ['colour', 'colour']"),
        (["z"], "names 'z', which is not among feature_columns"),
    ],
)
def test_prepare_refuses_bad_categorical_columns_before_reading_the_file(tmp_path, categorical, message):
    spec = csv_spec(tmp_path / "never_read.csv", categorical_columns=categorical)
    with pytest.raises(UserError) as caught:
        validate_spec(spec)
    assert f"spec key 'categorical_columns' {message}" in str(caught.value)
