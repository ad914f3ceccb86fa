"""Every dataset source, one record each: the tasks it can do (the first is its default) and the spec
keys it requires and accepts. Torch-free and import-light: the config loader (the Snakefile) reads it
as the prepare stage does, so the two cannot disagree (tests/contracts hold the schema's source enum
to it). What a source does lives in its module (tables, images, synthetic).

Adding a source: its loader and its own key checks in a module of this package, one record here, its
loader and check in the prepare stage's tables, and its name in the schema's ``source`` enum.
"""

from __future__ import annotations

from dataclasses import dataclass

SPLIT_KEYS = frozenset({"test_fraction", "val_fraction", "seed"})
COMMON_KEYS = SPLIT_KEYS | {"task"}
USER_FILE_REQUIRED = frozenset({"path", "feature_columns"})
USER_FILE_KEYS = COMMON_KEYS | {"label_column", "label_columns", "classes"}
BOTH = ("classification", "regression")


@dataclass(frozen=True)
class Source:
    name: str
    tasks: tuple[str, ...]  # of TASKS; the first is the default
    required: frozenset[str]  # besides "source"
    optional: frozenset[str]

    @property
    def default_task(self) -> str:
        return self.tasks[0]


RECORDS: tuple[Source, ...] = (
    Source("digits", ("classification",), frozenset(), COMMON_KEYS | {"classes"}),
    Source("digits_images", ("classification",), frozenset(), COMMON_KEYS | {"classes"}),
    Source("diabetes", ("regression",), frozenset(), COMMON_KEYS),
    Source(
        "synthetic",
        BOTH,
        frozenset({"num_rows", "num_features"}),
        COMMON_KEYS | {"num_classes", "class_sep", "classes", "num_outputs", "noise"},
    ),
    Source("parquet", BOTH, USER_FILE_REQUIRED, USER_FILE_KEYS | {"feature_shape"}),
    Source("csv", BOTH, USER_FILE_REQUIRED, USER_FILE_KEYS),
    Source(
        "image_folder",
        ("classification",),
        frozenset({"path", "image_size"}),
        COMMON_KEYS | {"mode", "on_bad_image", "classes"},
    ),
    Source("npz", BOTH, frozenset({"path"}), COMMON_KEYS | {"features_key", "labels_key", "classes"}),
    Source(
        "text",
        ("causal_lm",),
        frozenset({"paths", "block_size"}),
        COMMON_KEYS | {"exclude", "max_tokens", "tokenizer", "vocab_size"},
    ),
)
SOURCES: dict[str, Source] = {record.name: record for record in RECORDS}
