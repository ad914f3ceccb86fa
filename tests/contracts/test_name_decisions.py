"""A task's, a source's, a strategy's, a partitioner's, a merge method's or a built-in model's name is
compared in one place, its record: no module outside the task modules (the classes in
``shardfuse.models.tasks.RECORDS``, the registry and the base class) decides anything by a task's name,
none outside the source registry by a source's, none outside their packages by a strategy's, a
partitioner's or a merge method's, none outside the catalog by a built-in model's. Read from the source
(AST): a comparison
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
    kind: str = "task",
) -> list[str]:
    """Each place ``source`` decides by one of ``names`` (or a class of ``classes``): 'line: what', the
    names being ``kind``'s. ``keywords``: a keyword argument so named counts too (dict(classification=...);
    not for source names, as ``text=True`` is subprocess's)."""

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
            offence(node, f"compares with a {kind} name")
        elif isinstance(node, ast.Dict) and any(map(_names_one, node.keys)):
            offence(node, f"a dict keyed by {kind} names")
        elif isinstance(node, ast.Subscript) and _names_one(node.slice):
            offence(node, f"looks a {kind} name up")
        elif isinstance(node, ast.match_case) and isinstance(node.pattern, ast.MatchValue):
            if _names_one(node.pattern.value):
                offence(node.pattern, f"matches a {kind} name")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            if any(map(_names_one, [*node.args.defaults, *node.args.kw_defaults])):
                offence(node, f"a {kind} name as a default argument")
        elif isinstance(node, ast.Call):
            func = node.func
            if isinstance(func, ast.Attribute) and func.attr == "get" and any(map(_names_one, node.args)):
                offence(node, f"a .get() with a {kind} name")
            elif keywords and any(keyword.arg in names for keyword in node.keywords):
                offence(node, f"a {kind} name as a keyword (a dispatch table)")
            elif isinstance(func, ast.Name) and func.id == "isinstance" and len(node.args) == 2:
                checked = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(isinstance(c, (ast.Name, ast.Attribute)) and _name_of(c) in classes for c in checked):
                    offence(node, f"isinstance against a {kind} class")
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
        for where in name_decisions(path.read_text(), SOURCE_NAMES, frozenset(), False, "source")
    ]
    assert offenders == [], "ask the source's record (shardfuse.data.sources.registry):\n" + "\n".join(
        offenders
    )


# A word that is a record's name and something else in some module, left to that module alone: "ties"
# is also the header key of tied weights ({alias: source}, shardfuse.models.adapter), which these
# modules read and write; "ties" the merge method is still decided on nowhere but its record.
COLLISIONS = {
    "merge method": {
        "src/shardfuse/models/adapter.py": {"ties"},
        "src/shardfuse/models/lora.py": {"ties"},
        "src/shardfuse/rank/setup.py": {"ties"},
        "src/shardfuse/rank/start.py": {"ties"},
        "src/shardfuse/collect.py": {"ties"},
    }
}


# Partitioners named by common words ("shards", "size", "column" are also keys of manifests, headers
# and tables everywhere): compared only under their home, like every name, but a dict key or a lookup
# with one is not counted as a decision (test_no_partition_name_is_compared_outside_its_package).
# "none" the merge method (a run over one checkpoint, kept as it is) is also the off value of merge_align,
# merge_adapter, lr_schedule and more: it is decided by its record (a check refusing more than one rank).
COMMON_WORDS = {"partitioner": {"shards", "size", "column"}, "merge method": {"none"}}


def _registries() -> list[tuple[str, frozenset[str], Path]]:
    """(kind, names, home): each kind's names are compared only under its home (a package or a module)."""
    from shardfuse.data.partitioners import registry as partitioners
    from shardfuse.fusion.methods import registry as merge_methods
    from shardfuse.models import catalog
    from shardfuse.strategies import registry as strategies

    def package_of(module) -> Path:  # the records and the modules of their plans and behaviour
        return Path(inspect.getsourcefile(module)).resolve().parent

    return [
        ("strategy", frozenset(strategies.names()), package_of(strategies)),
        ("partitioner", frozenset(partitioners.names()), package_of(partitioners)),
        ("merge method", frozenset(merge_methods.names()), package_of(merge_methods)),
        ("built-in model", frozenset(catalog.names()), Path(inspect.getsourcefile(catalog)).resolve()),
    ]


def record_name_decisions(paths: list[Path]) -> list[str]:
    """Each place in ``paths`` (outside the kind's home) deciding by a record's name: 'path:line: what'."""
    found = []
    for kind, names, home in _registries():
        for path in paths:
            resolved = path.resolve()
            if resolved == home or home in resolved.parents:
                continue
            where = str(resolved.relative_to(REPO)) if REPO in resolved.parents else str(path)
            words = names - COLLISIONS.get(kind, {}).get(where, set()) - COMMON_WORDS.get(kind, set())
            found += [
                f"{where}:{decision}"
                for decision in name_decisions(path.read_text(), words, frozenset(), False, kind)
            ]
    return found


def test_no_module_outside_their_records_decides_by_a_strategy_partitioner_merge_method_or_model_name():
    offenders = record_name_decisions(sorted(PACKAGE.rglob("*.py")))
    assert offenders == [], "ask the record instead:\n" + "\n".join(offenders)


def test_no_partition_name_is_compared_outside_its_package():
    """The common words left out above, still refused where they are compared with or matched."""
    from shardfuse.data.partitioners import registry as partitioners

    home = Path(inspect.getsourcefile(partitioners)).resolve().parent
    words = frozenset(COMMON_WORDS["partitioner"])
    offenders = [
        f"{path.relative_to(REPO)}:{where}"
        for path in sorted(PACKAGE.rglob("*.py"))
        if home not in path.resolve().parents
        for where in name_decisions(path.read_text(), words, frozenset(), False, "partitioner")
        if "compares" in where or "matches" in where
    ]
    assert offenders == [], "ask the partitioner's record instead:\n" + "\n".join(offenders)


def test_a_planted_merge_method_or_built_in_model_decision_is_found(tmp_path):
    planted = tmp_path / "planted.py"
    planted.write_text(
        textwrap.dedent(
            '''
            """Docstrings naming slerp, consolidate and hf decide nothing."""
            WEIGHTS = {"weighted": "rows"}
            def f(run, meta):
                if run["merge_method"] == "slerp" and run["world_size"] != 2:
                    pass
                if run["model"] in ("hf", "transformer"):
                    pass
                tied = meta.get("ties")  # a tied-weights key is a merge method's name outside its module
            '''
        )
    )
    found = sorted(where.split(":", 1)[1] for where in record_name_decisions([planted]))
    assert found == [
        "3: a dict keyed by merge method names",
        "5: compares with a merge method name",
        "7: compares with a built-in model name",
        "9: a .get() with a merge method name",
    ]


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
