"""Every dataset source, one record each: the record is the source. It names the layouts of targets the
source gives (:mod:`shardfuse.data.labels`; the first is its default, and the tasks it serves are the
tasks of those layouts), the spec keys it requires and takes (some only for one layout), their defaults,
the files it reads (:mod:`shardfuse.data.sources.files`: the prepare rule's inputs) and its behaviour: a
class in a source module that checks its own keys, describes the data from the spec alone and prepares
the rows (:class:`shardfuse.data.sources.base.SourceBehaviour`), imported only when used.

Torch-free and import-light: the config loader (the Snakefile) reads these records as the prepare stage
does, so the two cannot disagree (tests/contracts hold the schema's source enum to them). Records are
looked up at call time (:func:`find_source`), so a test that extends ``RECORDS`` reaches every stage.

Adding a source: one class in a source module (or a module of its own), one record here, its name in
the schema's ``source`` enum and its keys in config/README.md. A source whose rows can carry group
columns (data beside the inputs, for ``partition: column``) puts them in its rows' ``carried`` table and
names in its record the spec's lister of them (``carried``) and how a spec asks for one (``carry_fix``).
A source whose files can be judged cheaply before any job names its check (``config_check``: csv and
parquet probe their feature columns' types, :mod:`shardfuse.data.sources.columns`).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardfuse.data.labels import find_layout
from shardfuse.data.sources.carried import (
    KEEP_COLUMNS,
    WRITER_COLUMN,
    WRITERS,
    digit_writers,
    domain_parts,
    kept_columns,
    no_columns,
)
from shardfuse.data.sources.columns import (
    CATEGORICAL_COLUMNS,
    IMAGE_KEYS,
    csv_problem,
    hf_disk_problem,
    parquet_problem,
)
from shardfuse.data.sources.files import (
    domain_part_files,
    hf_disk_files,
    image_folder_files,
    no_files,
    path_file,
    text_files_of,
)
from shardfuse.data.sources.hf_tokenizer import chat_problem
from shardfuse.data.sources.mix import MIX_WEIGHTS, mix_weights_problem
from shardfuse.io import find_record
from shardfuse.models.task import CLASSES, TOKENS, VALUES
from shardfuse.models.tasks import task_record, tasks_with_labels

if TYPE_CHECKING:
    from shardfuse.data.sources.base import SourceBehaviour

# Every source's split keys and their defaults (the schema's defaults: tests/contracts hold them equal).
SPLIT_DEFAULTS: Mapping[str, Any] = MappingProxyType({"test_fraction": 0.2, "val_fraction": 0.1, "seed": 0})
COMMON_KEYS = frozenset(SPLIT_DEFAULTS) | {"task"}
BOTH = (CLASSES, VALUES)
NO_KEYS: frozenset[str] = frozenset()


@dataclass(frozen=True)
class LabelKeys:
    """The spec keys a source takes only for one layout of targets (e.g. synthetic's num_classes)."""

    required: frozenset[str] = NO_KEYS
    optional: frozenset[str] = NO_KEYS

    @property
    def keys(self) -> frozenset[str]:
        return self.required | self.optional


@dataclass(frozen=True)
class Source:
    name: str
    labels: tuple[str, ...]  # layouts of targets it gives (shardfuse.data.labels); the first is the default
    behaviour: str  # "module:Class", a SourceBehaviour, imported when a spec is checked or prepared
    required: frozenset[str] = NO_KEYS  # besides "source"
    optional: frozenset[str] = NO_KEYS  # besides the split keys and "task"
    label_keys: Mapping[str, LabelKeys] = field(default_factory=lambda: MappingProxyType({}))
    defaults: Mapping[str, Any] = field(default_factory=lambda: MappingProxyType({}))  # of optional keys
    files: Callable[[dict], list[str]] = no_files  # the files a spec reads (standard library only)
    # The columns a spec carries into the splits as data, never inputs ({column: groups or None}:
    # shardfuse.data.sources.carried), and how a spec asks for one (the config's fix when a partition
    # groups by a column the splits lack).
    carried: Callable[[dict], dict[str, int | None]] = no_columns
    carry_fix: str | None = None
    # The other datasets of the config a spec is made of (domains: its parts; the config checks them
    # and gives the spec their task); none for a source of its own data.
    parts: Callable[[dict], list[str]] = lambda spec: []
    # What the config check refuses before any job beyond the schema and the keys of the task: (key,
    # what is wrong and the fix) or None; it may read a file's header (csv, parquet), never its data.
    config_check: Callable[[dict], tuple[str, str] | None] = lambda spec: None

    def tasks(self) -> tuple[str, ...]:
        """The tasks it serves (those of its layouts), the default first."""
        return tasks_with_labels(self.labels)

    def default_task(self) -> str:
        return self.tasks()[0]

    def keys_of(self, layout: str) -> LabelKeys:
        return self.label_keys.get(layout, LabelKeys())

    def allowed(self) -> frozenset[str]:
        """Every key a spec of this source may hold, for any of its tasks."""
        by_layout = (self.keys_of(layout).keys | find_layout(layout).spec_keys for layout in self.labels)
        return (
            frozenset({"source"})
            | COMMON_KEYS
            | self.required
            | self.optional
            | frozenset().union(*by_layout)
        )

    def foreign(self, task: str) -> dict[str, frozenset[str]]:
        """Layout -> the keys only that other layout of this source takes (keys that do not suit ``task``)."""
        own = task_record(task).labels
        mine = self.keys_of(own).keys | find_layout(own).spec_keys
        return {
            layout: (self.keys_of(layout).keys | find_layout(layout).spec_keys) - mine
            for layout in self.labels
            if layout != own
        }

    def accepted(self, task: str) -> frozenset[str]:
        """The keys a spec of this source may hold for ``task``."""
        return self.allowed() - frozenset().union(*self.foreign(task).values())

    def required_for(self, task: str) -> frozenset[str]:
        return self.required | self.keys_of(task_record(task).labels).required

    def behaviour_of(self) -> SourceBehaviour:
        module, _, name = self.behaviour.partition(":")
        return getattr(importlib.import_module(module), name)()


def _keys(*names: str) -> frozenset[str]:
    return frozenset(names)


USER_FILE_LABELS = MappingProxyType(
    {CLASSES: LabelKeys(required=_keys("label_column")), VALUES: LabelKeys(required=_keys("label_columns"))}
)
MODULE = "shardfuse.data.sources"

DIGIT_WRITERS = {
    "optional": _keys(WRITERS),
    "carried": digit_writers,
    "carry_fix": f"set the dataset's {WRITERS}: N and group by column {WRITER_COLUMN}",
}
USER_FILE_KEEPS = {"carried": kept_columns, "carry_fix": f"add it to the dataset's {KEEP_COLUMNS}"}

# The keys of records read into token blocks (the jsonl and hf_disk sources; shardfuse.data.sources.jsonl;
# a chat's tokenizer and template are checked before any job: chat_problem).
TOKEN_KEYS = _keys(
    "max_tokens",
    "tokenizer",
    "vocab_size",
    "text_field",
    "prompt_field",
    "completion_field",
    "messages_field",
)
TOKEN_DEFAULTS = {
    "max_tokens": None,
    "tokenizer": None,
    "text_field": None,
    "prompt_field": None,
    "completion_field": None,
    "messages_field": None,
}

# An hf_disk table's optional keys: an Image feature column takes image_folder's keys (and, at prepare,
# its defaults: shardfuse.data.sources.hf_disk).
HF_TABLE_KEYS = _keys(KEEP_COLUMNS, *IMAGE_KEYS)

RECORDS: tuple[Source, ...] = (
    Source("digits", (CLASSES,), f"{MODULE}.tables:Digits", **DIGIT_WRITERS),
    Source("digits_images", (CLASSES,), f"{MODULE}.images:DigitsImages", **DIGIT_WRITERS),
    Source("diabetes", (VALUES,), f"{MODULE}.tables:Diabetes"),
    Source(
        "synthetic",
        BOTH,
        f"{MODULE}.synthetic:Synthetic",
        required=_keys("num_rows", "num_features"),
        label_keys=MappingProxyType(
            {
                CLASSES: LabelKeys(_keys("num_classes"), _keys("class_sep")),
                VALUES: LabelKeys(_keys("num_outputs"), _keys("noise")),
            }
        ),
        defaults=MappingProxyType({"class_sep": 1.0, "noise": 0.1}),
    ),
    Source(
        "parquet",
        BOTH,
        f"{MODULE}.images:Parquet",
        required=_keys("path", "feature_columns"),
        optional=_keys("feature_shape", KEEP_COLUMNS, CATEGORICAL_COLUMNS),
        label_keys=USER_FILE_LABELS,
        config_check=parquet_problem,
        files=path_file,
        **USER_FILE_KEEPS,
    ),
    Source(
        "csv",
        BOTH,
        f"{MODULE}.tables:Csv",
        required=_keys("path", "feature_columns"),
        optional=_keys(KEEP_COLUMNS, CATEGORICAL_COLUMNS),
        label_keys=USER_FILE_LABELS,
        config_check=csv_problem,
        files=path_file,
        **USER_FILE_KEEPS,
    ),
    Source(
        "image_folder",
        (CLASSES,),
        f"{MODULE}.images:ImageFolder",
        required=_keys("path", "image_size"),
        optional=_keys("mode", "on_bad_image"),
        defaults=MappingProxyType({"mode": "L", "on_bad_image": "error"}),
        files=image_folder_files,
    ),
    Source(
        "npz",
        BOTH,
        f"{MODULE}.images:Npz",
        required=_keys("path"),
        optional=_keys("features_key", "labels_key"),
        defaults=MappingProxyType({"features_key": "x", "labels_key": "y"}),
        files=path_file,
    ),
    Source(
        "text",
        (TOKENS,),
        f"{MODULE}.text:Text",
        required=_keys("paths", "block_size"),
        optional=_keys("exclude", "max_tokens", "tokenizer", "vocab_size"),
        defaults=MappingProxyType({"exclude": (), "max_tokens": None, "tokenizer": None}),
        files=text_files_of,
    ),
    Source(
        "jsonl",
        (TOKENS, CLASSES),
        f"{MODULE}.jsonl:Jsonl",
        required=_keys("paths", "block_size"),
        optional=_keys("exclude", "tokenizer", "vocab_size", "text_field"),
        label_keys=MappingProxyType(
            {
                TOKENS: LabelKeys(frozenset(), TOKEN_KEYS - {"tokenizer", "vocab_size", "text_field"}),
                CLASSES: LabelKeys(_keys("label_field")),
            }
        ),
        defaults=MappingProxyType({"exclude": (), **TOKEN_DEFAULTS}),
        files=text_files_of,
        config_check=chat_problem,
    ),
    Source(
        "hf_disk",
        (CLASSES, VALUES, TOKENS),
        f"{MODULE}.hf_disk:HfDisk",
        required=_keys("path"),
        optional=_keys("split"),
        label_keys=MappingProxyType(
            {
                CLASSES: LabelKeys(_keys("feature_columns", "label_column"), HF_TABLE_KEYS),
                VALUES: LabelKeys(_keys("feature_columns", "label_columns"), HF_TABLE_KEYS),
                TOKENS: LabelKeys(_keys("block_size"), TOKEN_KEYS),
            }
        ),
        defaults=MappingProxyType({"split": None, **TOKEN_DEFAULTS}),
        files=hf_disk_files,
        config_check=hf_disk_problem,
        **USER_FILE_KEEPS,
    ),
    Source(
        "domains",
        (CLASSES, VALUES, TOKENS),
        f"{MODULE}.domains:Domains",
        required=_keys("parts"),
        optional=_keys(MIX_WEIGHTS),
        config_check=mix_weights_problem,
        files=domain_part_files,
        carried=domain_parts,
        parts=lambda spec: list(spec.get("parts") or []),
        carry_fix="use partition: domain (a domains dataset's rows carry their part in column domain)",
    ),
)


def find_source(name: str) -> Source:
    """The record of source ``name`` (read from ``RECORDS`` now), or a one-line UserError naming them."""
    return find_record(RECORDS, name, "dataset source")


def source_names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS)
