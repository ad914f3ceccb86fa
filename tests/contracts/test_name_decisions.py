"""A task's, a source's, a strategy's or a partitioner's name is compared in one place, its record: no
module outside the task modules (the classes in ``shardfuse.models.tasks.RECORDS``, the registry and the
base class) decides anything by a task's name, none outside the source registry by a source's, none
outside their packages by a strategy's or a partitioner's. Read from the source (AST): a comparison
with a name (``== "causal_lm"``, ``in ("classification", ...)``, ``match``), a dict keyed by names (a
dispatch table), ``.get()`` or a subscript with one, a default argument that is one, and ``isinstance``
against a task class. Names in messages and docstrings are words, not decisions: they stay."""

from __future__ import annotations

import ast
import inspect
import textwrap
from pathlib import Path

from shardfuse.data.sources import registry as sources
from shardfuse.models import task as task_base
from shardfuse.models import tasks
from tests.support.helpers import REPO

PACKAGE = REPO / "src" / "shardfuse"
TASK_NAMES = frozenset(tasks.task_names())
TASK_CLASSES = frozenset(record.__name__ for record in tasks.RECORDS)
SOURCE_NAMES = frozenset(sources.source_names())


def task_modules() -> set[Path]:
    """Where a task's name may be compared: its own module, the registry, the base class."""
    return {Path(inspect.getsourcefile(module)).resolve() for module in (tasks, task_base)} | {
        Path(inspect.getsourcefile(record)).resolve() for record in tasks.RECORDS
    }


def name_decisions(
    source: str,
    names: frozenset[str] = TASK_NAMES,
    classes: frozenset[str] = TASK_CLASSES,
    keywords: bool = True,
) -> list[str]:
    """Each place ``source`` decides by one of ``names`` (or a class of ``classes``): 'line: what'.
    ``keywords``: a keyword argument so named counts too (dict(classification=...); not for source
    names, as ``text=True`` is subprocess's)."""

    def _names_one(node: ast.AST | None) -> bool:
        """One of the names as a constant, or a tuple/list/set of constants holding one."""
        if isinstance(node, ast.Constant):
            return node.value in names
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return any(_names_one(element) for element in node.elts)
        return False

    found = []

    def offence(node: ast.AST, what: str) -> None:
        found.append(f"{node.lineno}: {what}")

    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Compare) and any(map(_names_one, [node.left, *node.comparators])):
            offence(node, "compares with a task name")
        elif isinstance(node, ast.Dict) and any(map(_names_one, node.keys)):
            offence(node, "a dict keyed by task names")
        elif isinstance(node, ast.Subscript) and _names_one(node.slice):
            offence(node, "looks a task name up")
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            if _names_one(node.pattern.value):
                offence(node.pattern, "matches a task name")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if any(map(_names_one, [*node.args.defaults, *node.args.kw_defaults])):
                offence(node, "a task name as a default argument")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and any(map(_names_one, node.args)):
                offence(node, "a .get() with a task name")
            elif keywords and any(keyword.arg in names for keyword in node.keywords):
                offence(node, "a task name as a keyword (a dispatch table)")
            elif isinstance(func, ast.Name) and func.id == "isinstance" and len(node.args) == 2:
                checked = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(isinstance(c, (ast.Name, ast.Attribute)) and _name_of(c) in classes for c in checked):
                    offence(node, "isinstance against a task class")
    return found


def _name_of(node: ast.Name | ast.Attribute) -> str:
    return node.id if isinstance(node, ast.Name) else node.attr


def test_no_module_outside_the_task_records_decides_by_a_task_name():
    allowed = task_modules()
    assert len(allowed) >= 5  # the registry, the base class and the three built-in tasks
    offenders = [
        f"{path.relative_to(REPO)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() not in allowed
        for where in name_decisions(path.read_text())
    ]
    assert offenders == [], "ask the task (shardfuse.models.tasks) instead:\n" + "\n".join(offenders)


def test_no_module_outside_the_source_records_decides_by_a_source_name():
    allowed = {Path(inspect.getsourcefile(sources)).resolve()}
    offenders = [
        f"{path.relative_to(REPO)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.resolve() not in allowed
        for where in name_decisions(path.read_text(), SOURCE_NAMES, frozenset(), keywords=False)
    ]
    assert offenders == [], "ask the source's record (shardfuse.data.sources.registry):\n" + "\n".join(
        offenders
    )


def test_no_module_outside_their_records_decides_by_a_strategy_or_partitioner_name():
    from shardfuse.data.partitioners import registry as partitioners
    from shardfuse.strategies import registry as strategies

    offenders = []
    for kind, registry in (("strategy", strategies), ("partitioner", partitioners)):
        names = frozenset(registry.names())
        home = Path(inspect.getsourcefile(registry)).resolve().parent  # the records and their modules
        offenders += [
            f"{path.relative_to(REPO)}:{where} ({kind})"
            for path in sorted(PACKAGE.rglob("*.py"))
            if home not in path.resolve().parents
            for where in name_decisions(path.read_text(), names, frozenset(), keywords=False)
        ]
    assert offenders == [], "ask the record instead:\n" + "\n".join(offenders)


PLANTED = textwrap.dedent(
    '''
    """A docstring naming classification and regression is fine."""
    LOSSES = {"regression": "mse", "classification": "cross_entropy"}
    def f(task, info, kind="causal_lm"):
        if task == "causal_lm":
            pass
        if info.get("task", "classification") != "regression":
            pass
        if task.name in ("classification", "regression"):
            pass
        match task:
            case "regression":
                pass
        heads = dict(classification=1)
        scale = isinstance(task, Regression)
        raise ValueError(f"task {task} is not classification")
    TABLE["causal_lm"]
    '''
)


def test_the_check_finds_every_kind_of_task_name_decision_it_forbids():
    found = name_decisions(PLANTED)
    assert sorted(where.split(": ", 1)[1] for where in found) == sorted(
        [
            "a dict keyed by task names",
            "a task name as a default argument",
            "compares with a task name",  # == "causal_lm"
            "compares with a task name",  # != "regression"
            "compares with a task name",  # in ("classification", "regression")
            "a .get() with a task name",
            "matches a task name",
            "a task name as a keyword (a dispatch table)",
            "isinstance against a task class",
            "looks a task name up",
        ]
    )
    # Names in strings that decide nothing (the docstring, the message) are not reported.
    lines = PLANTED.splitlines()
    words = {str(n) for n, line in enumerate(lines, 1) if '"""' in line or "raise" in line}
    assert not {where.split(":")[0] for where in found} & words
