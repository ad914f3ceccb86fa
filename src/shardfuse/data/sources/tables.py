"""The dataset sources read whole: scikit-learn's digits and diabetes, the user's Parquet or CSV file
(its label column coded 0..C-1), and the text source (a corpus of files cut into token blocks), plus
the spec checks every source module shares.

No command line; a library module: the prepare stage (:mod:`shardfuse.prepare`) validates a spec, asks
a source for its rows, then splits and writes them (the synthetic source, generated chunk by chunk, is
:mod:`shardfuse.data.sources.synthetic`; the image and .npz sources are :mod:`shardfuse.data.sources.images`).
A source takes a spec as ``prepare.validate_spec`` returns it (defaults and ``task`` filled in) and raises
``UserError`` for faults in the data. By hand::

    python -c "from shardfuse.data.sources.tables import load_in_memory
    loaded = load_in_memory({'source': 'digits', 'task': 'classification'})
    print(loaded.features.shape, loaded.target_names)"   # (1797, 64) ['0', ..., '9']

Labels of a classification source are coded in sorted order of their distinct values; the spec's
``classes`` names labels by value (:func:`kept_class_codes`), and the label space stays the whole data's.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from shardfuse.data.provenance import matching_text_files
from shardfuse.data.shard_format import InputKind  # numeric columns, one tensor column, or token blocks
from shardfuse.data.sources.hf_tokenizer import is_hf, load_hf_tokenizer, tokenizer_file
from shardfuse.io import UserError, error_reason
from shardfuse.models.usercode import load_factory

VOCAB_SIZE = 256  # the byte tokenizer's vocabulary
# A float label column with more distinct values than this, averaging fewer than MIN_CLASS_ROWS rows
# each, is a measurement rather than classes (config/README.md, label_column).
MAX_FLOAT_CLASSES = 20
MIN_CLASS_ROWS = 10
MAX_UINT16_VOCAB = 65535  # token blocks are uint16 up to this vocabulary size, int32 above
SPEC_FIX = "fix the dataset's spec in the config"


# ---------------------------------------------------------------- spec checks shared by the sources


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def require_int(spec: dict, key: str, minimum: int, maximum: int | None = None) -> None:
    value = spec[key]
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum):
        what = f">= {minimum}" if maximum is None else f"from {minimum} to {maximum}"
        raise UserError(f"spec key {key!r} must be an integer {what}, got {value!r}; {SPEC_FIX}")


def require_number(spec: dict, key: str, low: float, high: float, *, open_interval: bool) -> None:
    value = spec[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or not (low < value < high if open_interval else low <= value <= high):
        what = f"strictly between {low} and {high}" if open_interval else f">= {low}"
        raise UserError(f"spec key {key!r} must be a number {what}, got {value!r}; {SPEC_FIX}")


def require_names(spec: dict, key: str, what: str, *, allow_empty: bool = False) -> None:
    """``spec[key]`` must be a list of distinct non-empty strings (non-empty unless ``allow_empty``)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not (value or allow_empty)
        or not all(isinstance(item, str) and item for item in value)
        or len(set(value)) != len(value)
    ):
        raise UserError(f"spec key {key!r} must be a {what}, got {value!r}; {SPEC_FIX}")


def require_string(spec: dict, key: str) -> None:
    if not isinstance(spec[key], str) or not spec[key]:
        raise UserError(f"spec key {key!r} must be a non-empty string, got {spec[key]!r}; {SPEC_FIX}")


def require_shape(spec: dict, key: str, num_dims: int | None = None) -> None:
    """``spec[key]`` must be a list of positive integers (``num_dims`` of them if given, else at least 1)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not value
        or (num_dims is not None and len(value) != num_dims)
        or not all(is_int(size) and size >= 1 for size in value)
    ):
        what = f"a list of {num_dims}" if num_dims else "a non-empty list of"
        raise UserError(f"spec key {key!r} must be {what} positive integers, got {value!r}; {SPEC_FIX}")


# ---------------------------------------------------------------- in-memory sources


class Loaded(NamedTuple):
    """A dataset held in memory: features (rows x F numeric columns, or rows x *shape for a tensor), and
    class codes (classification) or float targets (regression, shape rows x K)."""

    features: np.ndarray
    targets: np.ndarray
    feature_names: list[str]  # [] for a tensor
    target_names: list[str]  # the class names (classification) or the target names (regression)
    kind: InputKind = "numeric"
    dataset_keys: dict[str, Any] | None = None  # the source's own dataset.json keys (skipped_images)


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


def require_file(path: Path, what: str = "dataset file") -> None:
    """``path`` must be a regular file; if not, say what it is (missing, a directory, a FIFO...)."""
    if path.is_file():
        return
    if path.is_dir():
        problem = "is a directory, not a file"
    elif path.exists():
        problem = "is not a regular file (a FIFO, socket or device)"
    elif path.is_symlink():
        problem = "is a symbolic link to something that does not exist"
    else:
        problem = "does not exist"
    raise UserError(f"{what} {path} {problem}; fix 'path' in the dataset's spec")


def _read_user_columns(path: Path, source: str, wanted: list[str]) -> pa.Table:
    """The user file's columns ``wanted`` (each named once in its header; a Parquet file's other
    columns are not read)."""
    try:
        if source == "parquet":
            names = pq.read_schema(path).names
        else:  # empty cells are missing values in every column, also text labels (pyarrow keeps "")
            table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(strings_can_be_null=True))
            names = table.column_names
        twice = [name for name in dict.fromkeys(wanted) if names.count(name) > 1]
        if twice:
            raise UserError(
                f"column name(s) {', '.join(map(repr, twice))} appear more than once in the header of "
                f"{path}; rename the columns so that each name is unique"
            )
        missing = [name for name in wanted if name not in names]
        if missing:
            raise UserError(
                f"column(s) {', '.join(map(repr, missing))} not found in {path}; available columns: "
                f"{', '.join(names)}"
            )
        return pq.read_table(path, columns=list(dict.fromkeys(wanted))) if source == "parquet" else table
    except (pa.ArrowException, OSError) as exc:
        raise UserError(
            f"cannot read {path} as {source} ({error_reason(exc)}); check the file and the spec's 'source'"
        ) from None


def read_user_table(spec: dict) -> pa.Table:
    """The user's Parquet or CSV file, checked to hold rows and the spec's feature and target columns."""
    path = Path(spec["path"])
    require_file(path)
    targets = [spec["label_column"]] if spec["task"] == "classification" else spec["label_columns"]
    table = _read_user_columns(path, spec["source"], [*spec["feature_columns"], *targets])
    if table.num_rows == 0:
        raise UserError(f"{path} has no rows; point the dataset's path at a file with data")
    return table


FEATURE_TYPE_FIX = ", not a number; encode it numerically or drop it from feature_columns"
TARGET_TYPE_FIX = "; regression needs numeric targets — use task: classification or pick numeric columns"


def check_finite(values: np.ndarray, what: str) -> None:
    num_bad = int(np.count_nonzero(~np.isfinite(values)))
    if num_bad:
        raise UserError(
            f"{what} has {num_bad} NaN or infinite value(s) (after conversion to float32); fill or drop "
            "those rows first"
        )


def numeric_matrix(
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
        check_finite(matrix[:, j], f"{role} column {name!r} in {path}")
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
        check_not_continuous(values, f"label column {name!r} in {path}", f" with label_columns: [{name}]")
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


def check_not_continuous(values: np.ndarray, what: str, regression_keys: str = "") -> None:
    """Integral float labels with many distinct values, few rows each, are a measurement (an age, a
    price), not classes: training a classifier on them is never what was meant."""
    num_distinct = len(np.unique(values))
    if num_distinct > MAX_FLOAT_CLASSES and num_distinct * MIN_CLASS_ROWS > len(values):
        raise UserError(
            f"{what} looks continuous ({num_distinct} distinct float values in {len(values)} rows); set "
            f"task: regression{regression_keys} (or, if they are classes, store them as integers or strings)"
        )


def load_user_file(spec: dict, table: pa.Table | None = None, tensor: np.ndarray | None = None) -> Loaded:
    """A parquet or csv spec's rows: the feature columns as numbers, or ``tensor`` (rows x *shape, read
    from ``table`` by :mod:`shardfuse.data.sources.images`) in their place."""
    table = read_user_table(spec) if table is None else table
    path, features_wanted = spec["path"], spec["feature_columns"]
    if tensor is None:
        loaded = Loaded(numeric_matrix(table, features_wanted, path), np.zeros(0), list(features_wanted), [])
    else:
        loaded = Loaded(tensor, np.zeros(0), [], [], "tensor")
    if spec["task"] == "regression":
        if table.num_rows < 2:
            raise UserError(f"{path} has a single row; a train/test split needs at least 2: add rows")
        targets_wanted = spec["label_columns"]
        targets = numeric_matrix(table, targets_wanted, path, "regression target", TARGET_TYPE_FIX)
        return loaded._replace(targets=targets, target_names=list(targets_wanted))
    label_name = spec["label_column"]
    labels, label_names = _label_codes(table.column(label_name), label_name, path)
    if len(label_names) < 2:
        raise UserError(
            f"label column {label_name!r} in {path} has a single value {label_names[0]!r}; a "
            "classifier needs at least 2 classes"
        )
    return loaded._replace(targets=labels, target_names=label_names)


def check_user_file_spec(spec: dict) -> None:
    """The keys of a validated parquet or csv spec (task filled in)."""
    require_string(spec, "path")
    require_names(spec, "feature_columns", "non-empty list of distinct column names")
    columns = spec["feature_columns"]
    if spec["task"] == "classification" and (
        not isinstance(spec["label_column"], str) or spec["label_column"] in columns
    ):
        raise UserError(
            f"spec key 'label_column' must be a column name not among feature_columns, got "
            f"{spec['label_column']!r}; {SPEC_FIX}"
        )
    if spec["task"] == "regression":
        what = "non-empty list of distinct column names, none of them among feature_columns"
        require_names(spec, "label_columns", what)
        if set(spec["label_columns"]) & set(columns):
            raise UserError(
                f"spec key 'label_columns' must be a {what}, got {spec['label_columns']!r}; {SPEC_FIX}"
            )
    if "feature_shape" in spec:
        require_shape(spec, "feature_shape")


def load_in_memory(spec: dict) -> Loaded:
    """The whole dataset of a digits, diabetes, parquet or csv spec, before any split."""
    loader = {"digits": _load_digits, "diabetes": _load_diabetes}.get(spec["source"])
    return loader() if loader else load_user_file(spec)


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


def check_text_spec(spec: dict) -> None:
    """The keys of a validated text spec."""
    require_names(spec, "paths", "non-empty list of glob patterns")
    require_names(spec, "exclude", "list of glob patterns", allow_empty=True)
    require_int(spec, "block_size", 2)
    if spec["max_tokens"] is not None:
        require_int(spec, "max_tokens", 2)
    tokenizer = spec["tokenizer"]
    if is_hf(tokenizer):
        tokenizer_file(tokenizer)
        if "vocab_size" in spec:
            require_int(spec, "vocab_size", 2)
        return
    if tokenizer is None:
        if "vocab_size" in spec:
            raise UserError(
                "spec key 'vocab_size' only applies with a tokenizer (the byte tokenizer's vocabulary is "
                f"{VOCAB_SIZE}); drop vocab_size or set tokenizer: package.module:function"
            )
        return
    module_name, sep, attribute = tokenizer.partition(":") if isinstance(tokenizer, str) else ("", "", "")
    if not (module_name and sep and attribute):
        raise UserError(
            f"spec key 'tokenizer' must be an import path package.module:function (or null for bytes), "
            f"got {tokenizer!r}; {SPEC_FIX}"
        )
    if "vocab_size" not in spec:
        raise UserError(
            f"tokenizer {tokenizer!r} needs 'vocab_size' (one more than its largest token id); {SPEC_FIX}"
        )
    require_int(spec, "vocab_size", 2)
    if spec["vocab_size"] > np.iinfo(np.int32).max:
        raise UserError(f"spec key 'vocab_size' must be < 2**31, got {spec['vocab_size']}; {SPEC_FIX}")


def text_files(spec: dict) -> list[str]:
    """The files a text spec reads (:func:`shardfuse.data.provenance.matching_text_files`, which the
    workflow makes prepare's inputs); UserError when there are none."""
    found = matching_text_files(spec)
    if not found:
        excluding = f" (after exclude {spec['exclude']})" if spec["exclude"] else ""
        raise UserError(
            f"no file matches the text dataset's paths {spec['paths']}{excluding}; fix 'paths' (relative "
            f"to {os.getcwd()}, or absolute)"
        )
    return found


def _read_file(path: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(size)
    except OSError as exc:
        reason = error_reason(exc)
        raise UserError(f"cannot read text file {path} ({reason}); fix 'paths' or the file") from None


def _read_text(files: list[str], max_tokens: int | None) -> bytearray:
    """The files' bytes joined by b"\\n", at most max_tokens of them (files read only as far as needed)."""
    corpus = bytearray()
    for index, path in enumerate(files):
        if max_tokens is not None and len(corpus) >= max_tokens:
            break
        if index:
            corpus += b"\n"
        corpus += _read_file(path, -1 if max_tokens is None else max(0, max_tokens - len(corpus)))
    if max_tokens is not None:
        del corpus[max_tokens:]  # the last separator may have stepped past it
    return corpus


def _load_tokenizer(ref: str):
    if is_hf(ref):
        return load_hf_tokenizer(ref)[0]
    try:
        return load_factory(ref)
    except UserError as exc:  # usercode speaks of models; say tokenizer, and how a dataset finds its code
        message = str(exc).replace(f"model {ref!r}", f"tokenizer {ref!r}", 1)
        message = message.replace("add its directory to `code_paths`", "set PYTHONPATH to its directory")
        raise UserError(message.replace("returns an nn.Module", "maps bytes to token ids")) from None


def _token_ids(tokenize, data: bytes, what: str, spec: dict) -> np.ndarray:
    """The user tokenizer's ids for ``data`` as an int64 array, checked against the vocabulary."""
    ref, vocab_size = spec["tokenizer"], spec["vocab_size"]
    try:
        ids = np.asarray(tokenize(data))
    except Exception as exc:  # any failure inside user code is the user's to fix
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise UserError(f"tokenizer {ref!r} failed on {what} ({reason}); fix the tokenizer") from None
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise UserError(
            f"tokenizer {ref!r} returned {ids.dtype} values of shape {ids.shape} for {what}; it must "
            "return a list or 1-d array of integer token ids"
        )
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise UserError(
            f"tokenizer {ref!r} returned token id {bad[0]} for {what}, outside [0, vocab_size="
            f"{vocab_size}); raise vocab_size or fix the tokenizer"
        )
    return ids.astype(np.int64)


def _read_tokens(files: list[str], spec: dict) -> tuple[np.ndarray, float]:
    """The user tokenizer's ids of each file, joined by those of b"\\n" (as the byte tokenizer joins the
    files), at most max_tokens of them: files are read whole, and no further once max_tokens is reached;
    and the bytes per token of what was read (for bits per byte)."""
    tokenize, max_tokens = _load_tokenizer(spec["tokenizer"]), spec["max_tokens"]
    separator = _token_ids(tokenize, b"\n", "the file separator b'\\n'", spec)
    pieces: list[np.ndarray] = []
    num_tokens = num_bytes = 0
    for index, path in enumerate(files):
        if max_tokens is not None and num_tokens >= max_tokens:
            break
        data = _read_file(path)
        pieces += [separator] if index else []
        pieces.append(_token_ids(tokenize, data, path, spec))
        num_tokens += len(pieces[-1]) + (len(separator) if index else 0)
        num_bytes += len(data) + (1 if index else 0)
    return np.concatenate(pieces)[:max_tokens], num_bytes / max(num_tokens, 1)


def token_dtype(vocab_size: int) -> type[np.integer]:
    return np.uint16 if vocab_size <= MAX_UINT16_VOCAB else np.int32


class TextBlocks(NamedTuple):
    blocks: np.ndarray  # (num_blocks, block_size + 1) token ids
    num_tokens: int  # tokens read (the tail that fills no block included)
    vocab_size: int
    bytes_per_token: float | None  # of the text read; None for the byte tokenizer (1 by definition)


def read_text_blocks(spec: dict) -> TextBlocks:
    """The text spec's rows, a (num_blocks, block_size + 1) array of token ids (uint16, or int32 for a
    vocabulary over 65535; the tail that fills no block is dropped), with what dataset.json records."""
    files = text_files(spec)
    bytes_per_token = None
    if is_hf(spec["tokenizer"]):
        size = load_hf_tokenizer(spec["tokenizer"])[1]
        spec = {**spec, "vocab_size": max(size, spec.get("vocab_size", 0))}
    if spec["tokenizer"] is None:
        tokens = np.frombuffer(_read_text(files, spec["max_tokens"]), dtype=np.uint8)
    else:
        tokens, bytes_per_token = _read_tokens(files, spec)
    row_tokens = spec["block_size"] + 1  # block_size inputs and, shifted by one, block_size targets
    num_blocks = len(tokens) // row_tokens
    if num_blocks < 3:
        raise UserError(
            f"the text files give {len(tokens)} tokens, {num_blocks} block(s) of block_size + 1 = "
            f"{row_tokens}; a train/val/test split needs at least 3: add text or lower block_size"
        )
    blocks = tokens[: num_blocks * row_tokens].reshape(num_blocks, row_tokens)
    vocab_size = spec.get("vocab_size", VOCAB_SIZE)
    return TextBlocks(blocks.astype(token_dtype(vocab_size)), len(tokens), vocab_size, bytes_per_token)
