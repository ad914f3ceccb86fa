"""Categorical feature columns of a user's table (the spec's ``categorical_columns``), one-hot encoded once
the split is drawn: each column's vocabulary is the sorted distinct values of its TRAIN rows only, and
its one-hot block (``column=value`` per category, in vocabulary order) takes the column's place among the
feature columns. A value the train split lacks (seen only in val or test) is an unseen category: its row
gets all zeros in that block, as scikit-learn's ``OneHotEncoder(handle_unknown="ignore")`` gives, and is
counted per split. dataset.json records ``categories`` ({column: vocabulary, values as text}) and
``unseen_categories`` ({split: {column: rows}}); the logged MLflow model takes the original columns and
encodes them with the same vocabulary (:mod:`shardfuse.track.model`).

Strings, integers or booleans (a dictionary column decoded to its values); a missing value is refused
(fill it with a category of its own, e.g. "unknown", or drop the row). Integers sort as numbers, and
each category is named by its text (``str``): ``3``, ``True``. A library module, no command line. By hand::

    python -c "import numpy as np, pyarrow as pa; from shardfuse.data.sources.categorical import one_hot
    print(one_hot(pa.chunked_array([['b', 'a', 'c']]), np.array([True, True, False])))"
"""

from __future__ import annotations

from collections import Counter
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardfuse.data.sources.columns import is_categorical_type, one_hot_matrix, one_hot_names
from shardfuse.io import UserError


class OneHot(NamedTuple):
    """A column's one-hot block: rows x categories (float32), the vocabulary (text), and which rows hold
    a value the vocabulary lacks."""

    matrix: np.ndarray
    vocabulary: list[str]
    unseen: np.ndarray


def categorical_column(table: pa.Table, name: str, path: str) -> pa.ChunkedArray:
    """Column ``name`` of the user's table, checked to hold strings, integers or booleans, none missing."""
    column = table.column(name)
    if not is_categorical_type(column.type):
        raise UserError(
            f"categorical column {name!r} in {path} has type {column.type}; a categorical column holds "
            "strings, integers or booleans: drop it from categorical_columns"
        )
    if pa.types.is_dictionary(column.type):
        column = column.cast(column.type.value_type)
    if column.null_count:
        raise UserError(
            f"categorical column {name!r} in {path} has {column.null_count} missing value(s); fill them "
            "with a category of their own (e.g. 'unknown') or drop those rows"
        )
    return column


def one_hot(column: pa.ChunkedArray, is_train: np.ndarray) -> OneHot:
    """One-hot ``column`` with the sorted distinct values of its rows where ``is_train``."""
    distinct = pc.unique(column.filter(pa.array(is_train)))
    distinct = distinct.take(pc.array_sort_indices(distinct))
    codes = pc.fill_null(pc.index_in(column, value_set=distinct), -1).to_numpy()
    vocabulary = [str(value) for value in distinct.to_pylist()]
    return OneHot(one_hot_matrix(codes, len(distinct)), vocabulary, codes < 0)


class Categorical(NamedTuple):
    """The raw categorical columns of a user's rows and the order of every feature column, carried in
    :class:`shardfuse.data.sources.write.Loaded` until the split is known."""

    columns: pa.Table  # the categorical columns, one row per row
    feature_columns: list[str]  # every feature column, in the spec's order
    path: str

    def filter(self, keep: np.ndarray) -> Categorical:
        return self._replace(columns=self.columns.filter(pa.array(keep)))

    def encoded(
        self, features: np.ndarray, feature_names: list[str], masks: dict[str, np.ndarray]
    ) -> tuple[np.ndarray, list[str], dict[str, Any]]:
        """The numeric ``features`` with each categorical column's one-hot block in its place (the
        vocabularies from the rows of ``masks["train"]``): (features, their names, dataset.json's
        ``categories`` and ``unseen_categories``)."""
        numeric = dict(zip(feature_names, features.T, strict=True))
        blocks, names, categories = [], [], {}
        unseen: dict[str, dict[str, int]] = {split: {} for split in masks}
        for name in self.feature_columns:
            if name in numeric:
                blocks.append(numeric[name][:, None])
                names.append(name)
                continue
            encoded = one_hot(self.columns.column(name), masks["train"])
            blocks.append(encoded.matrix)
            names += one_hot_names(name, encoded.vocabulary)
            categories[name] = encoded.vocabulary
            for split, mask in masks.items():
                unseen[split][name] = int(np.count_nonzero(encoded.unseen & mask))
        self._check_names(names)
        encoded_features = np.ascontiguousarray(np.concatenate(blocks, axis=1), dtype=np.float32)
        return encoded_features, names, {"categories": categories, "unseen_categories": unseen}

    def _check_names(self, names: list[str]) -> None:
        """A one-hot name must not be another feature column's (the logged model finds columns by name)."""
        twice = [name for name, count in Counter(names).items() if count > 1]
        if twice:
            raise UserError(
                f"feature name {twice[0]!r} of a categorical column's one-hot block is also a feature "
                f"column of {self.path}; rename that column in the file"
            )
