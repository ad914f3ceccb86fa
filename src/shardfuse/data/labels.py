"""How a task's targets are laid out in a prepared dataset: one record per layout, named by the task's
``labels`` (:data:`shardfuse.models.task.CLASSES`, ``VALUES``, ``TOKENS``). A layout says what prepare
writes for it (the target columns of the shard format, how the rows are split, what dataset.json records
of the label names), which dataset.json keys a dataset of it must have, and the spec keys every source
of it takes (``classes``).

- classes: an int64 ``label`` column of class codes 0..C-1, the class names in dataset.json's
  ``label_names``; splits stratified by class; the spec's ``classes`` keeps some classes (the label space
  stays the whole data's).
- values: float32 columns y0..y{K-1}, their names in dataset.json's ``target_names``; a random split.
- tokens: no target column (the targets are the token block shifted by one), or, for supervised
  fine-tuning, a ``loss_mask`` column (uint8 [block_size]: 1 where the next token counts); a random split.

A task picks its layout; the sources that give a layout serve every task of it. A library module (numpy;
pyarrow only where columns are built), no command line::

    python -c "from shardfuse.data.labels import layout_of; print(layout_of('regression').info_fields)"
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

from shardfuse.data.sources.checks import SPEC_FIX, is_int
from shardfuse.io import UserError, find_record
from shardfuse.models.task import CLASSES, TOKENS, VALUES
from shardfuse.models.tasks import task_record, tasks_with_labels

if TYPE_CHECKING:
    import pyarrow as pa


class Layout:
    """What every layout has; the subclasses below are the records."""

    name: str
    info_fields: tuple[str, ...] = ()  # dataset.json keys a dataset of this layout must have
    spec_keys: frozenset[str] = frozenset()  # spec keys every source of this layout takes

    def check_spec(self, spec: dict[str, Any]) -> None:
        """Prepare's check of :attr:`spec_keys` in a validated spec."""

    def config_problem(self, spec: dict[str, Any]) -> tuple[str, str] | None:
        """(key, what is wrong) for the config check, which the schema cannot say; None if fine."""
        return None

    def select(self, targets: np.ndarray | None, names: list[str], spec: dict[str, Any]) -> np.ndarray | None:
        """The rows prepare keeps: a boolean mask, or None for all of them (unless the layout filters)."""
        return None

    def strata(self, targets: np.ndarray | None, num_rows: int, names: list[str]) -> tuple[np.ndarray, int]:
        """(stratum of each row, number of strata) the split is stratified by: one stratum, a random split."""
        return np.zeros(num_rows, dtype=np.int64), 1

    def fields(self, targets: np.ndarray | None) -> tuple[list[pa.Field], list[pa.Array]]:
        """The target columns of rows with these targets."""
        return [], []

    def no_targets(self, num_targets: int) -> np.ndarray | None:
        """The targets of zero rows (a streamed source's schema)."""
        return None

    def names(self, target_names: list[str]) -> tuple[list[str], dict[str, Any]]:
        """(dataset.json's label_names, its own dataset.json keys) for a source's target names."""
        return [], {}

    def summary(self, info: dict[str, Any], inputs: str) -> str:
        """The prepare stage's last line after the rows (``inputs``: "64 features" or "shape [1, 8, 8]")."""
        raise NotImplementedError

    def task_name(self) -> str:
        """The task that uses this layout by default (what an error suggests setting)."""
        return tasks_with_labels((self.name,))[0]


class ClassLabels(Layout):
    name = CLASSES
    spec_keys = frozenset({"classes"})

    def check_spec(self, spec: dict[str, Any]) -> None:
        if "classes" not in spec:
            return
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

    def config_problem(self, spec: dict[str, Any]) -> tuple[str, str] | None:
        if len(spec.get("classes", [0, 1])) < 2:
            return "classes", (
                f"{spec['classes']!r} keeps a single class, and a classifier needs at least 2; list two "
                "or more labels, or remove classes"
            )
        return None

    def select(self, targets: np.ndarray | None, names: list[str], spec: dict[str, Any]) -> np.ndarray | None:
        """The rows of the spec's ``classes``; refused when a class has a single row (a stratified split
        needs two)."""
        keep = None
        if "classes" in spec:
            keep = np.isin(targets, kept_class_codes(spec["classes"], names))
            targets = targets[keep]
        counts = np.bincount(targets, minlength=len(names))
        rare = [f"{names[c]!r}" for c in np.flatnonzero(counts == 1)]
        if rare:
            raise UserError(
                f"label value(s) {', '.join(rare[:10])} in {spec.get('path', spec['source'])} have a single "
                "row; a stratified split needs at least 2 rows per class: add rows or drop those"
            )
        return keep

    def strata(self, targets: np.ndarray | None, num_rows: int, names: list[str]) -> tuple[np.ndarray, int]:
        return targets, len(names)

    def fields(self, targets: np.ndarray | None) -> tuple[list[pa.Field], list[pa.Array]]:
        import pyarrow as pa

        from shardfuse.data.shard_format import LABEL_COLUMN  # deferred, as pyarrow: the config reads this

        return [pa.field(LABEL_COLUMN, pa.int64())], [pa.array(targets.astype(np.int64, copy=False))]

    def no_targets(self, num_targets: int) -> np.ndarray | None:
        return np.zeros(0)

    def names(self, target_names: list[str]) -> tuple[list[str], dict[str, Any]]:
        return target_names, {}

    def summary(self, info: dict[str, Any], inputs: str) -> str:
        return f"{inputs}, {info['num_classes']} classes"


class TargetValues(Layout):
    name = VALUES
    info_fields = ("target_names",)

    def fields(self, targets: np.ndarray | None) -> tuple[list[pa.Field], list[pa.Array]]:
        import pyarrow as pa

        from shardfuse.data.shard_format import target_columns

        fields = [pa.field(name, pa.float32()) for name in target_columns(targets.shape[1])]
        return fields, [pa.array(column) for column in np.ascontiguousarray(targets.T, dtype=np.float32)]

    def no_targets(self, num_targets: int) -> np.ndarray | None:
        return np.zeros((0, num_targets))

    def names(self, target_names: list[str]) -> tuple[list[str], dict[str, Any]]:
        return [], {"target_names": target_names}

    def summary(self, info: dict[str, Any], inputs: str) -> str:
        return f"{inputs}, {len(info['target_names'])} target(s)"


class NextTokens(Layout):
    name = TOKENS
    info_fields = ("vocab_size", "block_size")

    def fields(self, targets: np.ndarray | None) -> tuple[list[pa.Field], list[pa.Array]]:
        """None, or a source's loss mask (rows x block_size, 1 where the next token counts)."""
        if targets is None:
            return [], []
        import pyarrow as pa

        from shardfuse.data.shard_format import LOSS_MASK_COLUMN

        width = targets.shape[1]
        flat = pa.array(np.ascontiguousarray(targets, dtype=np.uint8).reshape(-1))
        return [pa.field(LOSS_MASK_COLUMN, pa.list_(pa.uint8(), width))], [
            pa.FixedSizeListArray.from_arrays(flat, width)
        ]

    def summary(self, info: dict[str, Any], inputs: str) -> str:
        counted = f", {info['loss_tokens']} of them in the loss" if "loss_tokens" in info else ""
        return f"{info['num_tokens']} tokens in blocks of {info['block_size']} + 1{counted}"


RECORDS: tuple[Layout, ...] = (ClassLabels(), TargetValues(), NextTokens())


def find_layout(name: str) -> Layout:
    return find_record(RECORDS, name, "label layout")


def layout_of(task: str) -> Layout:
    """The layout of the targets of task ``task`` (a name; UserError for an unknown one)."""
    return find_layout(task_record(task).labels)


def kept_class_codes(classes: list, label_names: list[str]) -> np.ndarray:
    """The codes of the labels named in the spec's ``classes``, matched as strings ([0, 1] and ["0", "1"]
    both name digits' first two classes), else as numbers (1 names a float label "1.0")."""
    codes = []
    for value in classes:
        matches = [code for code, name in enumerate(label_names) if name == str(value)]
        matches = matches or [code for code, name in enumerate(label_names) if _same_number(name, value)]
        if not matches:
            shown = ", ".join(label_names[:20]) + (", …" if len(label_names) > 20 else "")
            raise UserError(
                f"class {value!r} in spec key 'classes' is not a label of this dataset; valid labels: {shown}"
            )
        if matches[0] in codes:
            other = classes[codes.index(matches[0])]
            raise UserError(
                f"spec key 'classes' names label {label_names[matches[0]]!r} twice ({other!r} and "
                f"{value!r}); list each class once"
            )
        codes.append(matches[0])
    return np.unique(np.asarray(codes, dtype=np.int64))


def _same_number(name: str, value: Any) -> bool:
    try:
        return float(name) == float(value)
    except (ValueError, OverflowError):
        return False
