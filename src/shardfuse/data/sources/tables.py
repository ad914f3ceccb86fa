"""The dataset sources read whole from a table: scikit-learn's digits and diabetes, and the user's CSV
file (its label column coded 0..C-1, or its target columns); the user's Parquet file shares the CSV's
reading (:class:`UserFile`) and lives with the tensor sources (:mod:`shardfuse.data.sources.images`).

No command line; a library module: each class is a source's behaviour, named by its record in
:mod:`shardfuse.data.sources.registry`; the prepare stage validates a spec, asks the source for its rows,
then splits and writes them. By hand::

    python -c "from shardfuse.data.sources.tables import Digits; from shardfuse.models.tasks import task_for
    loaded = Digits().load({'source': 'digits'}, task_for('classification'))
    print(loaded.features.shape, loaded.target_names)"   # (1797, 64) ['0', ..., '9']

Labels of a classification source are coded in sorted order of their distinct values; the spec's
``classes`` names labels by value (:func:`shardfuse.data.labels.kept_class_codes`), and the label space
stays the whole data's. Columns carried as data, never inputs (:mod:`shardfuse.data.sources.carried`):
a user file's ``keep_columns`` as they are, digits' ``writers: N`` as a column ``writer``. A user file's
``categorical_columns`` travel as they are until the split is drawn, then are one-hot encoded with the
train split's categories (:mod:`shardfuse.data.sources.categorical`).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pacsv

from shardfuse.data.shard_format import (
    FEATURE_COLUMN,
    LABEL_COLUMN,
    TARGET_COLUMN,
    TENSOR_COLUMN,
    TOKENS_COLUMN,
)
from shardfuse.data.sources.base import Described, Loaded, SourceBehaviour
from shardfuse.data.sources.carried import KEEP_COLUMNS, WRITER_COLUMN, WRITERS
from shardfuse.data.sources.categorical import Categorical, categorical_column
from shardfuse.data.sources.checks import SPEC_FIX, require_int, require_names, require_shape, require_string
from shardfuse.data.sources.columns import CATEGORICAL_COLUMNS, CATEGORICAL_FIX, categorical_problem
from shardfuse.data.sources.registry import find_source
from shardfuse.io import UserError, error_reason
from shardfuse.models.task import CLASSES, VALUES, Task

# A float label column with more distinct values than this, averaging fewer than MIN_CLASS_ROWS rows
# each, is a measurement rather than classes (config/README.md, label_column).
MAX_FLOAT_CLASSES = 20
DECIMAL_CASTS = "decimal_casts"  # dataset.json: the decimal columns read as float32, and their types
MIN_CLASS_ROWS = 10
DIGIT_CLASSES = [str(digit) for digit in range(10)]
NUM_DIGITS = 1797  # rows of scikit-learn's digits: at most one writer each
DIGIT_PIXELS = [f"pixel_{row}_{col}" for row in range(8) for col in range(8)]  # scikit-learn's names
DIABETES_FEATURES = ["age", "sex", "bmi", "bp", "s1", "s2", "s3", "s4", "s5", "s6"]


# ---------------------------------------------------------------- scikit-learn's bundled data


class Digits(SourceBehaviour):
    """scikit-learn's handwritten digits: 1797 rows of 64 pixel counts (0..16), 10 classes.

    They are UCI optdigits' test file, written by 13 people and kept in collection order (the first rows
    cycle 0..9 as on a form), but no writer id ships with them: ``writers: N`` adds a column ``writer``
    of N contiguous blocks of the row order, a stand-in for the writer, not a verified one."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        if WRITERS in spec:
            require_int(spec, WRITERS, 2, NUM_DIGITS)

    def describe(self, spec: dict[str, Any], task: Task) -> Described:
        return Described("numeric", [64], DIGIT_PIXELS, DIGIT_CLASSES)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        from sklearn.datasets import load_digits  # deferred: sklearn is slow to import and only needed here

        digits = load_digits()
        label_names = [str(int(v)) for v in digits.target_names]
        loaded = Loaded(
            digits.data.astype(np.float32),
            digits.target.astype(np.int64),
            list(digits.feature_names),
            label_names,
        )
        if WRITERS not in spec:
            return loaded
        writers = np.arange(len(digits.target), dtype=np.int64) * spec[WRITERS] // len(digits.target)
        return loaded._replace(carried=pa.table({WRITER_COLUMN: writers}))


class Diabetes(SourceBehaviour):
    """scikit-learn's diabetes data: 442 rows, 10 features, one float target."""

    def describe(self, spec: dict[str, Any], task: Task) -> Described:
        return Described("numeric", [10], DIABETES_FEATURES, ["target"])

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        from sklearn.datasets import load_diabetes  # deferred, as for digits

        diabetes = (
            load_diabetes()
        )  # scikit-learn's default: scaled features, the raw disease-progression target
        targets = diabetes.target.astype(np.float32).reshape(-1, 1)
        return Loaded(diabetes.data.astype(np.float32), targets, list(diabetes.feature_names), ["target"])


# ---------------------------------------------------------------- the user's table (CSV here, Parquet too)


class UserFile(SourceBehaviour):
    """A user's table: the feature columns as numbers (or categories, one-hot encoded), and the label
    column (classes, coded 0..C-1) or the target columns (values). Subclasses open the file (:meth:`open`)."""

    def open(self, path: Path) -> tuple[list[str], Callable[[list[str]], pa.Table]]:
        """The file's column names, and a reader of some of its columns."""
        raise NotImplementedError

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_string(spec, "path")
        require_names(spec, "feature_columns", "non-empty list of distinct column names")
        columns = spec["feature_columns"]
        if task.labels == CLASSES and (
            not isinstance(spec["label_column"], str) or spec["label_column"] in columns
        ):
            raise UserError(
                f"spec key 'label_column' must be a column name not among feature_columns, got "
                f"{spec['label_column']!r}; {SPEC_FIX}"
            )
        if task.labels == VALUES:
            what = "non-empty list of distinct column names, none of them among feature_columns"
            require_names(spec, "label_columns", what)
            if set(spec["label_columns"]) & set(columns):
                raise UserError(
                    f"spec key 'label_columns' must be a {what}, got {spec['label_columns']!r}; {SPEC_FIX}"
                )
        if "feature_shape" in spec:
            require_shape(spec, "feature_shape")
        if KEEP_COLUMNS in spec:
            _check_keep_columns(spec, task)
        if problem := categorical_problem(spec):
            raise UserError(f"spec key {problem[0]!r} {problem[1]} ({SPEC_FIX})")

    def _read_columns(self, path: Path, source: str, wanted: list[str]) -> pa.Table:
        """The user file's columns ``wanted`` (each named once in its header; a Parquet file's other
        columns are not read)."""
        try:
            names, read = self.open(path)
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
            return read(list(dict.fromkeys(wanted)))
        except (pa.ArrowException, OSError) as exc:
            raise UserError(
                f"cannot read {path} as {source} ({error_reason(exc)}); check the file and the spec's "
                "'source'"
            ) from None

    def read_table(self, spec: dict[str, Any], task: Task) -> pa.Table:
        """The user's file, checked to hold rows and the spec's feature and target columns."""
        path = Path(spec["path"])
        require_file(path)
        targets = [spec["label_column"]] if task.labels == CLASSES else spec["label_columns"]
        wanted = [*spec["feature_columns"], *targets, *spec.get(KEEP_COLUMNS, [])]
        table = self._read_columns(path, spec["source"], wanted)
        if table.num_rows == 0:
            raise UserError(f"{path} has no rows; point the dataset's path at a file with data")
        return table

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        return self.rows(spec, task, self.read_table(spec, task))

    def rows(
        self, spec: dict[str, Any], task: Task, table: pa.Table, tensor: np.ndarray | None = None
    ) -> Loaded:
        """The rows of ``table``: the feature columns as numbers, or ``tensor`` (rows x *shape, read from
        ``table`` by :class:`shardfuse.data.sources.images.Parquet`) in their place."""
        path = spec["path"]
        if tensor is None:
            loaded = _feature_rows(spec, table)
        else:
            loaded = Loaded(tensor, np.zeros(0), [], [], "tensor")
        if KEEP_COLUMNS in spec:
            loaded = loaded._replace(carried=carried_columns(table, spec[KEEP_COLUMNS], path))
        if task.labels == VALUES:
            if table.num_rows < 2:
                raise UserError(f"{path} has a single row; a train/test split needs at least 2: add rows")
            targets_wanted = spec["label_columns"]
            targets = numeric_matrix(table, targets_wanted, path, "regression target", TARGET_TYPE_FIX)
            loaded = with_decimal_casts(loaded, table, targets_wanted)
            return loaded._replace(targets=targets, target_names=list(targets_wanted))
        label_name = spec["label_column"]
        labels, label_names = label_codes(table.column(label_name), label_name, path)
        if len(label_names) < 2:
            raise UserError(
                f"label column {label_name!r} in {path} has a single value {label_names[0]!r}; a "
                "classifier needs at least 2 classes"
            )
        return loaded._replace(targets=labels, target_names=label_names)


def _feature_rows(spec: dict[str, Any], table: pa.Table) -> Loaded:
    """The numeric feature columns as numbers, the categorical ones (``categorical_columns``) as they are
    until the split is drawn (:mod:`shardfuse.data.sources.categorical`)."""
    path, names, categorical = spec["path"], spec["feature_columns"], spec.get(CATEGORICAL_COLUMNS) or []
    numeric = [name for name in names if name not in categorical]
    # The fix a text column's error names: categorical_columns where the source takes it.
    fix = FEATURE_TYPE_FIX if CATEGORICAL_COLUMNS in find_source(spec["source"]).allowed() else NUMERIC_FIX
    loaded = Loaded(numeric_matrix(table, numeric, path, type_fix=fix), np.zeros(0), numeric, [])
    loaded = with_decimal_casts(loaded, table, numeric)
    if not categorical:
        return loaded
    columns = pa.table({name: categorical_column(table, name, path) for name in categorical})
    return loaded._replace(categorical=Categorical(columns, list(names), path))


class Csv(UserFile):
    """The user's CSV file (every column is read to find the header's names)."""

    def open(self, path: Path) -> tuple[list[str], Callable[[list[str]], pa.Table]]:
        # Empty cells are missing values in every column, also text labels (pyarrow keeps "").
        table = pacsv.read_csv(path, convert_options=pacsv.ConvertOptions(strings_can_be_null=True))
        return table.column_names, lambda columns: table

    def describe(self, spec: dict[str, Any], task: Task) -> Described | None:
        """Target columns are named in the spec; classes (and categories) only the file can tell."""
        if task.labels != VALUES or spec.get(CATEGORICAL_COLUMNS):
            return None
        columns = list(spec["feature_columns"])
        return Described("numeric", [len(columns)], columns, list(spec["label_columns"]))


def _is_reserved(name: str) -> bool:
    """A column name the shard format gives a meaning (an input or a target): carried data may not
    take it."""
    return (
        name in (LABEL_COLUMN, TENSOR_COLUMN, TOKENS_COLUMN)
        or FEATURE_COLUMN.fullmatch(name) is not None
        or TARGET_COLUMN.fullmatch(name) is not None
    )


def _check_keep_columns(spec: dict[str, Any], task: Task) -> None:
    """Distinct names, none a target column (the label travels as ``label``: keeping it too would let
    a group partition split by labels) and none a name the shard format reserves for inputs and
    targets. A feature column may also be kept: its values then travel twice, once as data."""
    require_names(spec, KEEP_COLUMNS, "non-empty list of distinct column names")
    targets = [spec["label_column"]] if task.labels == CLASSES else spec["label_columns"]
    for name in spec[KEEP_COLUMNS]:
        if name in targets or _is_reserved(name):
            what = "a target column of this spec" if name in targets else "a name the split files reserve"
            raise UserError(
                f"spec key 'keep_columns' names {name!r}, {what} (label, x, x0.., y0.., tokens); keep "
                f"group columns only, renamed in the file if need be ({SPEC_FIX})"
            )


def carried_columns(table: pa.Table, names: list[str], path: str) -> pa.Table:
    """The ``keep_columns`` of the user's table as they are (a dictionary column decoded to its
    values): integers, floats or strings without missing values."""
    columns = {}
    for name in names:
        column = table.column(name)
        if pa.types.is_dictionary(column.type):
            column = column.cast(column.type.value_type)
        kind = column.type
        if not (
            pa.types.is_integer(kind)
            or pa.types.is_floating(kind)
            or pa.types.is_string(kind)
            or pa.types.is_large_string(kind)
        ):
            raise UserError(
                f"keep column {name!r} in {path} has type {kind}; keep columns of integers, floats or "
                "strings (a group id), or drop it from keep_columns"
            )
        if column.null_count:
            raise UserError(
                f"keep column {name!r} in {path} has {column.null_count} missing value(s); fill or drop "
                "those rows first"
            )
        columns[name] = column
    return pa.table(columns)


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


FEATURE_TYPE_FIX = f", not a number; {CATEGORICAL_FIX}"
NUMERIC_FIX = ", not a number; encode it numerically or drop it from feature_columns"
TARGET_TYPE_FIX = "; regression needs numeric targets — use task: classification or pick numeric columns"


def check_finite(values: np.ndarray, what: str) -> None:
    num_bad = int(np.count_nonzero(~np.isfinite(values)))
    if num_bad:
        raise UserError(
            f"{what} has {num_bad} NaN or infinite value(s) (after conversion to float32); fill or drop "
            "those rows first"
        )


def numeric_matrix(
    table: pa.Table, names: list[str], path: str, role: str = "feature", type_fix: str = NUMERIC_FIX
) -> np.ndarray:
    """The columns ``names`` as a float32 (rows, len(names)) matrix; ``role`` names them in errors."""
    matrix = np.empty((table.num_rows, len(names)), dtype=np.float32)
    for j, name in enumerate(names):
        column = table.column(name)
        if pa.types.is_decimal(column.type):  # exact decimals, as float32 (decimal_casts records it)
            column = pc.cast(column, pa.float64())
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


def decimal_casts(table: pa.Table, names: list[str]) -> dict[str, str]:
    """dataset.json's ``decimal_casts``: each of ``names`` stored as exact decimals (a Parquet
    ``decimal128``, a database export) and the type it had; its values are read as float32, as every
    numeric column is (a decimal of more than 7 significant digits is rounded)."""
    types = {name: table.column(name).type for name in names}
    return {name: str(kind) for name, kind in types.items() if pa.types.is_decimal(kind)}


def with_decimal_casts(loaded: Loaded, table: pa.Table, names: list[str]) -> Loaded:
    """``loaded`` with the decimal columns among ``names`` recorded (nothing added when there are none)."""
    casts = decimal_casts(table, names)
    if not casts:
        return loaded
    recorded = {**((loaded.dataset_keys or {}).get(DECIMAL_CASTS) or {}), **casts}
    return loaded._replace(dataset_keys={**(loaded.dataset_keys or {}), DECIMAL_CASTS: recorded})


def label_codes(column: pa.ChunkedArray, name: str, path: str) -> tuple[np.ndarray, list[str]]:
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
