"""Prepare one dataset: a seeded train/validation/test split written as Parquet, for any of three tasks.

Run by hand:

    python -m shardfuse.prepare --name digits \
        --spec-json '{"source": "digits", "test_fraction": 0.2, "seed": 0}' --out-dir results/datasets/digits

Writes OUT_DIR/train.parquet, OUT_DIR/val.parquet, OUT_DIR/test.parquet and OUT_DIR/dataset.json (each
atomically; dataset.json last, so its presence means the split is complete). The same spec gives
byte-identical files. The Parquet columns depend on the spec's ``task``:

  classification  x0..x{F-1} (float32) then ``label`` (int64 in [0, C))
  regression      x0..x{F-1} (float32) then y0..y{K-1} (float32: the K targets)
  causal_lm       x0..x{B} (float32 holding byte tokens 0..255; B = block_size: a row is B inputs and,
                  shifted by one, B next-token targets)

dataset.json records the ``task``. Regression adds ``target_names``; causal_lm adds ``vocab_size`` (256),
``block_size`` and ``num_tokens`` (bytes read); both have num_classes 0 and label_names [].

The test split (``test_fraction`` of the rows, default 0.2) is drawn first and does not depend on
``val_fraction``; the validation split (``val_fraction`` of all rows, default 0.1, drawn the same way)
is carved from the remaining rows, and train.parquet holds the rest. Classification splits are
stratified by class; regression rows and text blocks are split at random (seeded). Choices such as
greedy soup's are made on val.parquet, never on the test split. val_fraction 0 writes an empty
val.parquet with the same schema. Rows are written in a seeded random order (user files are often sorted
by label; the synthetic generator draws rows at random already), since partition keeps the input's
order within a shard and the shard reader's first epoch follows the file row group by row group.

Sources (keys of the spec; ``task`` defaults to the source's first task below; ``test_fraction`` defaults
to 0.2, ``val_fraction`` to 0.1, ``seed`` to 0):
  digits     classification: scikit-learn's bundled 8x8 digits (1797 rows, 64 features, 10 classes)
  diabetes   regression: scikit-learn's bundled diabetes data (442 rows, 10 scaled features, 1 raw target)
  synthetic  classification: num_rows, num_features, num_classes, class_sep (default 1.0): seeded Gaussian
             clusters. class_sep sets difficulty independent of num_features: nearest-centroid test
             accuracy with 10 classes is ~0.57 at 1.0, ~0.81 at 1.5, ~0.94 at 2.0 (chance at 0).
             regression: num_rows, num_features, num_outputs, noise (default 0.1): x ~ N(0, 1),
             y = f(x) + noise * N(0, 1) with f a seeded random one-hidden-layer network scaled so each
             target's std is about 1. Both are generated and written chunk by chunk, so tens of millions
             of rows fit in bounded memory.
  parquet    classification or regression: path, feature_columns and either label_column
             (classification: labels of any type mapped to 0..C-1 in sorted order) or label_columns
             (regression: numeric target columns)
  csv        same keys as parquet
  text       causal_lm: paths (glob patterns, ** recurses), exclude (fnmatch patterns of the full path,
             default []), block_size, max_tokens (default null: read everything). The files' bytes,
             sorted by path and joined by b"\\n", cut into non-overlapping rows of block_size + 1 tokens
             (the tail is dropped). Vocabulary: the 256 byte values; no download, no tokenizer.
Any classification source also takes ``classes``: keep only the rows whose label is one of these (e.g.
[0, 1, 2] for digits). The label space stays the whole data's: num_classes, label_names and the label
codes are unchanged, so a model trained on a subset has the full output layer.
"""

from __future__ import annotations

import contextlib
import fnmatch
import glob
import math
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

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

DEFAULTS = {
    "test_fraction": 0.2,
    "val_fraction": 0.1,
    "seed": 0,
    "class_sep": 1.0,
    "noise": 0.1,
    "exclude": (),
    "max_tokens": None,
}
SPLITS = ("train", "val", "test")
SPLIT_KEYS = {"test_fraction", "val_fraction", "seed"}
COMMON_KEYS = SPLIT_KEYS | {"task"}
USER_FILE_KEYS = ({"path", "feature_columns"}, COMMON_KEYS | {"label_column", "label_columns", "classes"})
# source -> (required keys, optional keys) for any of its tasks; "source" itself is always required.
SOURCE_KEYS: dict[str, tuple[set[str], set[str]]] = {
    "digits": (set(), COMMON_KEYS | {"classes"}),
    "diabetes": (set(), COMMON_KEYS),
    "synthetic": (
        {"num_rows", "num_features"},
        COMMON_KEYS | {"num_classes", "class_sep", "classes", "num_outputs", "noise"},
    ),
    "parquet": USER_FILE_KEYS,
    "csv": USER_FILE_KEYS,
    "text": ({"paths", "block_size"}, COMMON_KEYS | {"exclude", "max_tokens"}),
}
# The tasks each source can do; the first is its default.
SOURCE_TASKS = {
    "digits": ("classification",),
    "diabetes": ("regression",),
    "synthetic": ("classification", "regression"),
    "parquet": ("classification", "regression"),
    "csv": ("classification", "regression"),
    "text": ("causal_lm",),
}
TASKS = ("classification", "regression", "causal_lm")
# Keys that only one task takes (a source's other keys suit all its tasks), and the keys a task requires.
TASK_ONLY_KEYS = {
    "classification": {"num_classes", "class_sep", "classes", "label_column"},
    "regression": {"num_outputs", "noise", "label_columns"},
}
TASK_REQUIRED_KEYS = {
    ("synthetic", "classification"): {"num_classes"},
    ("synthetic", "regression"): {"num_outputs"},
    ("parquet", "classification"): {"label_column"},
    ("parquet", "regression"): {"label_columns"},
    ("csv", "classification"): {"label_column"},
    ("csv", "regression"): {"label_columns"},
}
ROW_GROUP_ROWS = 1 << 16
# Synthetic rows are generated in chunks of about this many values (rows x features; regression also
# counts its hidden layer and targets). It is a constant, not a tuning knob: chunk boundaries decide the
# random streams, so changing it changes the data.
SYNTHETIC_CHUNK_VALUES = 1 << 22
# Hidden width of the synthetic regression function, and the rows that calibrate its scale (constants:
# changing either changes the data).
SYNTHETIC_HIDDEN = 32
SYNTHETIC_CALIBRATION_ROWS = 1 << 12
VOCAB_SIZE = 256  # text is tokenized into its bytes
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


def _require_names(spec: dict, key: str, what: str, *, allow_empty: bool = False) -> None:
    """``spec[key]`` must be a list of distinct non-empty strings (non-empty unless ``allow_empty``)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not (value or allow_empty)
        or not all(isinstance(item, str) and item for item in value)
        or len(set(value)) != len(value)
    ):
        raise UserError(f"spec key {key!r} must be a {what}, got {value!r}; {SPEC_FIX}")


def _task_of(spec: dict) -> str:
    source = spec["source"]
    task = spec.get("task", SOURCE_TASKS[source][0])
    if task not in TASKS:
        raise UserError(f"spec key 'task' must be one of {', '.join(TASKS)}, got {task!r}; {SPEC_FIX}")
    if task not in SOURCE_TASKS[source]:
        raise UserError(
            f"source {source!r} cannot do task {task!r}; use task: {' or '.join(SOURCE_TASKS[source])} "
            "(or leave task out) or pick another source"
        )
    return task


def validate_spec(spec: Any) -> dict:
    """Check a dataset spec; return a copy with defaults (task included) filled in, or raise UserError at
    the first fault."""
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
    task = _task_of(spec)
    for other, keys in TASK_ONLY_KEYS.items():
        foreign = sorted(keys & set(spec))
        if other != task and foreign:
            raise UserError(
                f"spec key(s) {', '.join(map(repr, foreign))} only apply to task {other!r}, and this "
                f"{source!r} dataset's task is {task!r}; drop them or set task: {other}"
            )
    required = required | TASK_REQUIRED_KEYS.get((source, task), set())
    missing = sorted(required - set(spec))
    if missing:
        raise UserError(
            f"the {source!r} dataset spec (task {task}) lacks {', '.join(map(repr, missing))}; {SPEC_FIX}"
        )
    foreign_keys = set().union(*(keys for other, keys in TASK_ONLY_KEYS.items() if other != task))
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in DEFAULTS.items() if k in optional}
    spec = {**{k: v for k, v in defaults.items() if k not in foreign_keys}, **spec, "task": task}

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
        if task == "classification":
            _require_int(spec, "num_classes", 2)
            _require_number(spec, "class_sep", 0, math.inf, open_interval=False)
        else:
            _require_int(spec, "num_outputs", 1)
            _require_number(spec, "noise", 0, math.inf, open_interval=False)
    if source in ("parquet", "csv"):
        if not isinstance(spec["path"], str) or not spec["path"]:
            raise UserError(f"spec key 'path' must be a non-empty string, got {spec['path']!r}; {SPEC_FIX}")
        _require_names(spec, "feature_columns", "non-empty list of distinct column names")
        columns = spec["feature_columns"]
        if task == "classification" and (
            not isinstance(spec["label_column"], str) or spec["label_column"] in columns
        ):
            raise UserError(
                f"spec key 'label_column' must be a column name not among feature_columns, got "
                f"{spec['label_column']!r}; {SPEC_FIX}"
            )
        if task == "regression":
            what = "non-empty list of distinct column names, none of them among feature_columns"
            _require_names(spec, "label_columns", what)
            if set(spec["label_columns"]) & set(columns):
                raise UserError(
                    f"spec key 'label_columns' must be a {what}, got {spec['label_columns']!r}; {SPEC_FIX}"
                )
    if "classes" in spec:
        classes = spec["classes"]
        if (
            not isinstance(classes, list)
            or not classes
            or not all(isinstance(c, str) or _is_int(c) for c in classes)
            or len({str(c) for c in classes}) != len(classes)
        ):
            raise UserError(
                f"spec key 'classes' must be a non-empty list of distinct label values (strings or "
                f"integers), got {classes!r}; {SPEC_FIX}"
            )
    if source == "text":
        _require_names(spec, "paths", "non-empty list of glob patterns")
        _require_names(spec, "exclude", "list of glob patterns", allow_empty=True)
        _require_int(spec, "block_size", 2)
        if spec["max_tokens"] is not None:
            _require_int(spec, "max_tokens", 2)
    return spec


# ---------------------------------------------------------------- splitting and writing


class Written(NamedTuple):
    """What a source wrote, for dataset.json."""

    rows: dict[str, int]  # per split
    feature_names: list[str]
    label_names: list[str]  # the class names (classification); [] for the other tasks
    task_keys: dict[str, Any]  # the task's own dataset.json keys (target_names; vocab_size, ...)


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


def _split_masks(labels: np.ndarray, num_classes: int, spec: dict) -> dict[str, np.ndarray]:
    """The train/val/test masks: stratified by class, or (``labels`` an int array of zeros, one class)
    a plain seeded random split with the same rules."""
    is_test = stratified_test_mask(labels, num_classes, spec["test_fraction"], spec["seed"])
    is_val = stratified_val_mask(labels, is_test, num_classes, spec["val_fraction"], spec["seed"])
    return {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def _random_split_masks(num_rows: int, spec: dict) -> dict[str, np.ndarray]:
    """A seeded random split, not stratified: the stratified rules with every row in one class."""
    return _split_masks(np.zeros(num_rows, dtype=np.int64), 1, spec)


def _schema(num_features: int, task: str = "classification", num_targets: int = 0) -> pa.Schema:
    fields = [pa.field(f"x{j}", pa.float32()) for j in range(num_features)]
    if task == "classification":
        fields.append(pa.field("label", pa.int64()))
    elif task == "regression":
        fields += [pa.field(f"y{k}", pa.float32()) for k in range(num_targets)]
    return pa.schema(fields)


def _table(features: np.ndarray, targets: np.ndarray | None, task: str = "classification") -> pa.Table:
    """``targets``: int class codes (classification), a float (rows, K) array (regression) or None
    (causal_lm, whose features are the tokens)."""
    columns = np.ascontiguousarray(features.T, dtype=np.float32)  # column-major, as Arrow stores it
    arrays = [pa.array(column) for column in columns]
    num_targets = 0
    if task == "classification":
        arrays.append(pa.array(targets.astype(np.int64, copy=False)))
    elif task == "regression":
        num_targets = targets.shape[1]
        arrays += [pa.array(column) for column in np.ascontiguousarray(targets.T, dtype=np.float32)]
    return pa.Table.from_arrays(arrays, schema=_schema(features.shape[1], task, num_targets))


def _write_split(
    out_dir: Path,
    features: np.ndarray,
    targets: np.ndarray | None,
    masks: dict[str, np.ndarray],
    row_group_rows: int,
    spec: dict,
) -> dict[str, int]:
    """Each split's rows in a seeded random order: files are often sorted (by label, by time), and
    partition keeps the input's order within a shard, which the shard reader's first epoch follows
    row group by row group. Built and written one row group at a time (the same bytes as one
    write_table), so the float32 copy never exceeds a row group. Returns the rows per split."""

    def table_of(rows: np.ndarray) -> pa.Table:
        return _table(features[rows], None if targets is None else targets[rows], spec["task"])

    schema = table_of(np.zeros(0, dtype=np.int64)).schema
    for index, (split, mask) in enumerate(masks.items()):
        rows = np.random.default_rng([spec["seed"], 11, index]).permutation(np.flatnonzero(mask))
        pieces = [
            rows[start : start + row_group_rows] for start in range(0, max(len(rows), 1), row_group_rows)
        ]
        with atomic_path(out_dir / f"{split}.parquet") as tmp, pq.ParquetWriter(tmp, schema) as writer:
            for piece in pieces:
                writer.write_table(table_of(piece), row_group_size=row_group_rows)
    return {split: int(np.count_nonzero(mask)) for split, mask in masks.items()}


# ---------------------------------------------------------------- in-memory sources


class Loaded(NamedTuple):
    """A dataset held in memory: features, and class codes (classification) or float targets
    (regression, shape rows x K)."""

    features: np.ndarray
    targets: np.ndarray
    feature_names: list[str]
    target_names: list[str]  # the class names (classification) or the target names (regression)


def _load_digits() -> Loaded:
    from sklearn.datasets import load_digits  # deferred: sklearn is slow to import and only needed here

    digits = load_digits()
    label_names = [str(int(v)) for v in digits.target_names]
    return Loaded(
        digits.data.astype(np.float32),
        digits.target.astype(np.int64),
        list(digits.feature_names),
        label_names,
    )


def _load_diabetes() -> Loaded:
    from sklearn.datasets import load_diabetes  # deferred, as for digits

    diabetes = load_diabetes()  # scikit-learn's default: scaled features, the raw disease-progression target
    targets = diabetes.target.astype(np.float32).reshape(-1, 1)
    return Loaded(diabetes.data.astype(np.float32), targets, list(diabetes.feature_names), ["target"])


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


FEATURE_TYPE_FIX = ", not a number; encode it numerically or drop it from feature_columns"
TARGET_TYPE_FIX = "; regression needs numeric targets — use task: classification or pick numeric columns"


def _numeric_matrix(
    table: pa.Table, names: list[str], path: str, role: str = "feature", type_fix: str = FEATURE_TYPE_FIX
) -> np.ndarray:
    """The columns ``names`` as a float32 (rows, len(names)) matrix; ``role`` names them in errors."""
    matrix = np.empty((table.num_rows, len(names)), dtype=np.float32)
    for j, name in enumerate(names):
        column = table.column(name)
        if not (pa.types.is_integer(column.type) or pa.types.is_floating(column.type)):
            raise UserError(f"{role} column {name!r} in {path} has type {column.type}{type_fix}")
        if column.null_count:
            raise UserError(
                f"{role} column {name!r} in {path} has {column.null_count} missing value(s); fill or "
                "drop those rows first"
            )
        matrix[:, j] = column.to_numpy()
        num_bad = int(np.count_nonzero(~np.isfinite(matrix[:, j])))
        if num_bad:
            raise UserError(
                f"{role} column {name!r} in {path} has {num_bad} NaN or infinite value(s) (after "
                "conversion to float32); fill or drop those rows first"
            )
    return matrix


def _label_codes(column: pa.ChunkedArray, name: str, path: str) -> tuple[np.ndarray, list[str]]:
    """Map labels of any sortable type to 0..C-1 in sorted order of their distinct values."""
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.null_count:
        raise UserError(
            f"label column {name!r} in {path} has {column.null_count} missing value(s); drop those rows first"
        )
    if pa.types.is_floating(column.type):
        if pc.any(pc.is_nan(column)).as_py():
            raise UserError(f"label column {name!r} in {path} has NaN values; drop those rows first")
        values = column.to_numpy()
        fractional = values[values != np.floor(values)]
        if fractional.size:  # a measurement, not a class: 0.37 and 0.38 would become two unrelated classes
            raise UserError(
                f"label column {name!r} in {path} holds non-integer floats (e.g. {fractional[0]:g}); a "
                f"classification label must be a class — use task: regression with label_columns: [{name}]"
            )
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


def _load_user_file(spec: dict) -> Loaded:
    table = _read_user_table(spec)
    path, features_wanted = spec["path"], spec["feature_columns"]
    targets_wanted = [spec["label_column"]] if spec["task"] == "classification" else spec["label_columns"]
    missing = [c for c in [*features_wanted, *targets_wanted] if c not in table.column_names]
    if missing:
        raise UserError(
            f"column(s) {', '.join(map(repr, missing))} not found in {path}; available columns: "
            f"{', '.join(table.column_names)}"
        )
    if table.num_rows == 0:
        raise UserError(f"{path} has no rows; point the dataset's path at a file with data")
    features = _numeric_matrix(table, features_wanted, path)
    if spec["task"] == "regression":
        if table.num_rows < 2:
            raise UserError(f"{path} has a single row; a train/test split needs at least 2: add rows")
        targets = _numeric_matrix(table, targets_wanted, path, "regression target", TARGET_TYPE_FIX)
        return Loaded(features, targets, list(features_wanted), list(targets_wanted))
    label_name = spec["label_column"]
    labels, label_names = _label_codes(table.column(label_name), label_name, path)
    if len(label_names) < 2:
        raise UserError(
            f"label column {label_name!r} in {path} has a single value {label_names[0]!r}; a "
            "classifier needs at least 2 classes"
        )
    return Loaded(features, labels, list(features_wanted), label_names)


def _kept_class_codes(classes: list, label_names: list[str]) -> np.ndarray:
    """The codes of the labels named in the spec's ``classes``, matched as strings ([0, 1] and ["0", "1"]
    both name digits' first two classes), else as numbers (1 names a float label "1.0")."""
    codes = []
    for value in classes:
        matches = [code for code, name in enumerate(label_names) if name == str(value)]
        matches = matches or [code for code, name in enumerate(label_names) if _same_number(name, value)]
        if not matches:
            shown = ", ".join(label_names[:20]) + (", …" if len(label_names) > 20 else "")
            raise UserError(
                f"class {value!r} in spec key 'classes' is not a label of this dataset; valid labels: {shown}"
            )
        codes.append(matches[0])
    return np.unique(np.asarray(codes, dtype=np.int64))


def _same_number(name: str, value: Any) -> bool:
    try:
        return float(name) == float(value)
    except (ValueError, OverflowError):
        return False


def _prepare_in_memory(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    loader = {"digits": _load_digits, "diabetes": _load_diabetes}.get(spec["source"])
    loaded = loader() if loader else _load_user_file(spec)
    features, targets = loaded.features, loaded.targets
    if spec["task"] == "regression":
        masks = _random_split_masks(len(features), spec)
        rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec)
        return Written(rows, loaded.feature_names, [], {"target_names": loaded.target_names})
    label_names = loaded.target_names
    if "classes" in spec:
        keep = np.isin(targets, _kept_class_codes(spec["classes"], label_names))
        features, targets = features[keep], targets[keep]
    counts = np.bincount(targets, minlength=len(label_names))
    rare = [f"{label_names[c]!r}" for c in np.flatnonzero(counts == 1)]
    if rare:
        raise UserError(
            f"label value(s) {', '.join(rare[:10])} in {spec.get('path', spec['source'])} have a single "
            "row; a stratified split needs at least 2 rows per class: add rows or drop those"
        )
    masks = _split_masks(targets, len(label_names), spec)
    rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec)
    return Written(rows, loaded.feature_names, label_names, {})


# ---------------------------------------------------------------- synthetic source


def synthetic_chunk_rows(row_values: int) -> int:
    """Rows per chunk when each row takes ``row_values`` values (features, or all a row's arrays)."""
    return max(1, SYNTHETIC_CHUNK_VALUES // row_values)


def _chunk_masks(
    spec: dict, num_classes: int, rng: np.random.Generator, start: int, stop: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Rows [start, stop) in random order: labels cycle through the classes by global row index, so every
    class has num_rows // C or one more rows; the test rows of each class are spread evenly over its rows
    (Bresenham-style), which makes the split stratified across all chunks, not just within one. With one
    class (regression) it is a split of exactly round(num_rows * test_fraction) test rows; as the rows
    themselves are random draws, which row index is a test row does not matter."""
    test_fraction = spec["test_fraction"]
    rows = rng.permutation(np.arange(start, stop, dtype=np.int64))  # rows come out in random class order
    labels = rows % num_classes
    position = rows // num_classes  # index of the row within its class
    is_test = _spread(position, test_fraction)
    # The same rule once more over the non-test rows of each class (index: rows before it that are not
    # test rows), with the share that makes val_fraction of all rows.
    remaining_position = position - np.floor(position * test_fraction + 0.5).astype(np.int64)
    is_val = ~is_test & _spread(remaining_position, _val_share(spec))
    return labels, {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def _synthetic_chunk(
    spec: dict,
    centroids: np.ndarray,
    mix_source: np.ndarray,
    mix_weight: np.ndarray,
    chunk_index: int,
    start: int,
    stop: int,
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng([spec["seed"], 1, chunk_index])  # stream 0 holds the shared parameters
    labels, masks = _chunk_masks(spec, spec["num_classes"], rng, start, stop)
    features = rng.standard_normal((stop - start, centroids.shape[1]))
    features += centroids[labels]
    # Mix each feature with one other: correlated features, elementwise so the bits do not depend on
    # the CPU (a BLAS matmul would).
    features += mix_weight * features[:, mix_source]
    return features.astype(np.float32), labels, masks


class RegressionFunction(NamedTuple):
    """y = (x W) / sqrt(1 + (x W)^2) V * scale: a one-hidden-layer network with a smooth saturating
    activation. Not tanh: NumPy's tanh may take a CPU-specific SIMD path, while this one is made of
    correctly rounded operations only, so the targets have the same bits on every CPU."""

    hidden_weight: np.ndarray  # (F, H)
    output_weight: np.ndarray  # (H, K)
    scale: np.ndarray  # (K,), 1 / each target's std over the calibration rows

    def __call__(self, features: np.ndarray) -> np.ndarray:
        # Products summed in a fixed order, elementwise, for the reason above (a BLAS matmul's order varies).
        x = features.astype(np.float64)
        hidden = np.zeros((len(x), self.hidden_weight.shape[1]))
        for j in range(x.shape[1]):
            hidden += x[:, j, None] * self.hidden_weight[j]
        hidden /= np.sqrt(1.0 + hidden * hidden)
        outputs = np.zeros((len(x), self.output_weight.shape[1]))
        for h in range(hidden.shape[1]):
            outputs += hidden[:, h, None] * self.output_weight[h]
        return outputs * self.scale


def synthetic_regression_function(spec: dict) -> RegressionFunction:
    """The seeded function of a synthetic regression spec (tests recompute targets with it)."""
    params = np.random.default_rng([spec["seed"], 0])
    num_features = spec["num_features"]
    # Pre-activations of std about 2: the activation saturates often enough that a linear model leaves
    # a clear share of the variance to a network, as a regression benchmark should.
    hidden_weight = params.standard_normal((num_features, SYNTHETIC_HIDDEN)) * (2 / math.sqrt(num_features))
    output_weight = params.standard_normal((SYNTHETIC_HIDDEN, spec["num_outputs"]))
    unscaled = RegressionFunction(hidden_weight, output_weight, np.ones(spec["num_outputs"]))
    calibration = params.standard_normal((SYNTHETIC_CALIBRATION_ROWS, num_features)).astype(np.float32)
    return unscaled._replace(scale=1.0 / unscaled(calibration).std(axis=0))


def _regression_chunk(
    spec: dict, function: RegressionFunction, chunk_index: int, start: int, stop: int
) -> tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]:
    rng = np.random.default_rng([spec["seed"], 1, chunk_index])
    _, masks = _chunk_masks(spec, 1, rng, start, stop)
    features = rng.standard_normal((stop - start, spec["num_features"])).astype(np.float32)
    noise = rng.standard_normal((stop - start, spec["num_outputs"]))
    # The function of the stored float32 features, so a reader can recompute it exactly.
    return features, (function(features) + spec["noise"] * noise).astype(np.float32), masks


def _spread(position: np.ndarray, fraction: float) -> np.ndarray:
    """Bresenham-style: position p is picked when round((p + 1) * fraction) steps past round(p * fraction),
    so any n consecutive positions from 0 hold round(n * fraction) picks, spread evenly."""
    return np.floor((position + 1) * fraction + 0.5) > np.floor(position * fraction + 0.5)


def _val_share(spec: dict) -> float:
    return spec["val_fraction"] / (1 - spec["test_fraction"])


def _class_splits_both_ways(class_rows: int, test_fraction: float, val_share: float = 0.0) -> bool:
    """Whether a synthetic class of this size gets at least one train and one test row."""
    num_test = math.floor(class_rows * test_fraction + 0.5)  # what _chunk_masks's rule adds up to
    class_rows -= math.floor((class_rows - num_test) * val_share + 0.5)  # validation rows leave training
    return 1 <= num_test < class_rows


def _check_synthetic_rows(spec: dict, num_classes: int) -> None:
    """Every class (regression: all rows, one class) must get a train and a test row."""
    num_rows, test_fraction, val_share = spec["num_rows"], spec["test_fraction"], _val_share(spec)
    if _class_splits_both_ways(num_rows // num_classes, test_fraction, val_share):
        return
    # Smallest workable class size: start from the analytic bound (without validation rows), step up.
    class_rows = max(2, math.ceil(0.5 / test_fraction), math.floor(0.5 / (1 - test_fraction)) + 1)
    while not _class_splits_both_ways(class_rows, test_fraction, val_share):
        class_rows += 1
    if spec["task"] == "classification":
        what, fault = f"{num_classes} classes", "some class would get no train or no test row"
    else:
        what, fault = "a regression split", "the split would get no train or no test row"
    raise UserError(
        f"num_rows={num_rows} is too small for {what} at test_fraction={test_fraction} "
        f"(val_fraction={spec['val_fraction']}): {fault}; use num_rows >= {num_classes * class_rows}"
    )


def _prepare_synthetic(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    num_rows, num_features, task = spec["num_rows"], spec["num_features"], spec["task"]
    feature_names = [f"x{j}" for j in range(num_features)]
    if task == "regression":
        _check_synthetic_rows(spec, 1)
        function = synthetic_regression_function(spec)
        num_outputs = spec["num_outputs"]
        # A chunk holds the features, the hidden layer and the targets of its rows (float64).
        chunk_rows = synthetic_chunk_rows(num_features + SYNTHETIC_HIDDEN + num_outputs)
        chunks = (
            _regression_chunk(spec, function, index, start, min(start + chunk_rows, num_rows))
            for index, start in enumerate(range(0, num_rows, chunk_rows))
        )
        target_names = [f"y{k}" for k in range(num_outputs)]
        rows = _write_chunks(out_dir, _schema(num_features, task, num_outputs), chunks, row_group_rows, spec)
        return Written(rows, feature_names, [], {"target_names": target_names})

    num_classes = spec["num_classes"]
    _check_synthetic_rows(spec, num_classes)
    label_names = [str(c) for c in range(num_classes)]
    kept = _kept_class_codes(spec["classes"], label_names) if "classes" in spec else None
    params = np.random.default_rng([spec["seed"], 0])
    # Centroid spread scales with 1/sqrt(F), so class_sep sets the difficulty whatever num_features is:
    # two centroids lie about 2 * sqrt(2) * class_sep noise standard deviations apart.
    centroids = params.standard_normal((num_classes, num_features)) * (
        2 * spec["class_sep"] / math.sqrt(num_features)
    )
    mix_source = params.permutation(num_features)
    mix_weight = params.uniform(-1.0, 1.0, num_features)
    chunk_rows = synthetic_chunk_rows(num_features)
    chunks = (
        _synthetic_chunk(
            spec, centroids, mix_source, mix_weight, index, start, min(start + chunk_rows, num_rows)
        )
        for index, start in enumerate(range(0, num_rows, chunk_rows))
    )
    if kept is not None:  # the rows of other classes are generated (same streams) and dropped
        chunks = (
            (features, labels, {split: mask & np.isin(labels, kept) for split, mask in masks.items()})
            for features, labels, masks in chunks
        )
    rows = _write_chunks(out_dir, _schema(num_features), chunks, row_group_rows, spec)
    return Written(rows, feature_names, label_names, {})


def _write_chunks(
    out_dir: Path,
    schema: pa.Schema,
    chunks: Iterator[tuple[np.ndarray, np.ndarray, dict[str, np.ndarray]]],
    row_group_rows: int,
    spec: dict,
) -> dict[str, int]:
    """Stream (features, targets, split masks) chunks into the three split files; returns rows per split."""
    num_written = dict.fromkeys(SPLITS, 0)
    with contextlib.ExitStack() as stack:
        writers = {
            split: stack.enter_context(
                pq.ParquetWriter(stack.enter_context(atomic_path(out_dir / f"{split}.parquet")), schema)
            )
            for split in SPLITS
        }
        for features, targets, masks in chunks:
            for split, mask in masks.items():
                table = _table(features[mask], targets[mask], spec["task"])
                writers[split].write_table(table, row_group_size=row_group_rows)
                num_written[split] += int(np.count_nonzero(mask))
    return num_written


# ---------------------------------------------------------------- text source


def _text_files(spec: dict) -> list[str]:
    """The files the spec's ``paths`` globs match, less those an ``exclude`` pattern matches (against the
    path as globbed or its absolute form), each once, sorted by absolute path."""
    found: dict[str, str] = {}
    for pattern in spec["paths"]:
        for path in glob.glob(pattern, recursive=True):
            full = os.path.abspath(path)
            excluded = any(fnmatch.fnmatch(p, x) for p in (path, full) for x in spec["exclude"])
            if not excluded and os.path.isfile(path):
                found[full] = path
    if not found:
        excluding = f" (after exclude {spec['exclude']})" if spec["exclude"] else ""
        raise UserError(
            f"no file matches the text dataset's paths {spec['paths']}{excluding}; fix 'paths' (relative "
            f"to {os.getcwd()}, or absolute)"
        )
    return [found[full] for full in sorted(found)]


def _read_text(files: list[str], max_tokens: int | None) -> bytearray:
    """The files' bytes joined by b"\\n", at most max_tokens of them (files read only as far as needed)."""
    corpus = bytearray()
    for index, path in enumerate(files):
        if max_tokens is not None and len(corpus) >= max_tokens:
            break
        if index:
            corpus += b"\n"
        try:
            with open(path, "rb") as file:
                corpus += file.read(-1 if max_tokens is None else max(0, max_tokens - len(corpus)))
        except OSError as exc:
            raise UserError(
                f"cannot read text file {path} ({error_reason(exc)}); fix 'paths' or the file"
            ) from None
    if max_tokens is not None:
        del corpus[max_tokens:]  # the last separator may have stepped past it
    return corpus


def _prepare_text(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    corpus = _read_text(_text_files(spec), spec["max_tokens"])
    row_tokens = spec["block_size"] + 1  # block_size inputs and, shifted by one, block_size targets
    num_blocks = len(corpus) // row_tokens
    if num_blocks < 3:
        raise UserError(
            f"the text files give {len(corpus)} tokens, {num_blocks} block(s) of block_size + 1 = "
            f"{row_tokens}; a train/val/test split needs at least 3: add text or lower block_size"
        )
    blocks = np.frombuffer(corpus, dtype=np.uint8, count=num_blocks * row_tokens).reshape(num_blocks, -1)
    rows = _write_split(out_dir, blocks, None, _random_split_masks(num_blocks, spec), row_group_rows, spec)
    feature_names = [f"t{j}" for j in range(row_tokens)]
    extra = {"vocab_size": VOCAB_SIZE, "block_size": spec["block_size"], "num_tokens": len(corpus)}
    return Written(rows, feature_names, [], extra)


# ---------------------------------------------------------------- stage entry points


def prepare(name: str, spec: Any, out_dir: str | Path, row_group_rows: int = ROW_GROUP_ROWS) -> dict:
    """Write OUT_DIR/{train,val,test}.parquet and dataset.json for ``spec``; return the dataset.json content.

    ``row_group_rows`` only changes the Parquet layout, never the rows (tests rely on that)."""
    if not isinstance(name, str) or not name:
        raise UserError("--name must be a non-empty dataset name, e.g. --name digits")
    spec = validate_spec(spec)
    out_dir = Path(out_dir)
    preparer = {"synthetic": _prepare_synthetic, "text": _prepare_text}.get(
        spec["source"], _prepare_in_memory
    )
    written = preparer(spec, out_dir, row_group_rows)
    info = {
        "name": name,
        "source": spec["source"],
        "task": spec["task"],
        "num_features": len(written.feature_names),
        "num_classes": len(written.label_names),
        "feature_names": written.feature_names,
        "label_names": written.label_names,
        **written.task_keys,
        "rows": written.rows,
        "test_fraction": spec["test_fraction"],
        "val_fraction": spec["val_fraction"],
        "seed": spec["seed"],
        "sha256": {split: sha256_file(out_dir / f"{split}.parquet") for split in SPLITS},
    }
    write_json(out_dir / "dataset.json", info)
    # Partition reuses these checksums (one pass less over train.parquet) while the files are unchanged.
    write_stamps(out_dir, {f"{split}.parquet": info["sha256"][split] for split in SPLITS})
    return info


def _describe(info: dict) -> str:
    if info["task"] == "classification":
        return f"{info['num_features']} features, {info['num_classes']} classes"
    if info["task"] == "regression":
        return f"{info['num_features']} features, {len(info['target_names'])} target(s)"
    return f"{info['num_tokens']} tokens in blocks of {info['block_size']} + 1"


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
        f"{info['name']} ({info['task']}): {info['rows']['train']} train / {info['rows']['val']} val / "
        f"{info['rows']['test']} test rows, {_describe(info)} -> {args.out_dir}"
    )


if __name__ == "__main__":
    run_cli(main)
