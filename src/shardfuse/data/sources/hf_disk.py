"""The hf_disk source: a Hugging Face ``datasets`` folder written by ``save_to_disk`` (a ``Dataset``: its
Arrow stream files, ``state.json`` and ``dataset_info.json``; or a ``DatasetDict``: ``dataset_dict.json``
and one such folder per split, chosen by ``split``). Read with pyarrow alone, record batch by record
batch: the ``datasets`` package is not needed to read it (extra ``shardfuse[data]`` only to write one).

- causal_lm: the same field keys as the jsonl source (``text_field``, or ``prompt_field`` and
  ``completion_field`` with the completion-only loss, or ``messages_field``, a list of role/content
  structs rendered with the tokenizer's chat template), packed the same way: the same records as a
  JSON Lines file give the same blocks, byte for byte.
- classification / regression: ``feature_columns`` and ``label_column`` / ``label_columns`` as for a
  Parquet file; a ``ClassLabel`` label column keeps its class names (``datasets`` stores the codes, its
  dataset_info.json the names), which become the dataset's label names (in sorted order, as every
  source's labels are).

No command line; a library module: :class:`HfDisk` is the source's behaviour, named by its record in
:mod:`shardfuse.data.sources.registry`.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pyarrow as pa

from shardfuse.data.sources.base import Described, Loaded
from shardfuse.data.sources.checks import require_string
from shardfuse.data.sources.jsonl import (
    Record,
    check_fields,
    fields_of,
    pack_records,
    packed_rows,
    to_record,
)
from shardfuse.data.sources.tables import UserFile
from shardfuse.data.sources.text import Text
from shardfuse.io import UserError, error_reason
from shardfuse.models.task import TOKENS, Task

STATE = "state.json"
INFO = "dataset_info.json"
DICT = "dataset_dict.json"
FIX = "point 'path' at a folder written by datasets' save_to_disk"


def _read_json(path: Path) -> Any:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UserError(f"cannot read {path} ({error_reason(exc)}); {FIX}") from None


def split_folder(spec: dict[str, Any]) -> Path:
    """The folder of the spec's split: ``path`` itself (a Dataset), or its ``split`` (a DatasetDict)."""
    root, split = Path(spec["path"]), spec.get("split")
    if (root / DICT).is_file():
        splits = [str(name) for name in _read_json(root / DICT).get("splits", [])]
        if split is None or split not in splits:
            given = "no split" if split is None else f"split {split!r}"
            raise UserError(
                f"{root} is a DatasetDict of splits {', '.join(splits) or 'none'} and the spec names "
                f"{given}; set split: to one of them"
            )
        root = root / split
    if not (root / STATE).is_file():
        problem = "does not exist" if not root.exists() else f"has no {STATE}"
        raise UserError(f"{root} {problem}, so it is not a datasets folder; {FIX}")
    state = _read_json(root / STATE)
    if root == Path(spec["path"]) and split is not None and state.get("_split") not in (None, split):
        raise UserError(
            f"{root} holds split {state['_split']!r}, not {split!r}; drop split or point 'path' at the "
            f"folder of split {split!r}"
        )
    return root


def arrow_files(folder: Path) -> list[Path]:
    """The Arrow stream files of one split folder, in the order state.json lists them."""
    state = _read_json(folder / STATE)
    names = [entry.get("filename") for entry in state.get("_data_files", [])]
    if not names or not all(isinstance(name, str) for name in names):
        raise UserError(f"{folder / STATE} lists no data file; {FIX}")
    files = [folder / name for name in names]
    missing = [str(path) for path in files if not path.is_file()]
    if missing:
        raise UserError(f"{missing[0]} (listed in {folder / STATE}) does not exist; {FIX}")
    return files


def class_names(folder: Path) -> dict[str, list[str]]:
    """Column -> the class names of each ClassLabel column (dataset_info.json's features)."""
    if not (folder / INFO).is_file():
        return {}
    features = _read_json(folder / INFO).get("features") or {}
    return {
        name: [str(label) for label in feature["names"]]
        for name, feature in features.items()
        if isinstance(feature, dict) and feature.get("_type") == "ClassLabel" and feature.get("names")
    }


def batches(folder: Path, columns: list[str]) -> Iterator[pa.RecordBatch]:
    """The split's rows, record batch by record batch, with ``columns`` only (each must exist)."""
    for path in arrow_files(folder):
        try:
            with pa.OSFile(str(path)) as file:
                reader = pa.ipc.open_stream(file)
                missing = [name for name in columns if name not in reader.schema.names]
                if missing:
                    raise UserError(
                        f"column(s) {', '.join(map(repr, missing))} not found in {folder}; available "
                        f"columns: {', '.join(reader.schema.names)}"
                    )
                for batch in reader:
                    yield batch.select(columns)
        except (pa.ArrowException, OSError) as exc:
            raise UserError(f"cannot read {path} as an Arrow stream ({error_reason(exc)}); {FIX}") from None


def _records(folder: Path, spec: dict[str, Any]) -> Iterator[Record]:
    number = 0
    for batch in batches(folder, fields_of(spec).columns):
        for row in batch.to_pylist():
            number += 1
            yield to_record(row, f"{folder} row {number}", spec)


class HfDisk(UserFile):
    """A datasets folder: token blocks from a text field (or a prompt and a completion, or a chat), or a
    table."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_string(spec, "path")
        if spec.get("split") is not None:
            require_string(spec, "split")
        if task.labels == TOKENS:
            Text().check({**spec, "paths": [spec["path"]], "exclude": []}, task)
            check_fields(spec)
            return
        super().check(spec, task)

    def describe(self, spec: dict[str, Any], task: Task) -> Described | None:
        if task.labels == TOKENS:
            return Text().describe(spec, task)
        return None

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        if task.labels != TOKENS:
            return super().load(spec, task)
        return packed_rows(pack_records(spec, _records(split_folder(spec), spec)), spec)

    def read_table(self, spec: dict[str, Any], task: Task) -> pa.Table:
        folder = split_folder(spec)
        label = [spec["label_column"]] if "label_column" in spec else spec["label_columns"]
        wanted = list(dict.fromkeys([*spec["feature_columns"], *label, *spec.get("keep_columns", [])]))
        table = pa.Table.from_batches(list(batches(folder, wanted)))
        if table.num_rows == 0:
            raise UserError(f"{folder} has no rows; point the dataset's path at a folder with data")
        # A ClassLabel column holds codes; its names are the labels (a dictionary the label coder reads).
        for name, labels in class_names(folder).items():
            if name in label and pa.types.is_integer(table.column(name).type):
                codes = table.column(name).combine_chunks()
                named = pa.DictionaryArray.from_arrays(codes.cast(pa.int32()), pa.array(labels))
                table = table.set_column(table.schema.get_field_index(name), name, named)
        return table
