"""The dataset sources read whole: scikit-learn's digits and diabetes, the user's Parquet or CSV file
(its label column coded 0..C-1), and the text source (a corpus of files cut into byte-token blocks).

No command line; a library module: the prepare stage (:mod:`shardfuse.prepare`) validates a spec, asks
a source for its rows, then splits and writes them (the synthetic source, generated chunk by chunk, is
:mod:`shardfuse.synthetic`). A source takes a spec as ``prepare.validate_spec`` returns it (defaults and
``task`` filled in) and raises ``UserError`` for faults in the data. By hand::

    python -c "from shardfuse.sources import load_in_memory
    loaded = load_in_memory({'source': 'digits', 'task': 'classification'})
    print(loaded.features.shape, loaded.target_names)"   # (1797, 64) ['0', ..., '9']

Labels of a classification source are coded in sorted order of their distinct values; the spec's
``classes`` names labels by value (:func:`kept_class_codes`), and the label space stays the whole data's.
"""

from __future__ import annotations

import fnmatch
import glob
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from shardfuse.io import UserError, error_reason

VOCAB_SIZE = 256  # text is tokenized into its bytes


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


def load_in_memory(spec: dict) -> Loaded:
    """The whole dataset of a digits, diabetes, parquet or csv spec, before any split."""
    loader = {"digits": _load_digits, "diabetes": _load_diabetes}.get(spec["source"])
    return loader() if loader else _load_user_file(spec)


def kept_class_codes(classes: list, label_names: list[str]) -> np.ndarray:
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


def read_text_blocks(spec: dict) -> tuple[np.ndarray, int]:
    """The text spec's rows, a (num_blocks, block_size + 1) uint8 array of byte tokens (the tail that
    fills no block is dropped), and the number of tokens read."""
    corpus = _read_text(_text_files(spec), spec["max_tokens"])
    row_tokens = spec["block_size"] + 1  # block_size inputs and, shifted by one, block_size targets
    num_blocks = len(corpus) // row_tokens
    if num_blocks < 3:
        raise UserError(
            f"the text files give {len(corpus)} tokens, {num_blocks} block(s) of block_size + 1 = "
            f"{row_tokens}; a train/val/test split needs at least 3: add text or lower block_size"
        )
    blocks = np.frombuffer(corpus, dtype=np.uint8, count=num_blocks * row_tokens).reshape(num_blocks, -1)
    return blocks, len(corpus)
