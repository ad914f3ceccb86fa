"""Every task, one record each: the task's class (:class:`shardfuse.models.task.Task`), which carries its
behaviour. Train, evaluate, greedy soup, plots, summary, tracking, the config checks and prepare all ask
the task; none of them names a task or a metric on its own (tests/contracts/test_extension_task.py holds
that no module outside the task modules compares a task's name). No command line; a library module::

    python -c "from shardfuse.models.tasks import task_for; print(task_for('regression').score)"   # mse

- ``classification`` (:mod:`shardfuse.models.classification`): cross-entropy, ranked by accuracy.
- ``regression`` (:mod:`shardfuse.models.regression`): MSE or Huber on standardised targets, ranked by mse.
- ``causal_lm`` (:mod:`shardfuse.models.causal_lm`): next-token cross-entropy, ranked by loss.

Records are looked up at call time (:func:`shardfuse.io.find_record`), so a test that extends
``RECORDS`` reaches every stage. Importing this module imports no torch.

Adding a task: one module with a ``Task`` subclass, its class here, and its name in the schema's dataset
``task`` enum (tests/contracts/test_registries.py holds the two equal). The sources that give its
``labels`` serve it with no change.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError, find_record
from shardfuse.models.causal_lm import CausalLM
from shardfuse.models.classification import Classification
from shardfuse.models.regression import Regression
from shardfuse.models.task import Task, Totals

if TYPE_CHECKING:
    import torch

# Task and Totals are imported from here by the modules that score (one import for the task API).
__all__ = ["RECORDS", "Classification", "Task", "Totals", "task_for", "task_names", "task_record"]

RECORDS: tuple[type[Task], ...] = (Classification, Regression, CausalLM)
# The task of a dataset spec, dataset.json, checkpoint spec or eval.json that names none: they were
# written before tasks existed, or (a resolved dataset spec) leave the implicit task out so that their
# training names stay as they were.
IMPLICIT_TASK = Classification.name


def task_names() -> tuple[str, ...]:
    """Every task's name, in the order of ``RECORDS`` (the schema's enum lists them so)."""
    return tuple(record.name for record in RECORDS)


def task_record(name: str) -> type[Task]:
    """The task class called ``name``, or a one-line UserError naming the tasks."""
    return find_record(RECORDS, name, "task")


def task_for(
    name: str, loss: str = "mse", target_scale: torch.Tensor | None = None, bytes_per_token: float = 1.0
) -> Task:
    """The task object for ``name``; each task takes what concerns it of ``loss`` and ``target_scale``
    (regression) and ``bytes_per_token`` (of the corpus, for bits per byte: causal_lm)."""
    return task_record(name).configured(loss=loss, target_scale=target_scale, bytes_per_token=bytes_per_token)


def named_task(record: Any) -> str:
    """The task a mapping names (a dataset spec or dataset.json, a checkpoint spec), else the implicit one."""
    return str(record.get("task") or IMPLICIT_TASK)


def spec_task_entry(name: str) -> dict[str, str]:
    """What a resolved dataset spec records of its task: nothing for the implicit task (older specs,
    and the training names made from them, stay as they were), else ``{"task": name}``."""
    return {} if name == IMPLICIT_TASK else {"task": name}


def tasks_with_labels(labels: tuple[str, ...]) -> tuple[str, ...]:
    """The tasks trained on any of these target layouts, by layout then in the order of ``RECORDS``:
    what a source that gives them serves, its default first."""
    return tuple(record.name for layout in labels for record in RECORDS if record.labels == layout)


def evaluation_task(evaluation: Any, path: str | os.PathLike = "eval.json") -> Task:
    """The task an eval.json was scored for, from its record (shardfuse.experiment.records.EvalRecord,
    which imports this module) or the object as read. Files written before tasks existed are
    classification ranked by accuracy; a score other than the task's would make every "best" and "gain"
    wrong."""
    if not isinstance(evaluation, dict) and hasattr(evaluation, "score"):  # a record: absent reads as None
        recorded = {key: getattr(evaluation, key) for key in ("task", "score")}
        evaluation = {key: value for key, value in recorded.items() if value is not None}
    name = evaluation.get("task", IMPLICIT_TASK) if isinstance(evaluation, dict) else None
    try:
        task = task_for(str(name))
    except UserError as exc:
        raise UserError(f"{path}: {exc}; re-run the evaluate stage") from None
    score = evaluation.get("score", task.score)
    if score != task.score:
        raise UserError(
            f"{path} ranks {name} by {score!r}, but shardfuse ranks it by {task.score!r}; "
            "re-run the evaluate stage"
        )
    return task


def score_first(task: Task) -> tuple[str, ...]:
    """The task's metrics with its score first (classification: accuracy, loss, as always logged)."""
    return (task.score, *(m for m in task.metrics if m != task.score))
