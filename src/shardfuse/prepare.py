"""Prepare one dataset: a seeded train/validation/test split written as Parquet, for any of three tasks.

Run by hand:

    python -m shardfuse.prepare --name digits \
        --spec-json '{"source": "digits", "test_fraction": 0.2, "seed": 0}' --out-dir results/datasets/digits

Writes OUT_DIR/train.parquet, OUT_DIR/val.parquet, OUT_DIR/test.parquet and OUT_DIR/dataset.json (each
atomically; dataset.json last, so its presence means the split is complete). The same spec gives
byte-identical files. The Parquet columns depend on the spec's ``task``:

  classification  x0..x{F-1} (float32) then ``label`` (int64 in [0, C))
  regression      x0..x{F-1} (float32) then y0..y{K-1} (float32: the K targets)
  causal_lm       x0..x{B} (float32 holding byte tokens 0..255; B = block_size: a row is B inputs and,
                  shifted by one, B next-token targets)

dataset.json records the ``task``. Regression adds ``target_names``; causal_lm adds ``vocab_size`` (256),
``block_size`` and ``num_tokens`` (bytes read); both have num_classes 0 and label_names [].

The test split (``test_fraction`` of the rows, default 0.2) is drawn first and does not depend on
``val_fraction``; the validation split (``val_fraction`` of all rows, default 0.1, drawn the same way)
is carved from the remaining rows, and train.parquet holds the rest. Classification splits are
stratified by class; regression rows and text blocks are split at random (seeded). Choices such as
greedy soup's are made on val.parquet, never on the test split. val_fraction 0 writes an empty
val.parquet with the same schema. Rows are written in a seeded random order (user files are often sorted
by label; the synthetic generator draws rows at random already), since partition keeps the input's
order within a shard and the shard reader's first epoch follows the file row group by row group.

Sources (keys of the spec; ``task`` defaults to the source's first task below; ``test_fraction`` defaults
to 0.2, ``val_fraction`` to 0.1, ``seed`` to 0):
  digits     classification: scikit-learn's bundled 8x8 digits (1797 rows, 64 features, 10 classes)
  diabetes   regression: scikit-learn's bundled diabetes data (442 rows, 10 scaled features, 1 raw target)
  synthetic  classification: num_rows, num_features, num_classes, class_sep (default 1.0): seeded Gaussian
             clusters. class_sep sets difficulty independent of num_features: nearest-centroid test
             accuracy with 10 classes is ~0.57 at 1.0, ~0.81 at 1.5, ~0.94 at 2.0 (chance at 0).
             regression: num_rows, num_features, num_outputs, noise (default 0.1): x ~ N(0, 1),
             y = f(x) + noise * N(0, 1) with f a seeded random one-hidden-layer network scaled so each
             target's std is about 1. Both are generated and written chunk by chunk, so tens of millions
             of rows fit in bounded memory.
  parquet    classification or regression: path, feature_columns and either label_column
             (classification: labels of any type mapped to 0..C-1 in sorted order) or label_columns
             (regression: numeric target columns)
  csv        same keys as parquet
  text       causal_lm: paths (glob patterns, ** recurses), exclude (fnmatch patterns of the full path,
             default []), block_size, max_tokens (default null: read everything). The files' bytes,
             sorted by path and joined by b"\\n", cut into non-overlapping rows of block_size + 1 tokens
             (the tail is dropped). Vocabulary: the 256 byte values; no download, no tokenizer.
Any classification source also takes ``classes``: keep only the rows whose label is one of these (e.g.
[0, 1, 2] for digits). The label space stays the whole data's: num_classes, label_names and the label
codes are unchanged, so a model trained on a subset has the full output layer.

The sources are library modules: :mod:`shardfuse.sources` (digits, diabetes, parquet, csv, text) and
:mod:`shardfuse.synthetic`; this stage validates the spec, splits the rows and writes the files.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.io import (
    StageParser,
    UserError,
    atomic_path,
    parse_json_arg,
    run_cli,
    sha256_file,
    write_json,
    write_stamps,
)
from shardfuse.sources import VOCAB_SIZE, kept_class_codes, load_in_memory, read_text_blocks
from shardfuse.synthetic import Chunk, synthetic_data

DEFAULTS = {
    "test_fraction": 0.2,
    "val_fraction": 0.1,
    "seed": 0,
    "class_sep": 1.0,
    "noise": 0.1,
    "exclude": (),
    "max_tokens": None,
}
SPLITS = ("train", "val", "test")
SPLIT_KEYS = {"test_fraction", "val_fraction", "seed"}
COMMON_KEYS = SPLIT_KEYS | {"task"}
USER_FILE_KEYS = ({"path", "feature_columns"}, COMMON_KEYS | {"label_column", "label_columns", "classes"})
# source -> (required keys, optional keys) for any of its tasks; "source" itself is always required.
SOURCE_KEYS: dict[str, tuple[set[str], set[str]]] = {
    "digits": (set(), COMMON_KEYS | {"classes"}),
    "diabetes": (set(), COMMON_KEYS),
    "synthetic": (
        {"num_rows", "num_features"},
        COMMON_KEYS | {"num_classes", "class_sep", "classes", "num_outputs", "noise"},
    ),
    "parquet": USER_FILE_KEYS,
    "csv": USER_FILE_KEYS,
    "text": ({"paths", "block_size"}, COMMON_KEYS | {"exclude", "max_tokens"}),
}
# The tasks each source can do; the first is its default.
SOURCE_TASKS = {
    "digits": ("classification",),
    "diabetes": ("regression",),
    "synthetic": ("classification", "regression"),
    "parquet": ("classification", "regression"),
    "csv": ("classification", "regression"),
    "text": ("causal_lm",),
}
TASKS = ("classification", "regression", "causal_lm")
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
SPEC_FIX = "fix the dataset's spec in the config"


# ---------------------------------------------------------------- spec validation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _require_int(spec: dict, key: str, minimum: int) -> None:
    if not _is_int(spec[key]) or spec[key] < minimum:
        raise UserError(f"spec key {key!r} must be an integer >= {minimum}, got {spec[key]!r}; {SPEC_FIX}")


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _require_number(spec: dict, key: str, low: float, high: float, *, open_interval: bool) -> None:
    value = spec[key]
    is_number = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not is_number or not (low < value < high if open_interval else low <= value <= high):
        what = f"strictly between {low} and {high}" if open_interval else f">= {low}"
        raise UserError(f"spec key {key!r} must be a number {what}, got {value!r}; {SPEC_FIX}")


def _require_names(spec: dict, key: str, what: str, *, allow_empty: bool = False) -> None:
    """``spec[key]`` must be a list of distinct non-empty strings (non-empty unless ``allow_empty``)."""
    value = spec[key]
    if (
        not isinstance(value, list)
        or not (value or allow_empty)
        or not all(isinstance(item, str) and item for item in value)
        or len(set(value)) != len(value)
    ):
        raise UserError(f"spec key {key!r} must be a {what}, got {value!r}; {SPEC_FIX}")


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

    _require_number(spec, "test_fraction", 0, 1, open_interval=True)
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
    _require_int(spec, "seed", 0)
    if source == "synthetic":
        _require_int(spec, "num_rows", 2)
        _require_int(spec, "num_features", 1)
        if task == "classification":
            _require_int(spec, "num_classes", 2)
            _require_number(spec, "class_sep", 0, math.inf, open_interval=False)
        else:
            _require_int(spec, "num_outputs", 1)
            _require_number(spec, "noise", 0, math.inf, open_interval=False)
    if source in ("parquet", "csv"):
        if not isinstance(spec["path"], str) or not spec["path"]:
            raise UserError(f"spec key 'path' must be a non-empty string, got {spec['path']!r}; {SPEC_FIX}")
        _require_names(spec, "feature_columns", "non-empty list of distinct column names")
        columns = spec["feature_columns"]
        if task == "classification" and (
            not isinstance(spec["label_column"], str) or spec["label_column"] in columns
        ):
            raise UserError(
                f"spec key 'label_column' must be a column name not among feature_columns, got "
                f"{spec['label_column']!r}; {SPEC_FIX}"
            )
        if task == "regression":
            what = "non-empty list of distinct column names, none of them among feature_columns"
            _require_names(spec, "label_columns", what)
            if set(spec["label_columns"]) & set(columns):
                raise UserError(
                    f"spec key 'label_columns' must be a {what}, got {spec['label_columns']!r}; {SPEC_FIX}"
                )
    if "classes" in spec:
        classes = spec["classes"]
        if (
            not isinstance(classes, list)
            or not classes
            or not all(isinstance(c, str) or _is_int(c) for c in classes)
            or len({str(c) for c in classes}) != len(classes)
        ):
            raise UserError(
                f"spec key 'classes' must be a non-empty list of distinct label values (strings or "
                f"integers), got {classes!r}; {SPEC_FIX}"
            )
    if source == "text":
        _require_names(spec, "paths", "non-empty list of glob patterns")
        _require_names(spec, "exclude", "list of glob patterns", allow_empty=True)
        _require_int(spec, "block_size", 2)
        if spec["max_tokens"] is not None:
            _require_int(spec, "max_tokens", 2)
    return spec


# ---------------------------------------------------------------- splitting and writing


class Written(NamedTuple):
    """What a source wrote, for dataset.json."""

    rows: dict[str, int]  # per split
    feature_names: list[str]
    label_names: list[str]  # the class names (classification); [] for the other tasks
    task_keys: dict[str, Any]  # the task's own dataset.json keys (target_names; vocab_size, ...)


def stratified_test_mask(labels: np.ndarray, num_classes: int, test_fraction: float, seed: int) -> np.ndarray:
    """Seeded stratified split: each class sends round(n_c * test_fraction) rows, at least 1 and at most
    n_c - 1, to the test side. Returns a boolean mask, True for test rows."""
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_test = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        num_test = min(max(math.floor(count * test_fraction + 0.5), 1), count - 1)
        is_test[rng.permutation(members)[:num_test]] = True
    return is_test


def stratified_val_mask(
    labels: np.ndarray, is_test: np.ndarray, num_classes: int, val_fraction: float, seed: int
) -> np.ndarray:
    """The validation rows, carved from the non-test rows like the test split: each class sends
    round(n_c * val_fraction) rows (n_c counts all its rows), at least 1 if val_fraction > 0, and always
    leaves at least one row of the class for training. Its own random stream, so the test split does not
    depend on val_fraction."""
    rng = np.random.default_rng([seed, 2])
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_val = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        remaining = members[~is_test[members]]
        wanted = math.floor(count * val_fraction + 0.5)
        num_val = min(max(wanted, 1 if val_fraction > 0 else 0), len(remaining) - 1)
        if num_val > 0:
            is_val[rng.permutation(remaining)[:num_val]] = True
    return is_val


def _split_masks(labels: np.ndarray, num_classes: int, spec: dict) -> dict[str, np.ndarray]:
    """The train/val/test masks: stratified by class, or (``labels`` an int array of zeros, one class)
    a plain seeded random split with the same rules."""
    is_test = stratified_test_mask(labels, num_classes, spec["test_fraction"], spec["seed"])
    is_val = stratified_val_mask(labels, is_test, num_classes, spec["val_fraction"], spec["seed"])
    return {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def _random_split_masks(num_rows: int, spec: dict) -> dict[str, np.ndarray]:
    """A seeded random split, not stratified: the stratified rules with every row in one class."""
    return _split_masks(np.zeros(num_rows, dtype=np.int64), 1, spec)


def _schema(num_features: int, task: str = "classification", num_targets: int = 0) -> pa.Schema:
    fields = [pa.field(f"x{j}", pa.float32()) for j in range(num_features)]
    if task == "classification":
        fields.append(pa.field("label", pa.int64()))
    elif task == "regression":
        fields += [pa.field(f"y{k}", pa.float32()) for k in range(num_targets)]
    return pa.schema(fields)


def _table(features: np.ndarray, targets: np.ndarray | None, task: str = "classification") -> pa.Table:
    """``targets``: int class codes (classification), a float (rows, K) array (regression) or None
    (causal_lm, whose features are the tokens)."""
    columns = np.ascontiguousarray(features.T, dtype=np.float32)  # column-major, as Arrow stores it
    arrays = [pa.array(column) for column in columns]
    num_targets = 0
    if task == "classification":
        arrays.append(pa.array(targets.astype(np.int64, copy=False)))
    elif task == "regression":
        num_targets = targets.shape[1]
        arrays += [pa.array(column) for column in np.ascontiguousarray(targets.T, dtype=np.float32)]
    return pa.Table.from_arrays(arrays, schema=_schema(features.shape[1], task, num_targets))


def _write_split(
    out_dir: Path,
    features: np.ndarray,
    targets: np.ndarray | None,
    masks: dict[str, np.ndarray],
    row_group_rows: int,
    spec: dict,
) -> dict[str, int]:
    """Each split's rows in a seeded random order: files are often sorted (by label, by time), and
    partition keeps the input's order within a shard, which the shard reader's first epoch follows
    row group by row group. Built and written one row group at a time (the same bytes as one
    write_table), so the float32 copy never exceeds a row group. Returns the rows per split."""

    def table_of(rows: np.ndarray) -> pa.Table:
        return _table(features[rows], None if targets is None else targets[rows], spec["task"])

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
    loaded = load_in_memory(spec)
    features, targets = loaded.features, loaded.targets
    if spec["task"] == "regression":
        masks = _random_split_masks(len(features), spec)
        rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec)
        return Written(rows, loaded.feature_names, [], {"target_names": loaded.target_names})
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
    masks = _split_masks(targets, len(label_names), spec)
    rows = _write_split(out_dir, features, targets, masks, row_group_rows, spec)
    return Written(rows, loaded.feature_names, label_names, {})


def _prepare_synthetic(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    data = synthetic_data(spec)
    schema = _schema(len(data.feature_names), spec["task"], len(data.target_names))
    rows = _write_chunks(out_dir, schema, data.chunks, row_group_rows, spec)
    task_keys = {"target_names": data.target_names} if spec["task"] == "regression" else {}
    return Written(rows, data.feature_names, data.label_names, task_keys)


def _prepare_text(spec: dict, out_dir: Path, row_group_rows: int) -> Written:
    blocks, num_tokens = read_text_blocks(spec)
    rows = _write_split(out_dir, blocks, None, _random_split_masks(len(blocks), spec), row_group_rows, spec)
    feature_names = [f"t{j}" for j in range(blocks.shape[1])]
    extra = {"vocab_size": VOCAB_SIZE, "block_size": spec["block_size"], "num_tokens": num_tokens}
    return Written(rows, feature_names, [], extra)


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
        "num_features": len(written.feature_names),
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
    if info["task"] == "classification":
        return f"{info['num_features']} features, {info['num_classes']} classes"
    if info["task"] == "regression":
        return f"{info['num_features']} features, {len(info['target_names'])} target(s)"
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
