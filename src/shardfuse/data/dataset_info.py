"""dataset.json as a rank reads it (written by prepare): the keys it must have and the type of each
field, so an edited or truncated file is one error naming it, not a TypeError or KeyError inside the
ranks. Torch-free.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

from shardfuse.data.labels import layout_of
from shardfuse.io import UserError, read_json, wrong_type
from shardfuse.models.tasks import IMPLICIT_TASK, task_names

DATASET_KEYS = (
    "name",
    "source",
    "num_features",
    "num_classes",
    "feature_names",
    "label_names",
    "rows",
    "test_fraction",
    "seed",
    "sha256",
)


def read_dataset_info(dataset_dir: str | Path) -> dict:
    """Read dataset_dir/dataset.json (written by prepare): num_features, num_classes, names, rows, ..."""
    path = Path(dataset_dir) / "dataset.json"
    info = read_json(path, "dataset info")
    missing = [key for key in DATASET_KEYS if not isinstance(info, dict) or key not in info]
    if missing:
        raise UserError(
            f"dataset info {path} lacks {', '.join(missing)}; re-run the prepare stage "
            "(snakemake -R prepare_dataset)"
        )
    _check_info_fields(path, info)
    recorded = info.get(INFO_DIGEST)
    if recorded is not None and recorded != info_digest(info):
        raise UserError(
            f"dataset info {path} was edited after prepare wrote it (its fields no longer match its "
            f"{INFO_DIGEST}: label_names, num_classes or another field changed); re-run the prepare stage "
            "(snakemake -R prepare_dataset)"
        )
    return info


# dataset.json's digest of its own other fields (prepare writes it last): a file edited by hand (classes
# renamed or re-counted) is refused where a stage reads it, instead of training on it. Absent from files
# of older prepare stages, which are read as they are.
INFO_DIGEST = "info_sha256"


def info_digest(info: dict[str, Any]) -> str:
    """sha256 of dataset.json's fields other than :data:`INFO_DIGEST`, in a canonical JSON form."""
    fields = {key: value for key, value in info.items() if key != INFO_DIGEST}
    text = json.dumps(fields, sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    return hashlib.sha256(text.encode()).hexdigest()


# dataset.json's fields as a rank builds from them, typed as the records of shardfuse.experiment.records
# are: an edited field is this file's one-line error, not a TypeError or KeyError inside the ranks.
DATASET_FIELDS = {
    "name": "str", "source": "str", "task": "str", "input": "dict", "num_features": "int",
    "num_classes": "int", "feature_names": "list", "label_names": "list", "rows": "dict",
    "sha256": "dict", "seed": "int", "test_fraction": "float", "target_names": "list",
    "vocab_size": "int", "block_size": "int", "categories": "dict",
}  # fmt: skip


def _info_problem(info: dict[str, Any]) -> str | None:
    """How dataset.json fails :data:`DATASET_FIELDS` or the fields of its task's layout of targets
    (shardfuse.data.labels), or None."""
    for key, annotation in DATASET_FIELDS.items():
        if key in info and (wrong := wrong_type(info[key], annotation)) is not None:
            return f"'{key}' is {wrong}"
    if (
        null := next((key for key in ("num_features", "num_classes") if info[key] is None), None)
    ) is not None:
        return f"'{null}' is null"
    task = info.get("task", IMPLICIT_TASK)
    if task not in task_names():
        return f"'task' is {task!r}, not one of {', '.join(task_names())}"
    if missing := [key for key in layout_of(task).info_fields if info.get(key) is None]:
        return f"task {task} needs {', '.join(missing)}"
    if info["num_features"] < 1:
        return f"'num_features' is {info['num_features']}, not a positive count of input values"
    if info["num_classes"] < 0:
        return f"'num_classes' is {info['num_classes']}, not a count of classes"
    shape = info.get("input", {}).get("shape", [info["num_features"]])
    if not isinstance(shape, list) or not all(isinstance(n, int) and n >= 1 for n in shape):
        return f"'input' has shape {shape!r}, not a list of positive integers"
    return None


def _check_info_fields(path: Path, info: dict[str, Any]) -> None:
    if (problem := _info_problem(info)) is not None:
        raise UserError(
            f"dataset info {path}: {problem}; re-run the prepare stage (snakemake -R prepare_dataset)"
        )
