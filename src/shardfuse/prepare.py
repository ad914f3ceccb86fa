"""Prepare one dataset: a seeded train/validation/test split written as Parquet, for any of three tasks.

Run by hand:

    python -m shardfuse.prepare --name digits \
        --spec-json '{"source": "digits", "test_fraction": 0.2, "seed": 0}' --out-dir results/datasets/digits

Writes OUT_DIR/train.parquet, OUT_DIR/val.parquet, OUT_DIR/test.parquet and OUT_DIR/dataset.json (each
atomically; dataset.json last, so its presence means the split is complete). The same spec gives
byte-identical files. The inputs take one of three layouts, which dataset.json's ``input`` records
(kind, shape, dtype):

  numeric  x0..x{F-1} (float32); shape [F]
  tensor   one column ``x`` of fixed_size_list<float32>[prod(shape)], its field's metadata
           {"shardfuse.shape": "[C, H, W]"} (any shape); digits_images, image_folder, npz, and a
           Parquet list column
  tokens   one column ``tokens`` of fixed_size_list<uint16>[block_size + 1] (int32 when vocab_size >
           65535): block_size inputs and, shifted by one, block_size next-token targets; text

and the targets follow by ``task``: classification ``label`` (int64 in [0, C)); regression y0..y{K-1}
(float32; dataset.json adds ``target_names``); causal_lm none (dataset.json adds ``vocab_size``,
``block_size``, ``num_tokens`` and ``tokenizer``). num_features is prod(shape); feature_names is []
for a tensor; the tasks other than classification have num_classes 0 and label_names [].

The test split (``test_fraction`` of the rows, default 0.2) is drawn first and does not depend on
``val_fraction``; the validation split (``val_fraction`` of all rows, default 0.1, drawn the same way)
is carved from the remaining rows, and train.parquet holds the rest. Classification splits are
stratified by class; regression rows and text blocks are split at random (seeded). Choices such as
greedy soup's are made on val.parquet, never on the test split. val_fraction 0 writes an empty
val.parquet with the same schema. Rows are written in a seeded random order (user files are often sorted
by label; the synthetic generator draws rows at random already), since partition keeps the input's
order within a shard and the shard reader's first epoch follows the file row group by row group.

Sources (config/README.md's dataset-keys table has every key): digits, digits_images (the same rows and
split as 1x8x8 images) and image_folder (path/<class>/*.png|*.jpg|*.jpeg) give classification;
diabetes regression; synthetic (streamed chunk by chunk), parquet, csv and npz either (classification
unless ``task`` says); text (the files' bytes or a user tokenizer's ids; ``{stdlib}`` in paths is the
Python standard library) causal_lm.
Any classification source also takes ``classes``: keep only the rows whose label is one of these (e.g.
[0, 1, 2] for digits). The label space stays the whole data's: num_classes, label_names and the label
codes are unchanged, so a model trained on a subset has the full output layer.

The sources are library modules (:mod:`shardfuse.data.sources.tables`,
:mod:`shardfuse.data.sources.synthetic`, :mod:`shardfuse.data.sources.images`), each checking its own keys;
this stage validates the spec, splits the
rows and writes the files.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.data.shard_format import SHAPE_KEY, TENSOR_COLUMN, TOKENS_COLUMN, InputKind
from shardfuse.data.sources.images import LOADED_HERE, TENSOR_SOURCES, check_tensor_spec, load_tensor_source
from shardfuse.data.sources.registry import SOURCES
from shardfuse.data.sources.synthetic import Chunk, check_synthetic_spec, synthetic_data
from shardfuse.data.sources.tables import (
    SPEC_FIX,
    check_text_spec,
    check_user_file_spec,
    is_int,
    kept_class_codes,
    load_in_memory,
    read_text_blocks,
    require_int,
    require_number,
)
from shardfuse.data.splits import random_split_masks, split_masks
from shardfuse.io import (
    MAX_SEED,
    StageParser,
    UserError,
    atomic_path,
    parse_json_arg,
    run_cli,
    sha256_file,
    write_json,
    write_stamps,
)
from shardfuse.models.tasks import TASKS

DEFAULTS = {
    "test_fraction": 0.2,
    "val_fraction": 0.1,
    "seed": 0,
    "class_sep": 1.0,
    "noise": 0.1,
    "exclude": (),
    "max_tokens": None,
    "tokenizer": None,
    "mode": "L",
    "on_bad_image": "error",
    "features_key": "x",
    "labels_key": "y",
}
SPLITS = ("train", "val", "test")
# source -> (required keys, optional keys) for any of its tasks ("source" itself is always required),
# and the tasks each source can do, the first its default: from the sources' records.
SOURCE_KEYS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    name: (record.required, record.optional) for name, record in SOURCES.items()
}
SOURCE_TASKS = {name: record.tasks for name, record in SOURCES.items()}
# Each source's checks of its own keys (given the validated spec, task filled in).
SOURCE_CHECKS = {
    "synthetic": check_synthetic_spec,
    "parquet": check_user_file_spec,
    "csv": check_user_file_spec,
    "text": check_text_spec,
    **dict.fromkeys(TENSOR_SOURCES, check_tensor_spec),
}
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


# ---------------------------------------------------------------- spec validation


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


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

    require_number(spec, "test_fraction", 0, 1, open_interval=True)
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
    require_int(spec, "seed", 0, MAX_SEED)
    if source in SOURCE_CHECKS:
        SOURCE_CHECKS[source](spec)
    if "classes" in spec:
        classes = spec["classes"]
        if (
            not isinstance(classes, list)
            or len(classes) < 2
            or not all(isinstance(c, str) or is_int(c) for c in classes)
            or len({str(c) for c in classes}) != len(classes)
        ):
            raise UserError(
                f"spec key 'classes' must be a list of 2 or more distinct label values (strings or "
                f"integers; a classifier needs at least 2 classes), got {classes!r}; {SPEC_FIX}"
            )
    return spec


# ---------------------------------------------------------------- splitting and writing


class Written(NamedTuple):
    """What a source wrote, for dataset.json."""

    rows: dict[str, int]  # per split
    feature_names: list[str]
    label_names: list[str]  # the class names (classification); [] for the other tasks
    task_keys: dict[str, Any]  # the task's and source's own dataset.json keys (target_names; vocab_size, ...)
    input: dict[str, Any]  # dataset.json's "input": kind, shape (per row), dtype


def _input_of(features: np.ndarray, kind: InputKind) -> dict[str, Any]:
    """dataset.json's ``input`` for rows like ``features`` (numeric columns are always float32)."""
    dtype = "float32" if kind != "tokens" else np.dtype(features.dtype).name
    return {"kind": kind, "shape": [int(size) for size in features.shape[1:]], "dtype": dtype}


def _feature_fields(features: np.ndarray, kind: InputKind) -> tuple[list[pa.Field], list[pa.Array]]:
    """The input columns: one float32 column per feature (numeric), or one fixed-size list column built
    from the rows' flat values (tensor ``x``, tokens ``tokens``)."""
    if kind == "numeric":
        columns = np.ascontiguousarray(features.T, dtype=np.float32)  # column-major, as Arrow stores it
        return [pa.field(f"x{j}", pa.float32()) for j in range(len(columns))], [pa.array(c) for c in columns]
    row_size = math.prod(features.shape[1:])
    dtype = np.float32 if kind == "tensor" else features.dtype
    flat = np.ascontiguousarray(features, dtype=dtype).reshape(-1)
    array = pa.FixedSizeListArray.from_arrays(pa.array(flat), row_size)
    if kind == "tokens":
        return [pa.field(TOKENS_COLUMN, array.type)], [array]
    metadata = {SHAPE_KEY: json.dumps([int(size) for size in features.shape[1:]]).encode()}
    return [pa.field(TENSOR_COLUMN, array.type, metadata=metadata)], [array]


def _table(
    features: np.ndarray,
    targets: np.ndarray | None,
    task: str = "classification",
    kind: InputKind = "numeric",
) -> pa.Table:
    """``targets``: int class codes (classification), a float (rows, K) array (regression) or None
    (causal_lm, whose features are the tokens)."""
    fields, arrays = _feature_fields(features, kind)
    if task == "classification":
        fields.append(pa.field("label", pa.int64()))
        arrays.append(pa.array(targets.astype(np.int64, copy=False)))
    elif task == "regression":
        fields += [pa.field(f"y{k}", pa.float32()) for k in range(targets.shape[1])]
        arrays += [pa.array(column) for column in np.ascontiguousarray(targets.T, dtype=np.float32)]
    return pa.Table.from_arrays(arrays, schema=pa.schema(fields))


def _write_split(
    out_dir: Path,
    features: np.ndarray,
    targets: np.ndarray | None,
    masks: dict[str, np.ndarray],
    row_group_rows: int,
    spec: dict,
    kind: InputKind = "numeric",
) -> dict[str, int]:
    """Each split's rows in a seeded random order: files are often sorted (by label, by time), and
    partition keeps the input's order within a shard, which the shard reader's first epoch follows
    row group by row group. Built and written one row group at a time (the same bytes as one
    write_table), so the float32 copy never exceeds a row group. Returns the rows per split."""

    def table_of(rows: np.ndarray) -> pa.Table:
        return _table(features[rows], None if targets is None else targets[rows], spec["task"], kind)

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


def _write_chunks(
    out_dir: Path,
    schema: pa.Schema,
    chunks: Iterator[Chunk],
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


# ---------------------------------------------------------------- sources to split files


def _prepare_in_memory(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    loaded = (load_tensor_source if spec["source"] in LOADED_HERE else load_in_memory)(spec)
    features, targets, kind = loaded.features, loaded.targets, loaded.kind
    source_keys = loaded.dataset_keys or {}
    if spec["task"] == "regression":
        masks = random_split_masks(len(features), spec)
        rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec, kind)
        task_keys = {"target_names": loaded.target_names, **source_keys}
        return Written(rows, loaded.feature_names, [], task_keys, _input_of(features, kind))
    label_names = loaded.target_names
    if "classes" in spec:
        keep = np.isin(targets, kept_class_codes(spec["classes"], label_names))
        features, targets = features[keep], targets[keep]
    counts = np.bincount(targets, minlength=len(label_names))
    rare = [f"{label_names[c]!r}" for c in np.flatnonzero(counts == 1)]
    if rare:
        raise UserError(
            f"label value(s) {', '.join(rare[:10])} in {spec.get('path', spec['source'])} have a single "
            "row; a stratified split needs at least 2 rows per class: add rows or drop those"
        )
    masks = split_masks(targets, len(label_names), spec)
    rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec, kind)
    return Written(rows, loaded.feature_names, label_names, source_keys, _input_of(features, kind))


def _prepare_synthetic(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    data = synthetic_data(spec)
    num_features, num_targets = len(data.feature_names), len(data.target_names)
    no_rows = np.zeros((0, num_features), dtype=np.float32)
    no_targets = np.zeros((0, num_targets) if spec["task"] == "regression" else 0)
    schema = _table(no_rows, no_targets, spec["task"]).schema
    rows = _write_chunks(out_dir, schema, data.chunks, row_group_rows, spec)
    task_keys = {"target_names": data.target_names} if spec["task"] == "regression" else {}
    return Written(rows, data.feature_names, data.label_names, task_keys, _input_of(no_rows, "numeric"))


def _prepare_text(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    text = read_text_blocks(spec)
    blocks = text.blocks
    masks = random_split_masks(len(blocks), spec)
    rows = _write_split(out_dir, blocks, None, masks, row_group_rows, spec, "tokens")
    feature_names = [f"t{j}" for j in range(blocks.shape[1])]
    extra = {
        "vocab_size": text.vocab_size,
        "block_size": spec["block_size"],
        "num_tokens": text.num_tokens,
        "tokenizer": spec["tokenizer"],
    }
    if text.bytes_per_token is not None:  # bits per byte = bits per token / bytes per token
        extra["bytes_per_token"] = text.bytes_per_token
    return Written(rows, feature_names, [], extra, _input_of(blocks, "tokens"))


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
        "input": written.input,
        "num_features": math.prod(written.input["shape"]),
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
    shape = info["input"]["shape"]
    features = f"{info['num_features']} features" if info["input"]["kind"] == "numeric" else f"shape {shape}"
    if info["task"] == "classification":
        return f"{features}, {info['num_classes']} classes"
    if info["task"] == "regression":
        return f"{features}, {len(info['target_names'])} target(s)"
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
