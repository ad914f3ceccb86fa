"""The feature columns of a user's table (csv, parquet) as the config check sees them before any job: the
spec's ``categorical_columns`` (distinct feature columns, not a target), and the column types the file
tells cheaply — a Parquet file's schema (no row is read), a CSV file's first block (``CSV_PROBE_BYTES``,
its types inferred by pyarrow as prepare infers them). A feature column that is not numeric and not
categorical is refused here, naming the column and the fix. A CSV column whose first rows are numbers
and later rows are not is still caught at prepare (pyarrow then reads the whole column as text).

An hf_disk table's feature columns are judged from its dataset_info.json features: an ``Image`` feature
column must be the only feature column and needs ``image_size``; the image keys (``IMAGE_KEYS``) need
such a column (:func:`hf_disk_problem`; prepare judges the same from the Arrow schema when the folder
has no such file).

Standard library only at import (the Snakefile imports the source records, which name
:func:`csv_problem` and :func:`parquet_problem`); pyarrow is imported when a file is probed. A library
module. By hand::

    python -c "from shardfuse.data.sources.columns import csv_problem
    print(csv_problem({'path': 'data.csv', 'feature_columns': ['a', 'kind'], 'label_column': 'y'}))"
    # ('feature_columns', "column 'kind' of data.csv has type string, not a number; list it in ...")
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfuse.data.sources.hf_tokenizer import chat_problem

if TYPE_CHECKING:
    import pyarrow as pa

CATEGORICAL_COLUMNS = "categorical_columns"
IMAGE_KEYS = ("image_size", "mode", "on_bad_image")  # image_folder's keys, hf_disk's for an Image column
CSV_PROBE_BYTES = 1 << 20  # the CSV bytes whose types the config check infers (pyarrow's first block)
CATEGORICAL_FIX = "list it in categorical_columns (one-hot encoded) or drop it from feature_columns"


def one_hot_names(column: str, vocabulary: list[str]) -> list[str]:
    """The feature names of a categorical column's one-hot block, in vocabulary order."""
    return [f"{column}={value}" for value in vocabulary]


def one_hot_matrix(codes: Any, num_categories: int) -> Any:
    """rows x categories float32 (a NumPy array): a 1 at each row's category code, all zeros where the
    code is -1 (a value outside the vocabulary)."""
    import numpy as np

    codes = np.asarray(codes, dtype=np.int64)
    matrix = np.zeros((len(codes), num_categories), dtype=np.float32)
    seen = codes >= 0
    matrix[np.flatnonzero(seen), codes[seen]] = 1.0
    return matrix


def is_numeric_type(kind: pa.DataType) -> bool:
    import pyarrow as pa

    return pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_decimal(kind)


def is_categorical_type(kind: pa.DataType) -> bool:
    """Strings, integers or booleans (a dictionary of them too): values a category is named by."""
    import pyarrow as pa

    if pa.types.is_dictionary(kind):
        kind = kind.value_type
    types = pa.types
    return (
        types.is_string(kind)
        or types.is_large_string(kind)
        or types.is_integer(kind)
        or types.is_boolean(kind)
    )


def categorical_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what is wrong and the fix) when ``categorical_columns`` is not a list of distinct feature
    columns (not a target, no ``feature_shape``); None when absent or fine."""
    names = spec.get(CATEGORICAL_COLUMNS)
    if names is None:
        return None
    if (
        not isinstance(names, list)
        or not names
        or not all(isinstance(name, str) and name for name in names)
        or len(set(names)) != len(names)
    ):
        return CATEGORICAL_COLUMNS, f"must be a non-empty list of distinct column names, got {names!r}"
    targets = [spec.get("label_column"), *(spec.get("label_columns") or [])]
    for name in names:
        if name in targets:
            return CATEGORICAL_COLUMNS, (
                f"names {name!r}, a target column (labels are coded by their own vocabulary, label_names); "
                "drop it from categorical_columns"
            )
        if name not in (spec.get("feature_columns") or []):
            return CATEGORICAL_COLUMNS, (
                f"names {name!r}, which is not among feature_columns; list it in feature_columns too, or "
                "drop it from categorical_columns"
            )
    if "feature_shape" in spec:
        return CATEGORICAL_COLUMNS, "cannot go with feature_shape (a tensor has no one-hot block); drop one"
    return None


def parquet_schema(path: Path) -> pa.Schema:
    """A Parquet file's schema, from its footer: no row is read."""
    import pyarrow.parquet as pq

    return pq.read_schema(path)


def csv_schema(path: Path) -> pa.Schema:
    """A CSV file's columns, their types inferred from its first ``CSV_PROBE_BYTES`` as prepare infers
    them (empty cells are missing values)."""
    import pyarrow.csv as pacsv

    options = pacsv.ConvertOptions(strings_can_be_null=True)
    with pacsv.open_csv(
        path, pacsv.ReadOptions(block_size=CSV_PROBE_BYTES), convert_options=options
    ) as reader:
        return reader.schema


def _column_types(path: Path, read_schema: Callable[[Path], pa.Schema]) -> dict[str, pa.DataType]:
    """Each column's type as the file tells it cheaply; {} when it cannot be read now (prepare says why:
    a missing file, another rule's output, a broken one). Names the header holds twice are left out."""
    import pyarrow as pa

    if not path.is_file():
        return {}
    try:
        schema = read_schema(path)
    except (pa.ArrowException, OSError):
        return {}
    return {field.name: field.type for field in schema if schema.names.count(field.name) == 1}


def _type_problem(name: str, kind: pa.DataType, categorical: bool, path: str) -> tuple[str, str] | None:
    import pyarrow as pa

    if pa.types.is_null(kind) or (
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    ):
        return None  # no value in the probed rows, or a tensor column: prepare judges them
    if categorical and not is_categorical_type(kind):
        return CATEGORICAL_COLUMNS, (
            f"column {name!r} of {path} has type {kind}; a categorical column holds strings, integers or "
            "booleans: drop it from categorical_columns"
        )
    if not categorical and not is_numeric_type(kind):
        return (
            "feature_columns",
            f"column {name!r} of {path} has type {kind}, not a number; {CATEGORICAL_FIX}",
        )
    return None


def _table_problem(spec: dict[str, Any], read_schema: Callable[[Path], pa.Schema]) -> tuple[str, str] | None:
    """(key, what is wrong and the fix) of a user table's spec before any job: its
    ``categorical_columns``, then each feature column's type in the file's schema; None if fine."""
    if problem := categorical_problem(spec):
        return problem
    if not isinstance(spec.get("path"), str) or not isinstance(spec.get("feature_columns"), list):
        return None
    types = _column_types(Path(spec["path"]), read_schema)
    categorical = set(spec.get(CATEGORICAL_COLUMNS) or [])
    for name in spec["feature_columns"]:
        if name in types and (problem := _type_problem(name, types[name], name in categorical, spec["path"])):
            return problem
    return None


def parquet_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """The config check of a parquet spec (its record names it): the schema's types."""
    return _table_problem(spec, parquet_schema)


def csv_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """The config check of a csv spec (its record names it): the first MiB's types."""
    return _table_problem(spec, csv_schema)


def is_image_type(kind: pa.DataType) -> bool:
    """The Arrow type ``datasets`` stores an Image feature as: a struct with a binary ``bytes`` field."""
    import pyarrow as pa

    if not pa.types.is_struct(kind) or kind.get_field_index("bytes") < 0:
        return False
    data = kind.field("bytes").type
    return pa.types.is_binary(data) or pa.types.is_large_binary(data)


def image_problem(spec: dict[str, Any], kinds: dict[str, str], folder: str) -> tuple[str, str] | None:
    """(key, what is wrong and the fix) of an hf_disk table, its columns' feature types ``kinds``
    (column -> ``Image``, ``Value``, ...): an image column must be the only feature column and needs
    image_size; the image keys need an image column (judged once every feature column is known: a missing
    one is prepare's error). None if fine."""
    names = spec.get("feature_columns")
    if not isinstance(names, list):
        return None
    images = [name for name in names if kinds.get(name) == "Image"]
    if images and len(names) > 1:
        return "feature_columns", (
            f"column {images[0]!r} of {folder} holds images (an Image feature), which are a dataset's only "
            f"input; set feature_columns: [{images[0]}] (one image column, nothing beside it)"
        )
    if images and "image_size" not in spec:
        return "image_size", (
            f"column {images[0]!r} of {folder} holds images (an Image feature), which are resized to "
            "image_size; add image_size: [height, width]"
        )
    stray = [key for key in IMAGE_KEYS if key in spec]
    if not images and stray and all(name in kinds for name in names):
        return stray[0], (
            f"spec key {stray[0]!r} is for an image column (an Image feature), and feature_columns of "
            f"{folder} name none; drop {stray[0]}"
        )
    return None


def hf_feature_types(spec: dict[str, Any]) -> dict[str, str] | None:
    """Column -> feature type (``Image``, ``Value``, ``ClassLabel``...) of an hf_disk spec's split folder,
    from its dataset_info.json; None when that file cannot tell now (prepare reads the Arrow schema)."""
    import json

    root = Path(spec["path"]) if isinstance(spec.get("path"), str) else None
    if root is None:
        return None
    split = spec.get("split")
    folder = root / split if (root / "dataset_dict.json").is_file() and isinstance(split, str) else root
    try:
        features = json.loads((folder / "dataset_info.json").read_text()).get("features")
    except (OSError, ValueError, AttributeError):
        return None
    if not isinstance(features, dict):
        return None
    return {
        name: str(feature.get("_type")) if isinstance(feature, dict) else ""
        for name, feature in features.items()
    }


def hf_disk_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """The config check of an hf_disk spec (its record names it): a chat's tokenizer, then an image
    column's keys as dataset_info.json tells them."""
    if problem := chat_problem(spec):
        return problem
    kinds = hf_feature_types(spec)
    return None if kinds is None else image_problem(spec, kinds, spec["path"])
