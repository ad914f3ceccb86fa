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
- classification / regression on images: a single feature column that is an ``Image`` feature
  (dataset_info.json's features, else the Arrow column ``{bytes, path}``) is decoded as image_folder
  decodes its files (:func:`shardfuse.data.sources.images.decode_images`: the same ``image_size``,
  ``mode`` and ``on_bad_image``, ``skipped_images`` in dataset.json) into a tensor input C x H x W. A
  first pass reads the label (and kept) columns and so counts the rows; a second decodes the images
  batch by batch into the preallocated tensor, so the table of encoded images is never held whole. An
  image stored by path only (no bytes in the folder) is refused, naming its row.

No command line; a library module: :class:`HfDisk` is the source's behaviour, named by its record in
:mod:`shardfuse.data.sources.registry`. By hand::

    python -c "from shardfuse.data.sources.hf_disk import HfDisk; from shardfuse.models.tasks import task_for
    spec = {'source': 'hf_disk', 'path': 'mnist_hf', 'feature_columns': ['image'], 'label_column': 'label',
            'image_size': [28, 28]}
    loaded = HfDisk().load(spec, task_for('classification'))
    print(loaded.features.shape, loaded.target_names)"   # (N, 1, 28, 28) ['0', ..., '9']
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from shardfuse.data.sources.base import Described, Loaded
from shardfuse.data.sources.carried import KEEP_COLUMNS
from shardfuse.data.sources.checks import require_string
from shardfuse.data.sources.columns import hf_feature_types, image_problem, is_image_type
from shardfuse.data.sources.images import IMAGE_MODES, check_image_keys, decode_images
from shardfuse.data.sources.jsonl import (
    Record,
    check_fields,
    fields_of,
    pack_records,
    packed_rows,
    to_record,
)
from shardfuse.data.sources.registry import find_source
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
            # Memory-mapped: a batch's columns are views of the file, so a column not read is not loaded.
            with pa.memory_map(str(path)) as file:
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


def feature_types(folder: Path) -> dict[str, str]:
    """Column -> feature type: dataset_info.json's features, or (a folder without that file) the Arrow
    schema's columns, ``Image`` where the type is the one datasets stores an Image as."""
    kinds = hf_feature_types({"path": str(folder)})
    if kinds is not None:
        return kinds
    try:
        with pa.memory_map(str(arrow_files(folder)[0])) as file:
            schema = pa.ipc.open_stream(file).schema
    except (pa.ArrowException, OSError):
        return {}  # the reading pass says why
    return {field.name: "Image" if is_image_type(field.type) else str(field.type) for field in schema}


def image_bytes(column: pa.Array, name: str, first_row: int, folder: Path) -> list[bytes]:
    """The encoded images of one batch's Image column ``name``; one stored by path only (older datasets,
    or written by hand) is refused, naming its row: its file is not part of the folder."""
    if not is_image_type(column.type):
        raise UserError(
            f"column {name!r} of {folder} is an Image feature stored as {column.type}, not as "
            "{bytes, path}; save the dataset again with datasets' save_to_disk"
        )
    data = pc.struct_field(column, "bytes")  # null where the row or its bytes are
    if data.null_count:
        index = pc.index(pc.is_null(data), True).as_py()
        path = column[index]["path"].as_py() if column[index].is_valid else None
        raise UserError(
            f"{folder} row {first_row + index + 1} holds no image bytes in column {name!r} (path "
            f"{path!r}) and only images stored in the folder are read; save it again with datasets' "
            "save_to_disk (which embeds local image files) or drop the row"
        )
    return data.to_pylist()


class HfDisk(UserFile):
    """A datasets folder: token blocks from a text field (or a prompt and a completion, or a chat), or a
    table (its feature columns, or one Image column decoded to a tensor)."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_string(spec, "path")
        if spec.get("split") is not None:
            require_string(spec, "split")
        if task.labels == TOKENS:
            Text().check({**spec, "paths": [spec["path"]], "exclude": []}, task)
            check_fields(spec)
            return
        super().check(spec, task)
        check_image_keys(spec)

    def describe(self, spec: dict[str, Any], task: Task) -> Described | None:
        if task.labels == TOKENS:
            return Text().describe(spec, task)
        return None

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        if task.labels == TOKENS:
            return packed_rows(pack_records(spec, _records(split_folder(spec), spec)), spec)
        folder = split_folder(spec)
        kinds = feature_types(folder)
        if problem := image_problem(spec, kinds, str(folder)):
            raise UserError(problem[1])
        if kinds.get(spec["feature_columns"][0]) != "Image":
            return super().load(spec, task)
        return self._image_rows({**find_source("image_folder").defaults, **spec}, task, folder)

    def read_table(self, spec: dict[str, Any], task: Task) -> pa.Table:
        return _labelled_table(split_folder(spec), spec, spec["feature_columns"])

    def _image_rows(self, spec: dict[str, Any], task: Task, folder: Path) -> Loaded:
        """The rows of an Image feature column: the labels (and kept columns) first, which count the
        rows, then the images decoded batch by batch into the preallocated tensor."""
        name = spec["feature_columns"][0]
        table = _labelled_table(folder, spec, [])
        height, width = spec["image_size"]
        images = np.empty((table.num_rows, IMAGE_MODES[spec["mode"]], height, width), dtype=np.float32)
        readable = np.ones(table.num_rows, dtype=bool)
        start = 0
        for batch in batches(folder, [name]):
            data = image_bytes(batch.column(0), name, start, folder)
            end = start + len(data)
            where = partial(_row_of, f"{folder} row {{}} (column {name!r})", start)
            readable[start:end] = decode_images(data, spec, images[start:end], where)
            start = end
        if not readable.any():
            raise UserError(f"no image of column {name!r} in {folder} could be read; check the images")
        num_skipped = int(np.count_nonzero(~readable))
        if num_skipped:  # (a copy, so only when needed)
            images, table = images[readable], table.filter(pa.array(readable))
        loaded = self.rows(spec, task, table, images)
        return loaded._replace(dataset_keys={"skipped_images": num_skipped})


def _row_of(template: str, first_row: int, index: int) -> str:
    """Where the ``index``-th image of a batch starting at ``first_row`` lies (rows count from 1)."""
    return template.format(first_row + index + 1)


def _labelled_table(folder: Path, spec: dict[str, Any], features: list[str]) -> pa.Table:
    """The split's ``features``, target and kept columns; a ClassLabel target as a dictionary of its
    class names (which the label coder reads)."""
    label = [spec["label_column"]] if "label_column" in spec else spec["label_columns"]
    wanted = list(dict.fromkeys([*features, *label, *spec.get(KEEP_COLUMNS, [])]))
    table = pa.Table.from_batches(list(batches(folder, wanted)))
    if table.num_rows == 0:
        raise UserError(f"{folder} has no rows; point the dataset's path at a folder with data")
    for name, labels in class_names(folder).items():
        if name in label and pa.types.is_integer(table.column(name).type):
            codes = table.column(name).combine_chunks()
            named = pa.DictionaryArray.from_arrays(codes.cast(pa.int32()), pa.array(labels))
            table = table.set_column(table.schema.get_field_index(name), name, named)
    return table
