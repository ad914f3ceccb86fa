"""Prepare one dataset: a seeded, stratified train/validation/test split written as Parquet.

Run by hand:

    python -m shardfuse.prepare --name digits \
        --spec-json '{"source": "digits", "test_fraction": 0.2, "seed": 0}' --out-dir results/datasets/digits

Writes OUT_DIR/train.parquet, OUT_DIR/val.parquet, OUT_DIR/test.parquet and OUT_DIR/dataset.json (each
atomically; dataset.json last, so its presence means the split is complete). The Parquet files hold the
columns x0..x{F-1} (float32) then ``label`` (int64 in [0, C)). The same spec gives byte-identical files.

The test split (``test_fraction`` of the rows, default 0.2) is drawn first and does not depend on
``val_fraction``; the validation split (``val_fraction`` of all rows, default 0.1, stratified and seeded
the same way) is carved from the remaining rows, and train.parquet holds the rest. Choices such as
greedy soup's are made on val.parquet, never on the test split. val_fraction 0 writes an empty
val.parquet with the same schema. Rows are written in a seeded random order (user files are often sorted
by label; the synthetic generator draws labels at random already), since partition keeps the input's
order within a shard and the shard reader's first epoch follows the file row group by row group.

Sources (keys of the spec; ``test_fraction`` defaults to 0.2, ``val_fraction`` to 0.1, ``seed`` to 0):
  digits     scikit-learn's bundled 8x8 digits (1797 rows, 64 features, 10 classes; no download)
  synthetic  num_rows, num_features, num_classes, class_sep (default 1.0): seeded Gaussian clusters,
             generated and written chunk by chunk, so tens of millions of rows fit in bounded memory.
             class_sep sets difficulty independent of num_features: nearest-centroid test accuracy
             with 10 classes is ~0.57 at 1.0, ~0.81 at 1.5, ~0.94 at 2.0 (chance at 0).
  parquet    path, feature_columns, label_column: a user file, labels mapped to 0..C-1 in sorted order
  csv        same keys as parquet
"""

from __future__ import annotations

import contextlib
import math
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from shardfuse.io import (
    StageParser,
    UserError,
    atomic_path,
    error_reason,
    parse_json_arg,
    run_cli,
    sha256_file,
    write_json,
    write_stamps,
)

DEFAULTS = {"test_fraction": 0.2, "val_fraction": 0.1, "seed": 0, "class_sep": 1.0}
SPLITS = ("train", "val", "test")
SPLIT_KEYS = {"test_fraction", "val_fraction", "seed"}
USER_FILE_KEYS = ({"path", "feature_columns", "label_column"}, SPLIT_KEYS)
# source -> (required keys, optional keys); "source" itself is always required.
SOURCE_KEYS: dict[str, tuple[set[str], set[str]]] = {
    "digits": (set(), SPLIT_KEYS),
    "synthetic": ({"num_rows", "num_features", "num_classes"}, SPLIT_KEYS | {"class_sep"}),
    "parquet": USER_FILE_KEYS,
    "csv": USER_FILE_KEYS,
}
ROW_GROUP_ROWS = 1 << 16
# Synthetic rows are generated in chunks of about this many values (rows x features). It is a constant,
# not a tuning knob: chunk boundaries decide the random streams, so changing it changes the data.
SYNTHETIC_CHUNK_VALUES = 1 << 22
SPEC_FIX = "fix the dataset's spec in the config"


# ---------------------------------------------------------------- spec validation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(spec: dict, key: str, minimum: int) -> None:
    if not _is_int(spec[key]) or spec[key] < minimum:
        raise UserError(f"spec key {key!r} must be an integer >= {minimum}, got {spec[key]!r}; {SPEC_FIX}")


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_number(spec: dict, key: str, low: float, high: float, *, open_interval: bool) -> None:
    value = spec[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or not (low < value < high if open_interval else low <= value <= high):
        what = f"strictly between {low} and {high}" if open_interval else f">= {low}"
        raise UserError(f"spec key {key!r} must be a number {what}, got {value!r}; {SPEC_FIX}")


def validate_spec(spec: Any) -> dict:
    """Check a dataset spec; return a copy with defaults filled in, or raise UserError at the first fault."""
    if not isinstance(spec, dict):
        raise UserError(f"the dataset spec must be a JSON object, got {type(spec).__name__}; {SPEC_FIX}")
    source = spec.get("source")
    if not isinstance(source, str) or source not in SOURCE_KEYS:
        raise UserError(f"unknown dataset source {source!r}; use one of {', '.join(sorted(SOURCE_KEYS))}")
    required, optional = SOURCE_KEYS[source]
    allowed = required | optional | {"source"}
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise UserError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in the {source!r} dataset spec; "
            f"valid keys are {', '.join(sorted(allowed))}"
        )
    missing = sorted(required - set(spec))
    if missing:
        raise UserError(f"the {source!r} dataset spec lacks {', '.join(map(repr, missing))}; {SPEC_FIX}")
    spec = {**{k: v for k, v in DEFAULTS.items() if k in optional}, **spec}

    _require_number(spec, "test_fraction", 0, 1, open_interval=True)
    val_fraction = spec["val_fraction"]
    if not (_is_fraction(val_fraction) and 0 <= val_fraction < 1):
        raise UserError(
            f"spec key 'val_fraction' must be a number in [0, 1), got {val_fraction!r}; {SPEC_FIX}"
        )
    if spec["test_fraction"] + val_fraction >= 1:
        raise UserError(
            f"test_fraction + val_fraction = {spec['test_fraction'] + val_fraction:g} leaves no training "
            f"rows; make their sum < 1 ({SPEC_FIX})"
        )
    _require_int(spec, "seed", 0)
    if source == "synthetic":
        _require_int(spec, "num_rows", 2)
        _require_int(spec, "num_features", 1)
        _require_int(spec, "num_classes", 2)
        _require_number(spec, "class_sep", 0, math.inf, open_interval=False)
    if source in ("parquet", "csv"):
        if not isinstance(spec["path"], str) or not spec["path"]:
            raise UserError(f"spec key 'path' must be a non-empty string, got {spec['path']!r}; {SPEC_FIX}")
        columns = spec["feature_columns"]
        if (
            not isinstance(columns, list)
            or not columns
            or not all(isinstance(c, str) for c in columns)
            or len(set(columns)) != len(columns)
        ):
            raise UserError(
                f"spec key 'feature_columns' must be a non-empty list of distinct column names, "
                f"got {columns!r}; {SPEC_FIX}"
            )
        if not isinstance(spec["label_column"], str) or spec["label_column"] in columns:
            raise UserError(
                f"spec key 'label_column' must be a column name not among feature_columns, got "
                f"{spec['label_column']!r}; {SPEC_FIX}"
            )
    return spec


# ---------------------------------------------------------------- splitting and writing


def stratified_test_mask(labels: np.ndarray, num_classes: int, test_fraction: float, seed: int) -> np.ndarray:
    """Seeded stratified split: each class sends round(n_c * test_fraction) rows, at least 1 and at most
    n_c - 1, to the test side. Returns a boolean mask, True for test rows."""
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_test = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        num_test = min(max(math.floor(count * test_fraction + 0.5), 1), count - 1)
        is_test[rng.permutation(members)[:num_test]] = True
    return is_test


def stratified_val_mask(
    labels: np.ndarray, is_test: np.ndarray, num_classes: int, val_fraction: float, seed: int
) -> np.ndarray:
    """The validation rows, carved from the non-test rows like the test split: each class sends
    round(n_c * val_fraction) rows (n_c counts all its rows), at least 1 if val_fraction > 0, and always
    leaves at least one row of the class for training. Its own random stream, so the test split does not
    depend on val_fraction."""
    rng = np.random.default_rng([seed, 2])
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_val = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        remaining = members[~is_test[members]]
        wanted = math.floor(count * val_fraction + 0.5)
        num_val = min(max(wanted, 1 if val_fraction > 0 else 0), len(remaining) - 1)
        if num_val > 0:
            is_val[rng.permutation(remaining)[:num_val]] = True
    return is_val


def _schema(num_features: int) -> pa.Schema:
    return pa.schema(
        [*(pa.field(f"x{j}", pa.float32()) for j in range(num_features)), pa.field("label", pa.int64())]
    )


def _table(features: np.ndarray, labels: np.ndarray) -> pa.Table:
    columns = np.ascontiguousarray(features.T, dtype=np.float32)  # column-major, as Arrow stores it
    arrays = [pa.array(column) for column in columns] + [pa.array(labels.astype(np.int64, copy=False))]
    return pa.Table.from_arrays(arrays, schema=_schema(features.shape[1]))


def _write_split(
    out_dir: Path,
    features: np.ndarray,
    labels: np.ndarray,
    masks: dict[str, np.ndarray],
    row_group_rows: int,
    seed: int,
) -> None:
    """Each split's rows in a seeded random order: files are often sorted (by label, by time), and
    partition keeps the input's order within a shard, which the shard reader's first epoch follows
    row group by row group."""
    for index, (split, mask) in enumerate(masks.items()):
        rows = np.random.default_rng([seed, 11, index]).permutation(np.flatnonzero(mask))
        with atomic_path(out_dir / f"{split}.parquet") as tmp:
            pq.write_table(_table(features[rows], labels[rows]), tmp, row_group_size=row_group_rows)


# ---------------------------------------------------------------- sources


def _load_digits() -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    from sklearn.datasets import load_digits  # deferred: sklearn is slow to import and only needed here

    digits = load_digits()
    label_names = [str(int(v)) for v in digits.target_names]
    return (
        digits.data.astype(np.float32),
        digits.target.astype(np.int64),
        list(digits.feature_names),
        label_names,
    )


def _read_user_table(spec: dict) -> pa.Table:
    path = Path(spec["path"])
    if not path.is_file():
        raise UserError(f"dataset file {path} does not exist; fix 'path' in the dataset's spec")
    try:
        if spec["source"] == "parquet":
            return pq.read_table(path)
        # Empty cells are missing values in every column, also text labels (pyarrow keeps "" by default).
        return pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(strings_can_be_null=True))
    except (pa.ArrowException, OSError) as exc:
        raise UserError(
            f"cannot read {path} as {spec['source']} ({error_reason(exc)}); check the file and the spec's "
            "'source'"
        ) from None


def _feature_matrix(table: pa.Table, feature_columns: list[str], path: str) -> np.ndarray:
    features = np.empty((table.num_rows, len(feature_columns)), dtype=np.float32)
    for j, name in enumerate(feature_columns):
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            raise UserError(
                f"feature column {name!r} in {path} has type {column.type}, not a number; encode it "
                "numerically or drop it from feature_columns"
            )
        if column.null_count:
            raise UserError(
                f"feature column {name!r} in {path} has {column.null_count} missing value(s); fill or "
                "drop those rows first"
            )
        features[:, j] = column.to_numpy()
        num_bad = int(np.count_nonzero(~np.isfinite(features[:, j])))
        if num_bad:
            raise UserError(
                f"feature column {name!r} in {path} has {num_bad} NaN or infinite value(s) (after "
                "conversion to float32); fill or drop those rows first"
            )
    return features


def _label_codes(column: pa.ChunkedArray, name: str, path: str) -> tuple[np.ndarray, list[str]]:
    """Map labels of any sortable type to 0..C-1 in sorted order of their distinct values."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.null_count:
        raise UserError(
            f"label column {name!r} in {path} has {column.null_count} missing value(s); drop those rows first"
        )
    if pa.types.is_floating(column.type) and pc.any(pc.is_nan(column)).as_py():
        raise UserError(f"label column {name!r} in {path} has NaN values; drop those rows first")
    try:
        distinct = pc.unique(column)
        distinct = distinct.take(pc.array_sort_indices(distinct))
    except pa.ArrowNotImplementedError:
        raise UserError(
            f"label column {name!r} in {path} has type {column.type}, which cannot be sorted; "
            "use integer or string labels"
        ) from None
    codes = pc.index_in(column, value_set=distinct).to_numpy().astype(np.int64)
    return codes, [str(value) for value in distinct.to_pylist()]


def _load_user_file(spec: dict) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    table = _read_user_table(spec)
    path, features_wanted, label_name = spec["path"], spec["feature_columns"], spec["label_column"]
    missing = [c for c in [*features_wanted, label_name] if c not in table.column_names]
    if missing:
        raise UserError(
            f"column(s) {', '.join(map(repr, missing))} not found in {path}; available columns: "
            f"{', '.join(table.column_names)}"
        )
    if table.num_rows == 0:
        raise UserError(f"{path} has no rows; point the dataset's path at a file with data")
    features = _feature_matrix(table, features_wanted, path)
    labels, label_names = _label_codes(table.column(label_name), label_name, path)
    if len(label_names) < 2:
        raise UserError(
            f"label column {label_name!r} in {path} has a single value {label_names[0]!r}; a "
            "classifier needs at least 2 classes"
        )
    counts = np.bincount(labels, minlength=len(label_names))
    rare = [f"{label_names[c]!r}" for c in np.flatnonzero(counts < 2)]
    if rare:
        raise UserError(
            f"label value(s) {', '.join(rare[:10])} in {path} have a single row; a stratified split "
            "needs at least 2 rows per class: add rows or drop those"
        )
    return features, labels, list(features_wanted), label_names


# ---------------------------------------------------------------- synthetic source


def synthetic_chunk_rows(num_features: int) -> int:
    return max(1, SYNTHETIC_CHUNK_VALUES // num_features)


def _synthetic_chunk(
    spec: dict,
    centroids: np.ndarray,
    mix_source: np.ndarray,
    mix_weight: np.ndarray,
    chunk_index: int,
    start: int,
    stop: int,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Rows [start, stop): labels cycle through the classes by global row index, so every class has
    num_rows // C or one more rows; the test rows of each class are spread evenly over its rows
    (Bresenham-style), which makes the split stratified across all chunks, not just within one."""
    num_classes, test_fraction = spec["num_classes"], spec["test_fraction"]
    rng = np.random.default_rng([spec["seed"], 1, chunk_index])  # stream 0 holds the shared parameters
    rows = rng.permutation(np.arange(start, stop, dtype=np.int64))  # rows come out in random class order
    labels = rows % num_classes
    position = rows // num_classes  # index of the row within its class
    is_test = _spread(position, test_fraction)
    # The same rule once more over the non-test rows of each class (index: rows before it that are not
    # test rows), with the share that makes val_fraction of all rows.
    remaining_position = position - np.floor(position * test_fraction + 0.5).astype(np.int64)
    is_val = ~is_test & _spread(remaining_position, _val_share(spec))
    features = rng.standard_normal((stop - start, centroids.shape[1]))
    features += centroids[labels]
    # Mix each feature with one other: correlated features, elementwise so the bits do not depend on
    # the CPU (a BLAS matmul would).
    features += mix_weight * features[:, mix_source]
    return features.astype(np.float32), labels, {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def _spread(position: np.ndarray, fraction: float) -> np.ndarray:
    """Bresenham-style: position p is picked when round((p + 1) * fraction) steps past round(p * fraction),
    so any n consecutive positions from 0 hold round(n * fraction) picks, spread evenly."""
    return np.floor((position + 1) * fraction + 0.5) > np.floor(position * fraction + 0.5)


def _val_share(spec: dict) -> float:
    return spec["val_fraction"] / (1 - spec["test_fraction"])


def _class_splits_both_ways(class_rows: int, test_fraction: float, val_share: float = 0.0) -> bool:
    """Whether a synthetic class of this size gets at least one train and one test row."""
    num_test = math.floor(class_rows * test_fraction + 0.5)  # what _synthetic_chunk's rule adds up to
    class_rows -= math.floor((class_rows - num_test) * val_share + 0.5)  # validation rows leave training
    return 1 <= num_test < class_rows


def _prepare_synthetic(spec: dict, out_dir: Path, row_group_rows: int) -> tuple[dict, list[str], list[str]]:
    num_rows, num_features, num_classes = spec["num_rows"], spec["num_features"], spec["num_classes"]
    test_fraction, val_share = spec["test_fraction"], _val_share(spec)
    if not _class_splits_both_ways(num_rows // num_classes, test_fraction, val_share):
        # Smallest workable class size: start from the analytic bound (without validation rows), step up.
        class_rows = max(2, math.ceil(0.5 / test_fraction), math.floor(0.5 / (1 - test_fraction)) + 1)
        while not _class_splits_both_ways(class_rows, test_fraction, val_share):
            class_rows += 1
        need = num_classes * class_rows
        raise UserError(
            f"num_rows={num_rows} is too small for {num_classes} classes at test_fraction="
            f"{test_fraction} (val_fraction={spec['val_fraction']}): some class would get no train or no "
            f"test row; use num_rows >= {need}"
        )
    params = np.random.default_rng([spec["seed"], 0])
    # Centroid spread scales with 1/sqrt(F), so class_sep sets the difficulty whatever num_features is:
    # two centroids lie about 2 * sqrt(2) * class_sep noise standard deviations apart.
    centroids = params.standard_normal((num_classes, num_features)) * (
        2 * spec["class_sep"] / math.sqrt(num_features)
    )
    mix_source = params.permutation(num_features)
    mix_weight = params.uniform(-1.0, 1.0, num_features)

    schema = _schema(num_features)
    chunk_rows = synthetic_chunk_rows(num_features)
    num_written = dict.fromkeys(SPLITS, 0)
    with contextlib.ExitStack() as stack:
        writers = {
            split: stack.enter_context(
                pq.ParquetWriter(stack.enter_context(atomic_path(out_dir / f"{split}.parquet")), schema)
            )
            for split in SPLITS
        }
        for chunk_index, start in enumerate(range(0, num_rows, chunk_rows)):
            features, labels, masks = _synthetic_chunk(
                spec,
                centroids,
                mix_source,
                mix_weight,
                chunk_index,
                start,
                min(start + chunk_rows, num_rows),
            )
            for split, mask in masks.items():
                writers[split].write_table(
                    _table(features[mask], labels[mask]), row_group_size=row_group_rows
                )
                num_written[split] += int(np.count_nonzero(mask))
    feature_names = [f"x{j}" for j in range(num_features)]
    return num_written, feature_names, [str(c) for c in range(num_classes)]


# ---------------------------------------------------------------- stage entry points


def prepare(name: str, spec: Any, out_dir: str | Path, row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write OUT_DIR/{train,val,test}.parquet and dataset.json for ``spec``; return the dataset.json content.

    ``row_group_rows`` only changes the Parquet layout, never the rows (tests rely on that)."""
    if not isinstance(name, str) or not name:
        raise UserError("--name must be a non-empty dataset name, e.g. --name digits")
    spec = validate_spec(spec)
    out_dir = Path(out_dir)
    if spec["source"] == "synthetic":
        rows, feature_names, label_names = _prepare_synthetic(spec, out_dir, row_group_rows)
    else:
        features, labels, feature_names, label_names = (
            _load_digits() if spec["source"] == "digits" else _load_user_file(spec)
        )
        is_test = stratified_test_mask(labels, len(label_names), spec["test_fraction"], spec["seed"])
        is_val = stratified_val_mask(labels, is_test, len(label_names), spec["val_fraction"], spec["seed"])
        masks = {"train": ~(is_test | is_val), "val": is_val, "test": is_test}
        _write_split(out_dir, features, labels, masks, row_group_rows, spec["seed"])
        rows = {split: int(np.count_nonzero(mask)) for split, mask in masks.items()}
    info = {
        "name": name,
        "source": spec["source"],
        "num_features": len(feature_names),
        "num_classes": len(label_names),
        "feature_names": feature_names,
        "label_names": label_names,
        "rows": rows,
        "test_fraction": spec["test_fraction"],
        "val_fraction": spec["val_fraction"],
        "seed": spec["seed"],
        "sha256": {split: sha256_file(out_dir / f"{split}.parquet") for split in SPLITS},
    }
    write_json(out_dir / "dataset.json", info)
    # Partition reuses these checksums (one pass less over train.parquet) while the files are unchanged.
    write_stamps(out_dir, {f"{split}.parquet": info["sha256"][split] for split in SPLITS})
    return info


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.prepare", description=__doc__.splitlines()[0])
    parser.add_argument("--name", required=True, help="dataset name, recorded in dataset.json")
    parser.add_argument("--spec-json", required=True, help="the dataset spec as a JSON object")
    parser.add_argument(
        "--out-dir", required=True, help="directory for train/val/test.parquet and dataset.json"
    )
    args = parser.parse_args(argv)
    info = prepare(args.name, parse_json_arg(args.spec_json, "--spec-json"), args.out_dir)
    print(
        f"{info['name']}: {info['rows']['train']} train / {info['rows']['val']} val / "
        f"{info['rows']['test']} test rows, "
        f"{info['num_features']} features, {info['num_classes']} classes -> {args.out_dir}"
    )


if __name__ == "__main__":
    run_cli(main)
