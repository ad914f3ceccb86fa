"""What a dataset source does: the interface its class implements (its record in
:mod:`shardfuse.data.sources.registry` names the class), and the rows a source hands to the writer.

A source checks its own spec keys (``check``), says what its data will look like from the spec alone
where it can (``describe``: the config check of a foreign init_from builds the model from it before any
job) and prepares the three split files (``prepare``). Most sources hold their data in memory: they
implement ``load`` and leave the split and the writing to :func:`shardfuse.data.sources.write.write_loaded`,
which asks the task's layout of targets (:mod:`shardfuse.data.labels`) how to split and store them. Every
method takes the spec as :func:`shardfuse.data.sources.spec.validate_spec` returns it (defaults and
``task`` filled in) and the task object; faults in the data are one-line ``UserError`` s.
A library module, no command line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, NamedTuple

from shardfuse.data.shard_format import InputKind  # numeric columns, one tensor column, or token blocks
from shardfuse.data.sources.write import Loaded, Written, write_loaded
from shardfuse.models.task import Task

__all__ = ["Described", "Loaded", "SourceBehaviour", "Written"]


class Described(NamedTuple):
    """What a spec alone says of its data (the dataset.json keys a model is built from)."""

    kind: InputKind
    shape: list[int]  # one row's input
    feature_names: list[str]
    target_names: list[str]
    dataset_keys: dict[str, Any] | None = None  # the source's own dataset.json keys (vocab_size, ...)


class SourceBehaviour:
    """A source's behaviour (see the module docstring); the default prepare loads the data whole."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        """Refuse a bad value of the source's own keys."""

    def describe(self, spec: dict[str, Any], task: Task) -> Described | None:
        """The data's shape and names from the spec alone, or None when only the files can tell."""
        return None

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        raise NotImplementedError

    def prepare(self, spec: dict[str, Any], task: Task, out_dir: Path, row_group_rows: int) -> Written:
        return write_loaded(self.load(spec, task), spec, task, out_dir, row_group_rows)
