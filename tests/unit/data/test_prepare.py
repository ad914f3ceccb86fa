"""Prepare: schema, stratified seeded train/val/test split, byte-identical outputs, chunked synthetic data,
user files, and the regression and causal_lm tasks (diabetes, synthetic regression, text)."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfuse.data.sources import synthetic as synthetic_module
from shardfuse.data.sources.spec import validate_spec
from shardfuse.io import UserError, sha256_file
from shardfuse.prepare import prepare
from tests.support.helpers import run_stage

REPO = Path(__file__).resolve().parents[3]
SYNTHETIC = {"source": "synthetic", "num_rows": 3000, "num_features": 5, "num_classes": 4, "seed": 3}
SPLITS = ("train", "val", "test")


def read_split(out_dir: Path, split: str) -> pa.Table:
    return pq.read_table(out_dir / f"{split}.parquet")


def class_counts(table: pa.Table, num_classes: int) -> np.ndarray:
    return np.bincount(table["label"].to_numpy(), minlength=num_classes)


def all_splits(out_dir: Path) -> pa.Table:
    return pa.concat_tables([read_split(out_dir, split) for split in SPLITS])


def assert_stratified(
    out_dir: Path, num_classes: int, test_fraction: float, val_fraction: float = 0.1
) -> None:
    train, val, test = (class_counts(read_split(out_dir, split), num_classes) for split in SPLITS)
    total = train + val + test
    assert np.all(np.abs(test - total * test_fraction) <= 1), (test, total * test_fraction)
    assert np.all(np.abs(val - total * val_fraction) <= 1), (val, total * val_fraction)
    assert np.all(test >= 1) and np.all(train >= 1)


def directory_bytes(path: Path) -> dict[str, bytes]:
    """Every output file's bytes (hidden files are caches: .sha256-stamps.json holds mtimes)."""
    return {name: (path / name).read_bytes() for name in sorted(os.listdir(path)) if not name.startswith(".")}


@pytest.fixture(scope="module")
def digits_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("digits")
    prepare("digits", {"source": "digits", "test_fraction": 0.2, "seed": 0}, out_dir)
    return out_dir


def test_digits_split_has_the_house_schema_and_all_rows(digits_dir):
    train, val, test = (read_split(digits_dir, split) for split in SPLITS)
    expected_schema = pa.schema(
        [*(pa.field(f"x{j}", pa.float32()) for j in range(64)), pa.field("label", pa.int64())]
    )
    assert all(split.schema.equals(expected_schema) for split in (train, val, test))
    assert train.num_rows + val.num_rows + test.num_rows == 1797
    assert 0.19 < test.num_rows / 1797 < 0.21 and 0.09 < val.num_rows / 1797 < 0.11
    assert set(all_splits(digits_dir)["label"].to_numpy()) == set(range(10))


def test_digits_split_is_stratified_within_one_row_per_class(digits_dir):
    assert_stratified(digits_dir, 10, 0.2)


def test_dataset_json_describes_the_split_and_its_checksums(digits_dir):
    info = json.loads((digits_dir / "dataset.json").read_text())
    assert info["name"] == "digits" and info["source"] == "digits" and info["task"] == "classification"
    assert (info["num_features"], info["num_classes"]) == (64, 10)
    assert info["input"] == {"kind": "numeric", "shape": [64], "dtype": "float32"}
    assert info["feature_names"][:2] == ["pixel_0_0", "pixel_0_1"] and len(info["feature_names"]) == 64
    assert info["label_names"] == [str(d) for d in range(10)]
    assert info["rows"] == {split: read_split(digits_dir, split).num_rows for split in SPLITS}
    assert (info["test_fraction"], info["val_fraction"], info["seed"]) == (0.2, 0.1, 0)
    assert info["sha256"] == {split: sha256_file(digits_dir / f"{split}.parquet") for split in SPLITS}


def test_digits_is_byte_identical_when_prepared_again_and_the_seed_changes_the_split(digits_dir, tmp_path):
    prepare("digits", {"source": "digits", "test_fraction": 0.2, "seed": 0}, tmp_path / "again")
    assert directory_bytes(tmp_path / "again") == directory_bytes(digits_dir)
    prepare("digits", {"source": "digits", "test_fraction": 0.2, "seed": 1}, tmp_path / "other")
    assert read_split(tmp_path / "other", "test") != read_split(digits_dir, "test")


def test_synthetic_is_byte_identical_for_the_same_spec_and_differs_for_another_seed(tmp_path):
    prepare("syn", SYNTHETIC, tmp_path / "a")
    prepare("syn", SYNTHETIC, tmp_path / "b")
    assert directory_bytes(tmp_path / "a") == directory_bytes(tmp_path / "b")
    prepare("syn", {**SYNTHETIC, "seed": 4}, tmp_path / "c")
    assert read_split(tmp_path / "c", "train") != read_split(tmp_path / "a", "train")


def test_synthetic_rows_do_not_depend_on_the_writer_row_group_size(tmp_path):
    prepare("syn", SYNTHETIC, tmp_path / "default")
    prepare("syn", SYNTHETIC, tmp_path / "small", row_group_rows=7)
    for split in SPLITS:
        assert read_split(tmp_path / "small", split).equals(read_split(tmp_path / "default", split))
        assert (
            pq.read_metadata(tmp_path / "small" / f"{split}.parquet").num_row_groups > 10
        )  # layout did change


def test_synthetic_generation_across_many_chunks_is_stratified_and_balanced(tmp_path, monkeypatch):
    monkeypatch.setattr(
        synthetic_module, "SYNTHETIC_CHUNK_VALUES", 64 * SYNTHETIC["num_features"]
    )  # 64-row chunks
    spec = {**SYNTHETIC, "num_rows": 1001, "test_fraction": 0.3}
    info = prepare("syn", spec, tmp_path)
    assert sum(info["rows"].values()) == 1001
    assert_stratified(tmp_path, 4, 0.3)
    totals = class_counts(all_splits(tmp_path), 4)
    assert totals.max() - totals.min() <= 1


def test_synthetic_chunks_do_not_depend_on_the_total_row_count(tmp_path, monkeypatch):
    # Each chunk has its own random stream keyed by (seed, chunk index): growing the dataset by whole
    # chunks appends rows and leaves the earlier ones untouched.
    monkeypatch.setattr(synthetic_module, "SYNTHETIC_CHUNK_VALUES", 100 * SYNTHETIC["num_features"])
    prepare("syn", {**SYNTHETIC, "num_rows": 400}, tmp_path / "small")
    prepare("syn", {**SYNTHETIC, "num_rows": 700}, tmp_path / "large")
    for split in SPLITS:
        small, large = read_split(tmp_path / "small", split), read_split(tmp_path / "large", split)
        assert large.num_rows > small.num_rows
        assert large.slice(0, small.num_rows).equals(small)


def nearest_centroid_accuracy(out_dir: Path, num_features: int) -> float:
    def arrays(split):
        table = read_split(out_dir, split)
        return np.column_stack([table[f"x{j}"].to_numpy() for j in range(num_features)]), table[
            "label"
        ].to_numpy()

    (train_x, train_y), (test_x, test_y) = arrays("train"), arrays("test")
    centroids = np.stack([train_x[train_y == c].mean(axis=0) for c in np.unique(train_y)])
    predicted = np.argmin(((test_x[:, None, :] - centroids[None]) ** 2).sum(axis=2), axis=1)
    return float(np.mean(predicted == test_y))


def test_synthetic_class_sep_controls_how_much_the_features_tell_about_the_label(tmp_path):
    prepare("syn", {**SYNTHETIC, "class_sep": 4.0}, tmp_path / "separated")
    prepare("syn", {**SYNTHETIC, "class_sep": 0.0}, tmp_path / "overlapping")
    assert nearest_centroid_accuracy(tmp_path / "separated", 5) > 0.8
    assert nearest_centroid_accuracy(tmp_path / "overlapping", 5) < 0.4  # chance is 0.25


def test_synthetic_with_too_few_rows_per_class_is_rejected(tmp_path):
    with pytest.raises(UserError, match=r"num_rows=8 is too small .* use num_rows >= 12"):
        prepare("syn", {**SYNTHETIC, "num_rows": 8, "test_fraction": 0.2}, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_csv_source_keeps_feature_order_and_maps_string_labels_in_sorted_order(tmp_path):
    rows = ["row_id,width,species,height"]
    species = ["dog", "cat", "bird", "dog", "cat", "bird", "dog", "cat", "bird", "dog"]
    rows += [f"{i},{i * 10},{name},{i + 0.5}" for i, name in enumerate(species)]
    (tmp_path / "pets.csv").write_text("\n".join(rows) + "\n")
    spec = {"source": "csv", "path": str(tmp_path / "pets.csv"), "feature_columns": ["height", "row_id"],
            "label_column": "species", "test_fraction": 0.3, "seed": 0}  # fmt: skip
    info = prepare("pets", spec, tmp_path / "out")

    assert info["feature_names"] == ["height", "row_id"]
    assert info["label_names"] == ["bird", "cat", "dog"]
    assert info["rows"] == {"train": 4, "val": 3, "test": 3}  # one test and one val row per class
    table = all_splits(tmp_path / "out")
    assert table.column_names == ["x0", "x1", "label"]
    for height, row_id, label in zip(*(table[c].to_pylist() for c in table.column_names), strict=True):
        assert height == row_id + 0.5
        assert info["label_names"][label] == species[int(row_id)]


def test_parquet_source_maps_integer_labels_in_numeric_order(tmp_path):
    labels = [33, 2, 10, 33, 2, 10, 2]
    pq.write_table(pa.table({"f": np.arange(7, dtype=np.int32), "y": labels}), tmp_path / "in.parquet")
    spec = {
        "source": "parquet",
        "path": str(tmp_path / "in.parquet"),
        "feature_columns": ["f"],
        "label_column": "y",
    }
    info = prepare("ints", spec, tmp_path / "out")
    assert info["label_names"] == ["2", "10", "33"]
    table = all_splits(tmp_path / "out")
    assert table.schema.field("x0").type == pa.float32()
    for feature, code in zip(table["x0"].to_pylist(), table["label"].to_pylist(), strict=True):
        assert int(info["label_names"][code]) == labels[int(feature)]


def test_decimal_columns_are_read_as_float32_and_the_cast_is_recorded(tmp_path):
    """A Parquet decimal128 column (a database export) was refused as 'not a number'; its values are now
    read exactly as float32 and dataset.json names each decimal column with its type; the config check
    takes them too."""
    from decimal import Decimal

    from shardfuse.data.sources.columns import parquet_problem

    prices = [Decimal(f"{cents / 100:.2f}") for cents in range(-150, 150, 3)]
    targets = [Decimal(f"{(cents % 17) / 8:.3f}") for cents in range(100)]
    table = pa.table(
        {
            "price": pa.array(prices, pa.decimal128(10, 2)),
            "plain": np.arange(100, dtype=np.float64),
            "y": pa.array(targets, pa.decimal128(12, 3)),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet")
    spec = {
        "source": "parquet",
        "path": str(tmp_path / "in.parquet"),
        "feature_columns": ["price", "plain"],
        "label_columns": ["y"],
        "task": "regression",
    }
    assert parquet_problem(spec) is None
    info = prepare("decimals", validate_spec(spec), tmp_path / "out")
    assert info["decimal_casts"] == {"price": "decimal128(10, 2)", "y": "decimal128(12, 3)"}
    written = all_splits(tmp_path / "out")
    values = zip(written["x0"].to_pylist(), written["y0"].to_pylist(), strict=True)
    by_plain = dict(zip(written["x1"].to_pylist(), values, strict=True))
    for row in range(100):
        price, target = by_plain[float(row)]
        assert price == np.float32(float(prices[row])) and target == np.float32(float(targets[row]))


def test_a_file_sorted_by_label_is_written_in_a_seeded_random_order(tmp_path):
    num_rows = 2000
    labels = np.repeat(np.arange(4), num_rows // 4)  # sorted by label, as exported files often are
    pq.write_table(
        pa.table({"f": np.arange(num_rows, dtype=np.float32), "y": labels}), tmp_path / "sorted.parquet"
    )
    spec = {
        "source": "parquet",
        "path": str(tmp_path / "sorted.parquet"),
        "feature_columns": ["f"],
        "label_column": "y",
        "seed": 3,
    }
    prepare("sorted", spec, tmp_path / "out")
    train = read_split(tmp_path / "out", "train")
    first_tenth = train["label"].to_numpy()[: train.num_rows // 10]
    assert len(set(first_tenth.tolist())) == 4  # every class early on, not one class per quarter
    assert sorted(train["x0"].to_pylist()) != train["x0"].to_pylist()
    prepare("sorted", spec, tmp_path / "again")
    assert read_split(tmp_path / "again", "train").equals(train)  # the order is seeded


BASE_CSV = "a,b,kind,y\n1,2,red,p\n3,4,blue,q\n5,6,red,p\n7,8,blue,q\n9,10,red,p\n"


@pytest.mark.parametrize(
    ("csv_text", "spec_changes", "message"),
    [
        (None, {}, r"dataset file .*missing\.csv does not exist"),
        (
            BASE_CSV,
            {"feature_columns": ["a", "zz"]},
            r"'zz' not found in .*; available columns: a, b, kind, y",
        ),
        (
            BASE_CSV,
            {"feature_columns": ["a", "kind"]},
            r"feature column 'kind' .* has type string, not a number",
        ),
        (BASE_CSV.replace("3,4", "3,"), {}, r"feature column 'b' .* has 1 missing value"),
        (BASE_CSV.replace("9,10", "9,inf"), {}, r"feature column 'b' .* 1 NaN or infinite value"),
        (BASE_CSV.replace("red,p\n3", "red,\n3"), {}, r"label column 'y' .* has 1 missing value"),
        (BASE_CSV + "11,12,red,z\n", {}, r"label value\(s\) 'z' .* have a single row"),
        (BASE_CSV.replace(",q\n", ",p\n"), {}, r"label column 'y' .* has a single value 'p'"),
        (
            BASE_CSV,
            {"source": "hdf5"},
            r"unknown dataset source 'hdf5'; use one of csv, diabetes, digits, digits_images, domains, "
            r"hf_disk, image_folder, jsonl, npz, parquet, synthetic, text",
        ),
        (BASE_CSV, {"colour": 1}, r"unknown key\(s\) 'colour' in the 'csv' dataset spec; valid keys are"),
        (BASE_CSV, {"test_fraction": 1.5}, r"'test_fraction' must be a number strictly between 0 and 1"),
        (BASE_CSV, {"val_fraction": 1.0}, r"'val_fraction' must be a number in \[0, 1\), got 1.0"),
        (BASE_CSV, {"val_fraction": "0.1"}, r"'val_fraction' must be a number in \[0, 1\)"),
        (BASE_CSV, {"val_fraction": 0.8}, r"test_fraction \+ val_fraction = 1 leaves no training rows"),
        (BASE_CSV, {"label_column": "a"}, r"'label_column' must be a column name not among feature_columns"),
        (BASE_CSV, {"source": "parquet"}, r"cannot read .* as parquet"),
    ],
)
def test_bad_user_data_or_spec_is_a_one_line_user_error_with_no_output(
    tmp_path, csv_text, spec_changes, message
):
    path = tmp_path / ("missing.csv" if csv_text is None else "data.csv")
    if csv_text is not None:
        path.write_text(csv_text)
    spec = {
        "source": "csv",
        "path": str(path),
        "feature_columns": ["a", "b"],
        "label_column": "y",
        **spec_changes,
    }
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


def test_nan_in_parquet_features_is_rejected(tmp_path):
    pq.write_table(pa.table({"a": [1.0, float("nan"), 3.0, 4.0], "y": [0, 1, 0, 1]}), tmp_path / "in.parquet")
    spec = {
        "source": "parquet",
        "path": str(tmp_path / "in.parquet"),
        "feature_columns": ["a"],
        "label_column": "y",
    }
    with pytest.raises(UserError, match=r"feature column 'a' .* 1 NaN or infinite"):
        prepare("nan", spec, tmp_path / "out")


def run_prepare_cli(tmp_path: Path, spec_json: str) -> subprocess.CompletedProcess:
    return run_stage("prepare", "--name", "cli", "--spec-json", spec_json, "--out-dir", tmp_path / "out")


@pytest.mark.parametrize(
    ("spec_json", "fragment"),
    [
        ("{source: digits}", "--spec-json is not valid JSON"),
        ('{"source": "mnist"}', "unknown dataset source 'mnist'"),
    ],
)
def test_cli_errors_exit_2_with_one_line(tmp_path, spec_json, fragment):
    result = run_prepare_cli(tmp_path, spec_json)
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("shardfuse.prepare: error: ") and fragment in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_writes_split_and_dataset_json(tmp_path):
    result = run_prepare_cli(tmp_path, json.dumps({**SYNTHETIC, "num_rows": 100}))
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "out")) == [
        ".sha256-stamps.json",
        "dataset.json",
        "test.parquet",
        "train.parquet",
        "val.parquet",
    ]
    rows = json.loads((tmp_path / "out" / "dataset.json").read_text())["rows"]
    assert rows["test"] == 20 and rows["train"] + rows["val"] == 80 and abs(rows["val"] - 10) <= 4
    assert "val" in result.stdout


# ---------------------------------------------------------------- the validation split


def row_set(table: pa.Table) -> set[tuple]:
    return set(zip(*(table[name].to_pylist() for name in table.column_names), strict=True))


@pytest.mark.parametrize("spec", [{"source": "digits"}, SYNTHETIC], ids=["digits", "synthetic"])
def test_val_split_comes_from_the_training_rows_and_leaves_the_test_split_unchanged(tmp_path, spec):
    prepare("d", {**spec, "val_fraction": 0.0}, tmp_path / "none")
    info = prepare("d", {**spec, "val_fraction": 0.15}, tmp_path / "some")
    assert (tmp_path / "some" / "test.parquet").read_bytes() == (
        tmp_path / "none" / "test.parquet"
    ).read_bytes()
    train_and_val = row_set(read_split(tmp_path / "some", "train")) | row_set(
        read_split(tmp_path / "some", "val")
    )
    assert train_and_val == row_set(read_split(tmp_path / "none", "train"))
    assert not row_set(read_split(tmp_path / "some", "val")) & row_set(read_split(tmp_path / "some", "train"))
    assert_stratified(tmp_path / "some", info["num_classes"], 0.2, 0.15)


def test_val_fraction_zero_writes_an_empty_val_split_with_the_schema(tmp_path):
    for spec in ({"source": "digits", "val_fraction": 0}, {**SYNTHETIC, "val_fraction": 0}):
        info = prepare("d", spec, tmp_path / spec["source"])
        val = read_split(tmp_path / spec["source"], "val")
        assert val.num_rows == 0 == info["rows"]["val"]
        assert val.schema.equals(read_split(tmp_path / spec["source"], "train").schema)


def test_synthetic_val_split_is_stratified_across_many_chunks(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic_module, "SYNTHETIC_CHUNK_VALUES", 50 * SYNTHETIC["num_features"])
    info = prepare(
        "syn", {**SYNTHETIC, "num_rows": 2003, "test_fraction": 0.25, "val_fraction": 0.2}, tmp_path
    )
    assert sum(info["rows"].values()) == 2003
    assert_stratified(tmp_path, 4, 0.25, 0.2)


def test_a_class_too_small_for_a_val_row_keeps_its_training_row(tmp_path):
    pq.write_table(pa.table({"f": np.arange(6.0), "y": [0, 0, 1, 1, 1, 1]}), tmp_path / "in.parquet")
    spec = {"source": "parquet", "path": str(tmp_path / "in.parquet"), "feature_columns": ["f"],
            "label_column": "y", "test_fraction": 0.3, "val_fraction": 0.3}  # fmt: skip
    prepare("tiny", spec, tmp_path / "out")
    train, val = (class_counts(read_split(tmp_path / "out", split), 2) for split in ("train", "val"))
    assert train.tolist() == [1, 2] and val.tolist() == [0, 1]


# ---------------------------------------------------------------- tasks: regression and causal_lm


SYNTHETIC_REGRESSION = {"source": "synthetic", "task": "regression", "num_rows": 3000, "num_features": 6,
                        "num_outputs": 2, "seed": 5}  # fmt: skip


def columns(table: pa.Table, prefix: str) -> np.ndarray:
    names = [name for name in table.column_names if name[0] == prefix and name[1:].isdigit()]
    return np.column_stack([table[name].to_numpy() for name in names])


def expected_regression_schema(num_features: int, num_targets: int) -> pa.Schema:
    return pa.schema(
        [pa.field(f"x{j}", pa.float32()) for j in range(num_features)]
        + [pa.field(f"y{k}", pa.float32()) for k in range(num_targets)]
    )


@pytest.fixture(scope="module")
def diabetes_dir(tmp_path_factory) -> Path:
    out_dir = tmp_path_factory.mktemp("diabetes")
    prepare("diabetes", {"source": "diabetes"}, out_dir)
    return out_dir


def test_diabetes_is_a_regression_dataset_with_float_targets(diabetes_dir):
    from sklearn.datasets import load_diabetes

    info = json.loads((diabetes_dir / "dataset.json").read_text())
    assert (info["task"], info["num_classes"], info["label_names"]) == ("regression", 0, [])
    assert info["target_names"] == ["target"] and info["num_features"] == 10
    assert info["feature_names"] == list(load_diabetes().feature_names)
    assert sum(info["rows"].values()) == 442 and info["rows"]["test"] == 88  # round(442 * 0.2)
    table = all_splits(diabetes_dir)
    assert all(
        read_split(diabetes_dir, split).schema.equals(expected_regression_schema(10, 1)) for split in SPLITS
    )
    expected = load_diabetes()
    rows = np.column_stack([columns(table, "x"), columns(table, "y")])
    expected_rows = np.column_stack([expected.data, expected.target]).astype(np.float32)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, expected_rows.tolist()))


@pytest.mark.parametrize(
    "spec", [{"source": "diabetes"}, SYNTHETIC_REGRESSION], ids=["diabetes", "synthetic_regression"]
)
def test_regression_val_split_comes_from_the_training_rows_and_leaves_the_test_split_unchanged(
    tmp_path, spec
):
    prepare("d", {**spec, "val_fraction": 0.0}, tmp_path / "none")
    info = prepare("d", {**spec, "val_fraction": 0.15}, tmp_path / "some")
    assert (tmp_path / "some" / "test.parquet").read_bytes() == (
        tmp_path / "none" / "test.parquet"
    ).read_bytes()
    some_train, some_val = (row_set(read_split(tmp_path / "some", split)) for split in ("train", "val"))
    assert some_train | some_val == row_set(read_split(tmp_path / "none", "train"))
    assert not some_train & some_val
    total = sum(info["rows"].values())
    assert abs(info["rows"]["val"] - 0.15 * total) <= 1 and abs(info["rows"]["test"] - 0.2 * total) <= 1


def test_synthetic_regression_targets_depend_on_the_features(tmp_path):
    info = prepare("reg", SYNTHETIC_REGRESSION, tmp_path)
    assert info["target_names"] == ["y0", "y1"] and info["feature_names"] == [f"x{j}" for j in range(6)]
    assert read_split(tmp_path, "train").schema.equals(expected_regression_schema(6, 2))
    table = all_splits(tmp_path)
    features, targets = columns(table, "x"), columns(table, "y")
    assert np.all(np.abs(targets.std(axis=0) - 1) < 0.15)  # the function's std is about 1, noise adds 0.1
    # The known function explains all but the noise (default 0.1) ...
    function = synthetic_module.synthetic_regression_function(validate_spec(SYNTHETIC_REGRESSION))
    residual = targets - function(features)
    assert np.all(np.abs(residual.std(axis=0) - 0.1) < 0.01)
    # ... and a plain linear fit already explains most of the variance; shuffled targets it does not.
    design = np.column_stack([features, np.ones(len(features))])

    def explained(y: np.ndarray) -> np.ndarray:
        fitted = design @ np.linalg.lstsq(design, y, rcond=None)[0]
        return 1 - ((y - fitted) ** 2).sum(axis=0) / ((y - y.mean(axis=0)) ** 2).sum(axis=0)

    assert np.all(explained(targets) > 0.5)
    assert np.all(explained(np.random.default_rng(0).permutation(targets)) < 0.02)


def test_synthetic_regression_noise_zero_gives_the_function_itself(tmp_path):
    spec = {**SYNTHETIC_REGRESSION, "num_rows": 500, "noise": 0}
    prepare("reg", spec, tmp_path)
    table = all_splits(tmp_path)
    function = synthetic_module.synthetic_regression_function(validate_spec(spec))
    expected = function(columns(table, "x")).astype(np.float32)
    assert np.array_equal(columns(table, "y"), expected)


def test_synthetic_regression_across_many_chunks_splits_the_exact_fractions(tmp_path, monkeypatch):
    monkeypatch.setattr(synthetic_module, "SYNTHETIC_CHUNK_VALUES", 400)  # 10-row chunks
    info = prepare("reg", {**SYNTHETIC_REGRESSION, "num_rows": 1001, "test_fraction": 0.3}, tmp_path / "a")
    assert info["rows"] == {"train": 601, "val": 100, "test": 300}
    monkeypatch.setattr(synthetic_module, "SYNTHETIC_CHUNK_VALUES", 1 << 22)
    prepare("reg", {**SYNTHETIC_REGRESSION, "num_rows": 1001, "test_fraction": 0.3}, tmp_path / "b")
    assert read_split(tmp_path / "b", "train").num_rows == 601  # chunking changes the draws, not the split


def write_regression_csv(path: Path) -> None:
    rows = ["id,speed,kind,dist,time"]
    rows += [f"{i},{i * 2},{'ab'[i % 2]},{i * 3.5},{i / 4}" for i in range(20)]
    path.write_text("\n".join(rows) + "\n")


def test_regression_from_csv_keeps_user_column_names(tmp_path):
    write_regression_csv(tmp_path / "trips.csv")
    spec = {"source": "csv", "task": "regression", "path": str(tmp_path / "trips.csv"),
            "feature_columns": ["speed", "id"], "label_columns": ["time", "dist"]}  # fmt: skip
    info = prepare("trips", spec, tmp_path / "out")
    assert info["feature_names"] == ["speed", "id"] and info["target_names"] == ["time", "dist"]
    assert (info["num_classes"], info["label_names"]) == (0, [])
    table = all_splits(tmp_path / "out")
    assert table.column_names == ["x0", "x1", "y0", "y1"] and table.num_rows == 20
    for speed, row_id, time, dist in zip(*(table[c].to_pylist() for c in table.column_names), strict=True):
        assert (speed, time, dist) == (row_id * 2, row_id / 4, row_id * 3.5)


@pytest.mark.parametrize(
    "spec",
    [
        SYNTHETIC_REGRESSION,
        {"source": "diabetes", "seed": 2},
        {"source": "text", "paths": ["corpus/*.txt"], "block_size": 8},
    ],
    ids=["synthetic_regression", "diabetes", "text"],
)
def test_same_spec_gives_identical_files_for_regression_and_text(tmp_path, monkeypatch, spec):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(np.random.default_rng(0).bytes(300))
    prepare("d", spec, tmp_path / "a")
    prepare("d", spec, tmp_path / "b", row_group_rows=5)
    for split in SPLITS:
        assert read_split(tmp_path / "b", split).equals(read_split(tmp_path / "a", split))
    prepare("d", spec, tmp_path / "c")
    assert directory_bytes(tmp_path / "c") == directory_bytes(tmp_path / "a")
    prepare("d", {**spec, "seed": spec.get("seed", 0) + 1}, tmp_path / "other")
    assert read_split(tmp_path / "other", "train") != read_split(tmp_path / "a", "train")


def test_integral_float_labels_are_classes(tmp_path):
    labels = [1.0, 2.0, 3.0] * 4
    pq.write_table(pa.table({"f": np.arange(12.0), "y": labels}), tmp_path / "in.parquet")
    spec = {"source": "parquet", "path": str(tmp_path / "in.parquet"), "feature_columns": ["f"],
            "label_column": "y", "classes": [2, 3]}  # fmt: skip
    info = prepare("floats", spec, tmp_path / "out")
    assert info["label_names"] == ["1.0", "2.0", "3.0"]
    assert set(all_splits(tmp_path / "out")["label"].to_pylist()) == {1, 2}


def test_classes_keep_the_full_label_space(digits_dir, tmp_path):
    info = prepare("digits", {"source": "digits", "classes": [0, "3", 7]}, tmp_path / "digits")
    full = json.loads((digits_dir / "dataset.json").read_text())
    assert (info["num_classes"], info["label_names"]) == (10, full["label_names"])
    counts = sum(class_counts(read_split(tmp_path / "digits", split), 10) for split in SPLITS)
    full_counts = sum(class_counts(read_split(digits_dir, split), 10) for split in SPLITS)
    assert np.array_equal(counts, np.where(np.isin(np.arange(10), [0, 3, 7]), full_counts, 0))
    train, test = (class_counts(read_split(tmp_path / "digits", split), 10) for split in ("train", "test"))
    assert np.all(test[[0, 3, 7]] >= 1) and np.all(train[[0, 3, 7]] >= 1)  # still stratified

    info = prepare("syn", {**SYNTHETIC, "classes": ["1", "2"]}, tmp_path / "syn")
    assert info["num_classes"] == 4 and info["label_names"] == ["0", "1", "2", "3"]
    assert set(all_splits(tmp_path / "syn")["label"].to_pylist()) == {1, 2}
    assert 1300 < sum(info["rows"].values()) < 1700  # half of 3000 rows


TEXT_FILES = {"b/two.txt": 400, "a.txt": 250, "b/deeper/three.txt": 120, "b/notes.skip.txt": 90}


def write_text_files(root: Path) -> bytes:
    """Random bytes (so every block is unique) in TEXT_FILES; returns what the text source should read
    from root/**/*.txt excluding *.skip.*: the kept files sorted by path, joined by a newline."""
    rng = np.random.default_rng(7)
    contents = {}
    for name, size in TEXT_FILES.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        contents[name] = rng.bytes(size)
        (root / name).write_bytes(contents[name])
    kept = sorted((str(root / name), data) for name, data in contents.items() if ".skip." not in name)
    return b"\n".join(data for _, data in kept)


def token_rows(out_dir: Path) -> np.ndarray:
    """The token blocks of all splits as a (rows, block_size + 1) array of the column's own dtype."""
    table = all_splits(out_dir)
    assert table.column_names == ["tokens"] and pa.types.is_fixed_size_list(table.schema.field(0).type)
    column = table["tokens"].combine_chunks()
    return column.flatten().to_numpy().reshape(len(column), column.type.list_size)


def blocks_of(out_dir: Path) -> list[bytes]:
    rows = token_rows(out_dir)
    assert rows.dtype == np.uint16
    return [bytes(row) for row in rows.astype(np.uint8).tolist()]


def test_text_blocks_hold_the_files_bytes(tmp_path):
    joined = write_text_files(tmp_path / "corpus")
    spec = {"source": "text", "paths": [str(tmp_path / "corpus" / "**" / "*.txt")], "exclude": ["*.skip.*"],
            "block_size": 15}  # fmt: skip
    info = prepare("text", spec, tmp_path / "out")
    num_blocks = len(joined) // 16
    assert (info["task"], info["num_classes"], info["label_names"]) == ("causal_lm", 0, [])
    assert (info["vocab_size"], info["block_size"], info["num_tokens"]) == (256, 15, len(joined))
    assert info["num_features"] == 16 and info["feature_names"] == [f"t{j}" for j in range(16)]
    assert info["input"] == {"kind": "tokens", "shape": [16], "dtype": "uint16"} and info["tokenizer"] is None
    assert read_split(tmp_path / "out", "train").schema == pa.schema(
        [pa.field("tokens", pa.list_(pa.uint16(), 16))]
    )
    assert sum(info["rows"].values()) == num_blocks and info["rows"]["test"] == round(num_blocks * 0.2)
    # Rows are shuffled: every block of the joined bytes appears exactly once, the tail is dropped.
    expected = [joined[i * 16 : (i + 1) * 16] for i in range(num_blocks)]
    assert sorted(blocks_of(tmp_path / "out")) == sorted(expected)


def test_text_paths_are_relative_to_the_working_directory_and_max_tokens_stops_reading(tmp_path, monkeypatch):
    joined = write_text_files(tmp_path)
    monkeypatch.chdir(tmp_path)
    spec = {
        "source": "text",
        "paths": ["**/*.txt"],
        "exclude": ["*.skip.*"],
        "block_size": 9,
        "max_tokens": 333,
    }
    info = prepare("text", spec, tmp_path / "out")
    assert info["num_tokens"] == 333 and sum(info["rows"].values()) == 33
    assert sorted(blocks_of(tmp_path / "out")) == sorted(joined[i * 10 : (i + 1) * 10] for i in range(33))


def test_text_without_matching_files_is_an_error(tmp_path):
    spec = {"source": "text", "paths": [str(tmp_path / "nowhere" / "*.txt")], "block_size": 8}
    with pytest.raises(UserError, match=r"no file matches the text dataset's paths \[.*nowhere/\*\.txt'\]"):
        prepare("text", spec, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_text_too_short_for_three_blocks_is_an_error(tmp_path):
    (tmp_path / "short.txt").write_bytes(b"x" * 20)
    spec = {"source": "text", "paths": [str(tmp_path / "short.txt")], "block_size": 7}
    with pytest.raises(UserError, match=r"20 tokens, 2 block\(s\) .*: add text or lower block_size"):
        prepare("text", spec, tmp_path / "out")


def test_each_source_defaults_to_its_task():
    tasks = {
        source: validate_spec({"source": source, **keys})["task"]
        for source, keys in {
            "digits": {},
            "diabetes": {},
            "synthetic": {"num_rows": 10, "num_features": 1, "num_classes": 2},
            "csv": {"path": "x.csv", "feature_columns": ["a"], "label_column": "y"},
            "text": {"paths": ["*.txt"], "block_size": 4},
            "digits_images": {},
            "image_folder": {"path": "images", "image_size": [8, 8]},
            "npz": {"path": "x.npz"},
        }.items()
    }
    assert tasks == {"digits": "classification", "diabetes": "regression", "synthetic": "classification",
                     "csv": "classification", "text": "causal_lm", "digits_images": "classification",
                     "image_folder": "classification", "npz": "classification"}  # fmt: skip


@pytest.mark.parametrize(
    ("table_columns", "spec_changes", "message"),
    [
        (
            {"a": [1.0, 2, 3, 4], "b": ["x", "y", "z", "w"]},
            {"task": "regression", "label_columns": ["b"]},
            r"regression target column 'b' in .*in\.parquet has type string; regression needs numeric "
            r"targets — use task: classification or pick numeric columns",
        ),
        (
            {"a": [1.0, 2, 3, 4], "b": [0.37, 1.5, 0.37, 1.5]},
            {"label_column": "b"},
            r"label column 'b' in .*in\.parquet holds non-integer floats \(e\.g\. 0\.37\); a classification "
            r"label must be a class — use task: regression with label_columns: \[b\]",
        ),
        (
            {"a": [1.0, 2, 3, 4], "b": [0, 1, 0, 1]},
            {"classes": [0, 5]},
            r"class 5 in spec key 'classes' is not a label of this dataset; valid labels: 0, 1$",
        ),
        (
            {"a": [1.0, 2, 3, 4], "b": [3, 1, 3, 1]},
            {"classes": [3, "3.0"]},  # distinct as written, one class once read: never a 1-class dataset
            r"spec key 'classes' names label '3' twice \(3 and '3\.0'\); list each class once$",
        ),
        (
            {},
            {"task": "causal_lm"},
            r"source 'parquet' cannot do task 'causal_lm'; use task: classification or",
        ),
        ({}, {"task": "ranking"}, r"spec key 'task' must be one of classification, regression, causal_lm"),
        ({}, {"task": "regression"}, r"the 'parquet' dataset spec \(task regression\) lacks 'label_columns'"),
        (
            {},
            {"task": "regression", "label_columns": ["b"], "classes": [1]},
            r"spec key\(s\) 'classes', 'label_column' only apply to task 'classification'",
        ),
        ({}, {"label_columns": ["b"]}, r"spec key\(s\) 'label_columns' only apply to task 'regression'"),
        ({}, {"classes": []}, r"spec key 'classes' must be a list of 2 or more distinct label values"),
        ({}, {"classes": [3]}, r"a classifier needs at least 2 classes\), got \[3\]"),
    ],
)
def test_bad_task_input_is_a_one_line_user_error_with_no_output(
    tmp_path, table_columns, spec_changes, message
):
    pq.write_table(pa.table(table_columns or {"a": [1.0, 2.0]}), tmp_path / "in.parquet")
    spec = {"source": "parquet", "path": str(tmp_path / "in.parquet"), "feature_columns": ["a"],
            "label_column": "b", **spec_changes}  # fmt: skip
    if spec_changes.get("task") == "regression" and "classes" not in spec_changes:
        del spec["label_column"]
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value)
    assert not (tmp_path / "out").exists() or not os.listdir(tmp_path / "out")


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": "digits", "task": "regression"}, r"source 'digits' cannot do task 'regression'"),
        (
            {"source": "diabetes", "classes": [1]},
            r"unknown key\(s\) 'classes' in the 'diabetes' dataset spec",
        ),
        ({**SYNTHETIC, "task": "regression"}, r"'num_classes' only apply to task 'classification'"),
        ({**SYNTHETIC_REGRESSION, "num_outputs": 0}, r"'num_outputs' must be an integer >= 1"),
        ({**SYNTHETIC_REGRESSION, "noise": -1}, r"'noise' must be a number >= 0"),
        ({**SYNTHETIC_REGRESSION, "num_rows": 2}, r"num_rows=2 is too small for a regression split.*>= 3$"),
        ({"source": "text", "paths": "*.txt", "block_size": 8}, r"'paths' must be a non-empty list of glob"),
        ({"source": "text", "paths": ["*.txt"], "block_size": 1}, r"'block_size' must be an integer >= 2"),
        ({"source": "text", "paths": ["*.txt"], "block_size": 4, "max_tokens": 0}, r"'max_tokens' must be"),
    ],
)
def test_bad_task_specs_are_one_line_user_errors(tmp_path, spec, message):
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value)


# ---------------------------------------------------------------- tensor sources


def tensor_rows(table: pa.Table) -> np.ndarray:
    """The tensor column ``x`` as a (rows, *shape) float32 array, the shape read from the field metadata."""
    field = table.schema.field("x")
    shape = json.loads(field.metadata[b"shardfuse.shape"])
    assert field.type == pa.list_(pa.float32(), int(np.prod(shape)))
    column = table["x"].combine_chunks()
    return column.flatten().to_numpy().reshape(len(column), *shape)


def test_digits_images_have_the_digits_split_as_1x8x8_images_scaled_to_one(digits_dir, tmp_path):
    info = prepare("digits_images", {"source": "digits_images"}, tmp_path)
    assert info["input"] == {"kind": "tensor", "shape": [1, 8, 8], "dtype": "float32"}
    assert (info["num_features"], info["feature_names"], info["num_classes"]) == (64, [], 10)
    for split in SPLITS:
        images, numeric = read_split(tmp_path, split), read_split(digits_dir, split)
        assert images.column_names == ["x", "label"]
        assert images["label"].equals(numeric["label"])  # the same rows, in the same order
        assert np.array_equal(tensor_rows(images).reshape(-1, 64), columns(numeric, "x") / 16)
    assert tensor_rows(all_splits(tmp_path)).max() == 1.0


IMAGE_COLORS = {"cat": (255, 0, 51), "dog": 204}  # cat: RGB files, dog: grayscale (L) files


def write_image_folder(root: Path, per_class: int = 6) -> None:
    """Two class folders of constant-colour PNGs (5 wide, 7 high), whose resized pixels stay exact."""
    from PIL import Image

    for name, color in IMAGE_COLORS.items():
        (root / name).mkdir(parents=True)
        for index in range(per_class):
            Image.new("RGB" if name == "cat" else "L", (5, 7), color).save(root / name / f"{index}.png")
        (root / name / "notes.txt").write_text("not an image")


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_image_folder_gives_class_folders_as_resized_tensors_in_mode(tmp_path, mode):
    from PIL import Image

    write_image_folder(tmp_path / "images")
    spec = {"source": "image_folder", "path": str(tmp_path / "images"), "image_size": [4, 3], "mode": mode,
            "test_fraction": 0.34}  # fmt: skip
    info = prepare("images", spec, tmp_path / "out")
    channels = {"L": 1, "RGB": 3}[mode]
    assert info["input"] == {"kind": "tensor", "shape": [channels, 4, 3], "dtype": "float32"}
    assert (info["label_names"], info["skipped_images"], sum(info["rows"].values())) == (
        ["cat", "dog"],
        0,
        12,
    )
    assert_stratified(tmp_path / "out", 2, 0.34)
    table = all_splits(tmp_path / "out")
    images, labels = tensor_rows(table), table["label"].to_numpy()
    for code, (name, color) in enumerate(IMAGE_COLORS.items()):
        pixel = Image.new("RGB" if name == "cat" else "L", (1, 1), color).convert(mode).getpixel((0, 0))
        expected = np.float32(np.reshape(pixel, (channels, 1, 1))) / np.float32(255)
        assert np.array_equal(images[labels == code], np.broadcast_to(expected, (6, channels, 4, 3)))


def test_image_folder_bad_image_is_an_error_unless_skipped_and_counted(tmp_path):
    write_image_folder(tmp_path / "images")
    (tmp_path / "images" / "dog" / "broken.png").write_bytes(b"\x89PNG but not really")
    spec = {"source": "image_folder", "path": str(tmp_path / "images"), "image_size": [4, 4]}
    bad_image = r"cannot read image .*dog/broken\.png \(.*\); fix or remove it, or set on_bad_image: skip$"
    with pytest.raises(UserError, match=bad_image) as caught:
        prepare("images", spec, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()
    info = prepare("images", {**spec, "on_bad_image": "skip"}, tmp_path / "out")
    assert (info["skipped_images"], sum(info["rows"].values())) == (1, 12)


def write_npz(path: Path, **arrays) -> str:
    np.savez(path, **arrays)
    return str(path)


def row_pairs(out_dir: Path, target_columns: list[str]) -> list[tuple]:
    """Every row of all splits as (flat tensor values, targets), sorted."""
    table = all_splits(out_dir)
    flat = tensor_rows(table).reshape(table.num_rows, -1)
    targets = np.column_stack([table[name].to_numpy() for name in target_columns])
    return sorted((tuple(f.tolist()), tuple(t.tolist())) for f, t in zip(flat, targets, strict=True))


def test_npz_classification_keeps_each_rows_tensor_and_codes_its_label(tmp_path):
    rng = np.random.default_rng(0)
    features, labels = rng.standard_normal((60, 2, 3)), rng.permutation(np.repeat([3, 7, 9], 20))
    spec = {"source": "npz", "path": write_npz(tmp_path / "d.npz", x=features, y=labels)}
    info = prepare("npz", spec, tmp_path / "out")
    assert info["input"] == {"kind": "tensor", "shape": [2, 3], "dtype": "float32"}
    assert (info["task"], info["label_names"], info["num_features"]) == ("classification", ["3", "7", "9"], 6)
    assert_stratified(tmp_path / "out", 3, 0.2)
    codes = np.searchsorted([3, 7, 9], labels)
    expected = sorted(
        (tuple(f.tolist()), (int(c),))
        for f, c in zip(features.reshape(60, 6).astype(np.float32), codes, strict=True)
    )
    assert row_pairs(tmp_path / "out", ["label"]) == expected


@pytest.mark.parametrize("target_shape", [(40,), (40, 2)], ids=["one_target", "two_targets"])
def test_npz_regression_writes_float_targets_and_a_flat_tensor_per_row(tmp_path, target_shape):
    rng = np.random.default_rng(1)
    features, targets = rng.standard_normal((40, 5)).astype(np.float32), rng.standard_normal(target_shape)
    path = write_npz(tmp_path / "d.npz", inputs=features, outputs=targets)
    spec = {
        "source": "npz",
        "task": "regression",
        "path": path,
        "features_key": "inputs",
        "labels_key": "outputs",
    }
    info = prepare("npz", spec, tmp_path / "out")
    names = [f"y{k}" for k in range(targets.reshape(40, -1).shape[1])]
    assert info["input"] == {"kind": "tensor", "shape": [5], "dtype": "float32"}
    assert (info["task"], info["target_names"], info["rows"]["test"]) == ("regression", names, 8)
    expected = sorted(
        (tuple(f.tolist()), tuple(t.tolist()))
        for f, t in zip(features, targets.reshape(40, -1).astype(np.float32), strict=True)
    )
    assert row_pairs(tmp_path / "out", names) == expected


def list_table(tmp_path: Path, fixed: bool) -> tuple[str, np.ndarray]:
    """A Parquet file whose column 'img' holds 40 rows of 12 float32 values (a fixed-size list or a list
    column), with a class label 'y' (row % 2) and a float target 't' (twice the row's first value)."""
    values = np.random.default_rng(2).standard_normal((40, 12)).astype(np.float32)
    column = pa.FixedSizeListArray.from_arrays(pa.array(values.reshape(-1)), 12)
    column = column if fixed else column.cast(pa.list_(pa.float32()))
    table = pa.table({"img": column, "y": np.arange(40) % 2, "t": values[:, 0] * 2})
    pq.write_table(table, tmp_path / "t.parquet")
    return str(tmp_path / "t.parquet"), values


@pytest.mark.parametrize(
    ("fixed", "extra", "shape"),
    [
        (True, {"label_column": "y"}, [12]),
        (False, {"label_column": "y", "feature_shape": [3, 2, 2]}, [3, 2, 2]),
        (True, {"task": "regression", "label_columns": ["t"]}, [12]),
    ],
    ids=["fixed_size_list", "list_reshaped", "regression"],
)
def test_parquet_list_column_becomes_a_tensor(tmp_path, fixed, extra, shape):
    path, values = list_table(tmp_path, fixed)
    spec = {"source": "parquet", "path": path, "feature_columns": ["img"], **extra}
    info = prepare("tensor", spec, tmp_path / "out")
    assert info["input"] == {"kind": "tensor", "shape": shape, "dtype": "float32"}
    if "task" in extra:
        target_column, targets = "y0", (values[:, 0] * 2).tolist()
    else:
        target_column, targets = "label", (np.arange(40) % 2).tolist()
    expected = sorted(zip(map(tuple, values.tolist()), [(t,) for t in targets], strict=True))
    assert row_pairs(tmp_path / "out", [target_column]) == expected


@pytest.mark.parametrize(
    ("column", "extra", "message"),
    [
        (
            pa.array([[1.0] * 64] * 3 + [[1.0] * 63] + [[2.0] * 64] * 2),
            {},
            r"^column 'img' of .*t\.parquet has rows of different lengths \(e\.g\. 64 and 63\); every row "
            r"must hold the same shape$",
        ),
        (
            pa.array([[1.0] * 64] * 6),
            {"feature_shape": [1, 8, 7]},
            r"feature_shape \[1, 8, 7\] holds 56 values but column 'img' of .* has rows of 64; "
            r"fix feature_shape",
        ),
        (pa.array([[1.0, None]] * 6), {}, r"'img' in .* has 6 missing value\(s\) inside its lists"),
        (pa.array([["a"]] * 6), {}, r"'img' in .* holds lists of string, not numbers"),
    ],
    ids=["ragged", "bad_shape", "null_values", "strings"],
)
def test_bad_parquet_tensor_column_is_a_one_line_error(tmp_path, column, extra, message):
    pq.write_table(pa.table({"img": column, "y": [0, 1] * 3}), tmp_path / "t.parquet")
    spec = {"source": "parquet", "path": str(tmp_path / "t.parquet"), "feature_columns": ["img"],
            "label_column": "y", **extra}  # fmt: skip
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


def test_numeric_columns_reshaped_by_feature_shape_become_a_tensor(digits_dir, tmp_path):
    path = tmp_path / "digits.parquet"
    pq.write_table(read_split(digits_dir, "train"), path)
    spec = {"source": "parquet", "path": str(path), "feature_columns": [f"x{j}" for j in range(64)],
            "label_column": "label", "feature_shape": [1, 8, 8]}  # fmt: skip
    info = prepare("reshaped", spec, tmp_path / "out")
    assert info["input"]["shape"] == [1, 8, 8] and info["feature_names"] == []
    got = sorted(map(tuple, tensor_rows(all_splits(tmp_path / "out")).reshape(-1, 64).tolist()))
    assert got == sorted(map(tuple, columns(read_split(digits_dir, "train"), "x").tolist()))


@pytest.mark.parametrize(
    "spec",
    [
        {"source": "digits"},
        {"source": "digits_images"},
        {"source": "text", "paths": ["corpus/*.txt"], "block_size": 8},
    ],
    ids=["numeric", "tensor", "tokens"],
)
def test_dataset_json_input_is_the_layout_the_shard_reader_recognises(tmp_path, monkeypatch, spec):
    from shardfuse.data.shard_format import recognise_layout

    monkeypatch.chdir(tmp_path)
    (tmp_path / "corpus").mkdir()
    (tmp_path / "corpus" / "a.txt").write_bytes(np.random.default_rng(0).bytes(300))
    info = prepare("d", spec, tmp_path / "out")
    for split in SPLITS:
        layout = recognise_layout(pq.read_schema(tmp_path / "out" / f"{split}.parquet"), split)
        assert (layout.kind, list(layout.row_shape)) == (info["input"]["kind"], info["input"]["shape"])
        assert [column.dtype for column in layout.features] == [info["input"]["dtype"]] * len(layout.features)


# ---------------------------------------------------------------- text: the standard library, user tokenizers


def test_stdlib_placeholder_reads_the_standard_library_without_site_packages_or_tests(tmp_path):
    import sysconfig

    from shardfuse.data.sources.text import text_files

    spec = {"source": "text", "paths": ["{stdlib}/**/*.py"], "exclude": ["*/site-packages/*", "*/test/*"],
            "block_size": 31, "max_tokens": 2000}  # fmt: skip
    files = text_files(spec)
    stdlib = sysconfig.get_paths()["stdlib"]
    assert all(path.startswith(stdlib) for path in files) and os.path.join(stdlib, "os.py") in files
    assert not [path for path in files if "/site-packages/" in path or "/test/" in path]
    info = prepare("stdlib", spec, tmp_path / "out")
    assert info["num_tokens"] == 2000 and sum(info["rows"].values()) == 2000 // 32
    first_bytes = b"\n".join(Path(path).read_bytes() for path in files[:3])[:2000]
    assert sorted(blocks_of(tmp_path / "out")) == sorted(
        first_bytes[i * 32 : (i + 1) * 32] for i in range(62)
    )


TOKENIZER_MODULE = """
import numpy as np


def shifted(data: bytes):
    return [byte + {offset} for byte in data]


def as_array(data: bytes):
    return np.frombuffer(data, dtype=np.uint8).astype(np.int64) + {offset}
"""


@pytest.mark.parametrize(
    ("offset", "vocab_size", "dtype", "function"),
    [(1000, 1256, np.uint16, "shifted"), (65600, 65856, np.int32, "as_array")],
    ids=["uint16", "int32"],
)
def test_user_tokenizer_by_import_path_gives_its_ids_in_the_layout_its_vocabulary_needs(
    tmp_path, monkeypatch, offset, vocab_size, dtype, function
):
    module = f"user_tokenizer_{dtype.__name__}"
    (tmp_path / "code").mkdir()
    (tmp_path / "code" / f"{module}.py").write_text(TOKENIZER_MODULE.format(offset=offset))
    monkeypatch.syspath_prepend(str(tmp_path / "code"))
    joined = write_text_files(tmp_path / "corpus")
    spec = {"source": "text", "paths": [str(tmp_path / "corpus" / "**" / "*.txt")], "exclude": ["*.skip.*"],
            "block_size": 15, "tokenizer": f"{module}:{function}", "vocab_size": vocab_size}  # fmt: skip
    info = prepare("tok", spec, tmp_path / "out")
    dtype_name = np.dtype(dtype).name
    assert info["input"] == {"kind": "tokens", "shape": [16], "dtype": dtype_name}
    assert (info["vocab_size"], info["tokenizer"], info["num_tokens"]) == (
        vocab_size,
        spec["tokenizer"],
        len(joined),
    )
    assert read_split(tmp_path / "out", "test").schema.field("tokens").type == pa.list_(
        pa.from_numpy_dtype(dtype), 16
    )
    rows = token_rows(tmp_path / "out")
    assert rows.dtype == dtype  # the files' bytes, shifted, joined by the separator's ids (b"\n" + offset)
    expected = np.frombuffer(joined, dtype=np.uint8).astype(np.int64) + offset
    blocks = expected[: len(expected) // 16 * 16].reshape(-1, 16)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, blocks.tolist()))


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (
            {"tokenizer": "no_such_tokenizer_module:encode", "vocab_size": 300},
            r"^tokenizer 'no_such_tokenizer_module:encode': module 'no_such_tokenizer_module' does not "
            r"import \(ModuleNotFoundError: .*\); set PYTHONPATH to its directory or install the package$",
        ),
        (
            {"tokenizer": "json:no_such_function", "vocab_size": 300},
            r"^tokenizer 'json:no_such_function': module",
        ),
        (
            {"tokenizer": "json:dumps", "vocab_size": 300},
            r"^tokenizer 'json:dumps' failed on .*; fix the tokenizer$",
        ),
        (
            {"tokenizer": "builtins:list", "vocab_size": 100},
            r"returned token id \d+ for .*a\.txt, outside \[0, vocab_size=100\)",
        ),
        ({"tokenizer": "builtins:list"}, r"tokenizer 'builtins:list' needs 'vocab_size'"),
        ({"tokenizer": "tokenize"}, r"'tokenizer' must be an import path package\.module:function"),
        ({"vocab_size": 300}, r"'vocab_size' only applies with a tokenizer"),
    ],
    ids=["no_module", "no_function", "raises", "out_of_vocab", "no_vocab_size", "bad_path", "vocab_without"],
)
def test_bad_tokenizer_is_a_one_line_user_error_with_no_output(tmp_path, changes, message):
    write_text_files(tmp_path / "corpus")
    spec = {"source": "text", "paths": [str(tmp_path / "corpus" / "*.txt")], "block_size": 8, **changes}
    with pytest.raises(UserError, match=message) as caught:
        prepare("tok", spec, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"source": "image_folder", "path": "images"}, r"lacks 'image_size'"),
        (
            {"source": "image_folder", "path": "x", "image_size": [0, 4]},
            r"'image_size' must be a list of 2 positive",
        ),
        (
            {"source": "image_folder", "path": "x", "image_size": [4, 4], "mode": "CMYK"},
            r"'mode' must be one of L, RGB",
        ),
        (
            {"source": "image_folder", "path": "x", "image_size": [4, 4], "on_bad_image": "ignore"},
            r"'on_bad_image' must be one of error, skip",
        ),
        (
            {"source": "image_folder", "path": "nowhere", "image_size": [4, 4]},
            r"image folder nowhere does not exist",
        ),
        (
            {"source": "digits_images", "task": "regression"},
            r"source 'digits_images' cannot do task 'regression'",
        ),
        (
            {"source": "npz", "path": "d.npz", "labels_key": "x"},
            r"'features_key' and 'labels_key' name the same",
        ),
        ({"source": "npz", "path": "missing.npz"}, r"dataset file missing\.npz does not exist"),
        (
            {
                "source": "csv",
                "path": "x.csv",
                "feature_columns": ["a"],
                "label_column": "y",
                "feature_shape": [1],
            },
            r"unknown key\(s\) 'feature_shape' in the 'csv' dataset spec",
        ),
        (
            {
                "source": "parquet",
                "path": "x",
                "feature_columns": ["a"],
                "label_column": "y",
                "feature_shape": [],
            },
            r"'feature_shape' must be a non-empty list of positive integers",
        ),
    ],
)
def test_bad_tensor_source_specs_are_one_line_user_errors(tmp_path, monkeypatch, spec, message):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    ("arrays", "changes", "message"),
    [
        (
            {"features": np.zeros((6, 2)), "y": np.arange(6) % 2},
            {},
            r"array\(s\) 'x' not found in .*d\.npz; available arrays: features, y \(set features_key",
        ),
        (
            {"x": np.zeros(6), "y": np.arange(6) % 2},
            {},
            r"array 'x' in .* has shape \(6,\) .*e\.g\. \(N, F\)",
        ),
        (
            {"x": np.zeros((6, 2)), "y": np.arange(5) % 2},
            {},
            r"'x' in .* has 6 rows and 'y' 5; they need the same",
        ),
        (
            {"x": np.zeros((6, 2)), "y": np.linspace(0, 1, 6)},
            {},
            r"non-integer floats .*use task: regression$",
        ),
        (
            {"x": np.full((6, 2), np.nan), "y": np.arange(6) % 2},
            {},
            r"'x' in .* has 12 NaN or infinite value",
        ),
        (
            {"x": np.zeros((6, 2)), "y": np.array(["a"] * 6)},
            {"task": "regression"},
            r"regression needs numeric",
        ),
    ],
    ids=["missing_key", "one_dim", "row_mismatch", "float_labels", "nan", "string_targets"],
)
def test_bad_npz_is_a_one_line_user_error_with_no_output(tmp_path, arrays, changes, message):
    spec = {"source": "npz", "path": write_npz(tmp_path / "d.npz", **arrays), **changes}
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, tmp_path / "out")
    assert "\n" not in str(caught.value) and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- issue 18: inputs that looked fine


def user_spec(path: Path, **changes) -> dict:
    source = "csv" if path.suffix == ".csv" else "parquet"
    return {"source": source, "path": str(path), "feature_columns": ["a"], "label_column": "y", **changes}


def assert_refused(spec: dict, out_dir: Path, message: str) -> None:
    with pytest.raises(UserError, match=message) as caught:
        prepare("bad", spec, out_dir)
    assert "\n" not in str(caught.value)
    assert not out_dir.exists() or not os.listdir(out_dir)


@pytest.mark.parametrize("suffix", [".csv", ".parquet"])
def test_a_dataset_path_that_is_not_a_file_says_what_it_is(tmp_path, suffix):
    path = tmp_path / f"data{suffix}"
    path.mkdir()
    assert_refused(user_spec(path), tmp_path / "out", r"data\.\w+ is a directory, not a file; fix 'path'")
    path.rmdir()
    os.mkfifo(path)  # opening it would block: it is refused before anything reads it
    assert_refused(user_spec(path), tmp_path / "out", r"is not a regular file \(a FIFO, socket or device\)")
    path.unlink()
    path.symlink_to(tmp_path / "gone")
    assert_refused(user_spec(path), tmp_path / "out", r"is a symbolic link to something that does not exist")
    (tmp_path / "d.npz").mkdir()
    assert_refused(
        {"source": "npz", "path": str(tmp_path / "d.npz")}, tmp_path / "out", r"is a directory, not a"
    )


def test_duplicated_column_names_are_named_when_the_spec_uses_them(tmp_path):
    csv = tmp_path / "data.csv"
    csv.write_text("a,y,a,b,b\n" + "1,0,2,5,6\n3,1,4,7,8\n" * 4)
    message = r"column name\(s\) 'a' appear more than once in the header of .*data\.csv; rename the columns"
    assert_refused(user_spec(csv), tmp_path / "out", message)
    columns = [pa.array([1.0, 2.0] * 4), pa.array([0, 1] * 4), pa.array([3.0] * 8), pa.array([4.0] * 8)]
    parquet = tmp_path / "data.parquet"
    pq.write_table(pa.Table.from_arrays(columns, names=["a", "y", "y", "z"]), parquet)
    assert_refused(user_spec(parquet), tmp_path / "out", r"column name\(s\) 'y' appear more than once")
    # A duplicated column the spec does not use is no fault: the other columns are not even read.
    pq.write_table(pa.Table.from_arrays(columns, names=["a", "y", "z", "z"]), parquet)
    pq.write_table(pa.Table.from_arrays(columns[:2], names=["a", "y"]), tmp_path / "plain.parquet")
    prepare("d", user_spec(parquet), tmp_path / "dup")
    prepare("d", user_spec(tmp_path / "plain.parquet"), tmp_path / "plain")
    for split in SPLITS:
        assert read_split(tmp_path / "dup", split).equals(read_split(tmp_path / "plain", split))


def test_a_continuous_float_label_is_refused_before_the_split(tmp_path):
    """130 distinct integral floats in 400 rows (a rounded measurement): not 130 classes."""
    rng = np.random.default_rng(0)
    labels = np.concatenate([np.arange(130), np.arange(270) % 100]).astype(np.float64) + 20
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"a": rng.normal(size=400), "y": labels}), path)
    message = (
        r"label column 'y' in .*data\.parquet looks continuous \(130 distinct float values in 400 rows\); "
        r"set task: regression with label_columns: \[y\] \(or, if they are classes, store them as integers "
        r"or strings\)$"
    )
    assert_refused(user_spec(path), tmp_path / "out", message)
    npz = write_npz(tmp_path / "d.npz", x=rng.normal(size=(400, 2)), y=labels)
    assert_refused(
        {"source": "npz", "path": npz}, tmp_path / "npz", r"label array 'y' in .* looks continuous"
    )
    # The same values as integers are classes (the split then complains about any single-row class).
    pq.write_table(pa.table({"a": rng.normal(size=400), "y": labels.astype(np.int64)}), path)
    assert_refused(user_spec(path), tmp_path / "out", r"have a single row; a stratified split needs")


@pytest.mark.parametrize(
    ("num_classes", "rows_per_class"),
    [(20, 2), (21, 10), (100, 12)],
    ids=["few_classes", "enough_rows", "many_classes_many_rows"],
)
def test_integral_float_labels_with_few_classes_or_enough_rows_each_stay_classes(
    tmp_path, num_classes, rows_per_class
):
    labels = np.repeat(np.arange(num_classes, dtype=np.float64), rows_per_class)
    path = tmp_path / "data.parquet"
    pq.write_table(pa.table({"a": np.arange(len(labels), dtype=np.float64), "y": labels}), path)
    info = prepare("floats", user_spec(path), tmp_path / "out")
    assert info["num_classes"] == num_classes


def test_a_dataset_seed_must_be_a_64_bit_integer(tmp_path):
    assert_refused(
        {"source": "digits", "seed": 2**63},
        tmp_path / "out",
        r"spec key 'seed' must be an integer from 0 to 9223372036854775807, got 9223372036854775808",
    )
    info = prepare("digits", {"source": "digits", "seed": 2**63 - 1}, tmp_path / "largest")
    assert info["seed"] == 2**63 - 1
