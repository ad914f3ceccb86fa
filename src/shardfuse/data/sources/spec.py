"""A dataset spec checked against its source's record: the keys it may hold and must hold (for its task),
the split keys, the layout's keys (``classes``) and the source's own checks; the defaults filled in. The
prepare stage validates every spec with :func:`validate_spec` before a byte is read. A library module::

    python -c "from shardfuse.data.sources.spec import validate_spec
    print(validate_spec({'source': 'digits'}))"
"""

from __future__ import annotations

import math
from typing import Any

from shardfuse.data.labels import find_layout, layout_of
from shardfuse.data.sources.checks import SPEC_FIX, require_int, require_number
from shardfuse.data.sources.registry import SPLIT_DEFAULTS, Source, find_source, source_names
from shardfuse.io import MAX_SEED, UserError
from shardfuse.models.tasks import task_for, task_names


def _is_fraction(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _task_of(spec: dict, source: Source) -> str:
    tasks = source.tasks()
    task = spec.get("task", tasks[0])
    if task not in task_names():
        raise UserError(f"spec key 'task' must be one of {', '.join(task_names())}, got {task!r}; {SPEC_FIX}")
    if task not in tasks:
        raise UserError(
            f"source {source.name!r} cannot do task {task!r}; use task: {' or '.join(tasks)} "
            "(or leave task out) or pick another source"
        )
    return task


def _check_known(spec: dict, source: Source) -> None:
    allowed = source.allowed()
    unknown = sorted(set(spec) - allowed)
    if unknown:
        raise UserError(
            f"unknown key(s) {', '.join(map(repr, unknown))} in the {source.name!r} dataset spec; "
            f"valid keys are {', '.join(sorted(allowed))}"
        )


def _check_task_keys(spec: dict, source: Source, task: str) -> None:
    """None of the keys only another layout of targets takes, none of the task's missing."""
    for layout, keys in source.foreign(task).items():
        if foreign := sorted(keys & set(spec)):
            other = find_layout(layout).task_name()
            raise UserError(
                f"spec key(s) {', '.join(map(repr, foreign))} only apply to task {other!r}, and this "
                f"{source.name!r} dataset's task is {task!r}; drop them or set task: {other}"
            )
    missing = sorted(source.required_for(task) - set(spec))
    if missing:
        raise UserError(
            f"the {source.name!r} dataset spec (task {task}) lacks {', '.join(map(repr, missing))}; "
            f"{SPEC_FIX}"
        )


def _check_split(spec: dict) -> None:
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


def validate_spec(spec: Any) -> dict:
    """Check a dataset spec; return a copy with defaults (task included) filled in, or raise UserError at
    the first fault."""
    if not isinstance(spec, dict):
        raise UserError(f"the dataset spec must be a JSON object, got {type(spec).__name__}; {SPEC_FIX}")
    name = spec.get("source")
    if not isinstance(name, str) or name not in source_names():
        raise UserError(f"unknown dataset source {name!r}; use one of {', '.join(sorted(source_names()))}")
    source = find_source(name)
    _check_known(spec, source)
    task = _task_of(spec, source)
    _check_task_keys(spec, source, task)
    accepted = source.accepted(task)
    defaults = {**SPLIT_DEFAULTS, **source.defaults}
    defaults = {k: list(v) if isinstance(v, tuple) else v for k, v in defaults.items() if k in accepted}
    spec = {**defaults, **spec, "task": task}
    _check_split(spec)
    source.behaviour_of().check(spec, task_for(task))
    layout_of(task).check_spec(spec)
    return spec
