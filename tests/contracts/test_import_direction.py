"""Dependencies point down: a library module never imports a stage module, a stage never imports another.

A stage is a module with a command line: it has an ``if __name__ == "__main__"`` block, or the workflow
runs it as ``-m shardfuse.<name>``. Every import counts, also one deferred into a function body or
under ``if TYPE_CHECKING``: a deferred import is still a dependency, only a later one.
"""

from __future__ import annotations

import ast
import functools
import itertools
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

from tests.support.helpers import subprocess_env

REPO = Path(__file__).resolve().parents[2]
PACKAGE_DIR = REPO / "src" / "shardfuse"
PACKAGE = PACKAGE_DIR.name
WORKFLOW_FILES = [REPO / "Snakefile", *sorted((REPO / "workflow").rglob("*.smk"))]
RUN_AS_MODULE = re.compile(rf"-m\s+{PACKAGE}\.([A-Za-z_][\w.]*)")
# Known stages: a floor for the derivation below, so a change that breaks it cannot empty the list
# and make the checks pass vacuously.
KNOWN_STAGES = {"prepare", "partition", "launch", "train", "gather", "merge", "evaluate", "tracking"}


class Import(NamedTuple):
    importer: str  # dotted module name, e.g. shardfuse.data.reader
    imported: str  # dotted module name, e.g. shardfuse.partition
    where: str  # file:line
    statement: str  # the import as written


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(path): path for path in sorted(PACKAGE_DIR.rglob("*.py"))}


def has_main_block(tree: ast.Module) -> bool:
    return any(
        isinstance(node, ast.If)
        and isinstance(node.test, ast.Compare)
        and isinstance(node.test.left, ast.Name)
        and node.test.left.id == "__name__"
        and any(isinstance(c, ast.Constant) and c.value == "__main__" for c in node.test.comparators)
        for node in tree.body
    )


@functools.cache  # the package's sources are parsed once per run, not once per test
def stage_modules() -> frozenset[str]:
    stages = {name for name, path in MODULES.items() if has_main_block(ast.parse(path.read_text()))}
    for path in WORKFLOW_FILES:
        stages |= {f"{PACKAGE}.{name}" for name in RUN_AS_MODULE.findall(path.read_text())}
    return frozenset(stages)


def _resolve(importer: str, is_package: bool, node: ast.ImportFrom) -> str:
    """The absolute module an ``from X import ...`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    package = importer if is_package else importer.rpartition(".")[0]
    base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
    return f"{base}.{node.module}" if node.module else base


def _import_module_target(node: ast.Call) -> str | None:
    """``importlib.import_module("shardfuse.x")`` with a literal name imports shardfuse.x too."""
    name = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", None)
    if name == "import_module" and node.args and isinstance(node.args[0], ast.Constant):
        return node.args[0].value if isinstance(node.args[0].value, str) else None
    return None


def imports_in(importer: str, source: str, filename: str, is_package: bool = False) -> list[Import]:
    """Every module of the package that ``source`` (module ``importer``) imports, wherever the import
    statement sits: top level, function body, ``if TYPE_CHECKING``."""
    found = []
    for node in ast.walk(ast.parse(source, filename=filename)):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = _resolve(importer, is_package, node)
            # ``from shardfuse import tracking`` imports the module shardfuse.tracking.
            targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in MODULES]
            targets = targets or [base]
        elif isinstance(node, ast.Call):
            targets = [target] if (target := _import_module_target(node)) else []
        for target in targets:
            if target in MODULES and target != importer:
                statement = " ".join((ast.get_source_segment(source, node) or ast.unparse(node)).split())
                found.append(Import(importer, target, f"{filename}:{node.lineno}", statement))
    return found


@functools.cache
def imports_of(importer: str) -> tuple[Import, ...]:
    path = MODULES[importer]
    return tuple(
        imports_in(importer, path.read_text(), str(path.relative_to(REPO)), path.name == "__init__.py")
    )


def describe(offenders: list[Import]) -> str:
    return "\n".join(
        f"  {imp.where}: {imp.importer} imports stage {imp.imported} ({imp.statement})" for imp in offenders
    )


def test_stage_modules_are_derived_from_main_blocks_and_workflow_commands():
    stages = stage_modules()
    missing = {f"{PACKAGE}.{name}" for name in KNOWN_STAGES} - stages
    assert not missing, f"stage detection lost {sorted(missing)}; is the `__main__` check still right?"
    unknown = stages - set(MODULES)
    assert not unknown, f"the workflow runs {sorted(unknown)}, which are not modules of {PACKAGE_DIR}"
    assert set(MODULES) - stages, "every module counts as a stage: the library side was not found"


def test_no_stage_module_imports_another_stage_module():
    stages = stage_modules()
    offenders = [imp for name in sorted(stages) for imp in imports_of(name) if imp.imported in stages]
    assert not offenders, (
        "a stage imports another stage; move what they share into a library module:\n" + describe(offenders)
    )


def test_no_library_module_imports_a_stage_module():
    stages = stage_modules()
    libraries = sorted(set(MODULES) - stages)
    offenders = [imp for name in libraries for imp in imports_of(name) if imp.imported in stages]
    assert not offenders, (
        "a library module imports a stage; move what it needs into a library module:\n" + describe(offenders)
    )


def test_deferred_relative_and_dynamic_imports_are_seen():
    """The checks above would pass vacuously if the scan missed imports inside functions."""
    source = (
        "import importlib\n"
        "def f():\n"
        "    from . import partition\n"
        "    from .evaluate import evaluate\n"
        "    import shardfuse.merge\n"
        "    importlib.import_module('shardfuse.gather')\n"
    )
    seen = [imp.imported for imp in imports_in("shardfuse.probe", source, "probe.py")]
    assert seen == ["shardfuse.partition", "shardfuse.evaluate", "shardfuse.merge", "shardfuse.gather"]


# Top-level modules that are not stages: the shared plumbing, and the loader named by MLflow models
# logged before the package layout. Every other library module lives in a package.
TOP_LEVEL_LIBRARIES = {f"{PACKAGE}.io", f"{PACKAGE}.mlflow_model"}


def test_libraries_live_in_packages_and_stages_at_the_top():
    stages = stage_modules()
    top_level = {
        name for name, path in MODULES.items() if name.count(".") == 1 and path.name != "__init__.py"
    }
    assert top_level - stages == TOP_LEVEL_LIBRARIES, "a library module belongs in a package (README: Layout)"
    nested_stages = {name for name in stages if name.count(".") > 1}
    assert not nested_stages, f"stages stay at the top level (python -m shardfuse.<stage>): {nested_stages}"
    packages = {name for name, path in MODULES.items() if path.name == "__init__.py" and name != PACKAGE}
    stage_names = {name.rpartition(".")[2] for name in stages}
    assert not {name.rpartition(".")[2] for name in packages} & stage_names, "a package is named like a stage"


def test_package_init_files_are_docstrings_only():
    """An import in an __init__.py runs for every module of the package (torch in a torch-free one)."""
    for name, path in MODULES.items():
        if path.name == "__init__.py" and name != PACKAGE:
            body = ast.parse(path.read_text()).body
            assert len(body) == 1 and isinstance(body[0], ast.Expr), f"{path}: keep it a docstring"


def test_no_import_cycle_between_modules():
    graph = {name: {imp.imported for imp in imports_of(name)} for name in MODULES}
    for name in MODULES:
        graph[name] = {target for target in graph[name] if MODULES[target].name != "__init__.py"}
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for target in sorted(graph[node]):
            if state.get(target) == 1:
                cycle = [*path[path.index(target) :], target] if target in path else [node, target]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if not state.get(target):
                visit(target, [*path, target])
        state[node] = 2

    for name in sorted(MODULES):
        if not state.get(name):
            visit(name, [name])


def test_the_workflow_imports_only_torch_free_modules():
    """The Snakefile imports these at every DAG build (a dry run too): torch would cost seconds each time."""
    imported = sorted(
        {
            name
            for path in WORKFLOW_FILES
            for name in re.findall(r"from (shardfuse[\w.]*) import", path.read_text())
        }
    )
    assert "shardfuse.data.provenance" in imported and "shardfuse.experiment.load" in imported
    probe = (
        f"import sys\nfor name in {imported!r}: __import__(name)\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] == 'torch'))"
    )
    proc = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]", f"the workflow's imports pull in torch: {proc.stdout[:300]}"


def package_of(module: str) -> str | None:
    """``shardfuse.data.sources.tables`` -> ``data``; stages and the top-level libraries belong to none."""
    parts = module.split(".")
    return parts[1] if len(parts) > 2 else None


def package_graph() -> dict[tuple[str, str], list[Import]]:
    """Every import from one package into another, by (importer's package, imported's package)."""
    edges: dict[tuple[str, str], list[Import]] = {}
    for name in MODULES:
        for imp in imports_of(name):
            pair = (package_of(imp.importer), package_of(imp.imported))
            if None not in pair and pair[0] != pair[1]:
                edges.setdefault(pair, []).append(imp)
    return edges


def package_cycle(edges: dict[tuple[str, str], list[Import]]) -> list[str] | None:
    graph: dict[str, set[str]] = {}
    for importer, imported in edges:
        graph.setdefault(importer, set()).add(imported)
    state: dict[str, int] = {}

    def visit(node: str, path: list[str]) -> list[str] | None:
        state[node] = 1
        for target in sorted(graph.get(node, ())):
            if state.get(target) == 1:
                return [*path[path.index(target) :], target]
            if not state.get(target) and (cycle := visit(target, [*path, target])):
                return cycle
        state[node] = 2
        return None

    for name in sorted(graph):
        if not state.get(name) and (cycle := visit(name, [name])):
            return cycle
    return None


def test_no_import_loop_between_packages():
    """The packages form layers (README: Layout): a loop between two of them means neither can be read,
    tested or replaced without the other, even where no two modules import each other."""
    edges = package_graph()
    cycle = package_cycle(edges)
    if cycle:
        steps = [
            f"  {a} -> {b}: " + "; ".join(imp.where for imp in edges[(a, b)][:3])
            for a, b in itertools.pairwise(cycle)
        ]
        raise AssertionError("import loop between packages " + " -> ".join(cycle) + ":\n" + "\n".join(steps))


def test_a_package_loop_is_found():
    """The check above would pass vacuously if the scan missed one."""
    imp = Import("shardfuse.a.x", "shardfuse.b.y", "x.py:1", "import shardfuse.b.y")
    back = Import("shardfuse.b.y", "shardfuse.a.z", "y.py:1", "import shardfuse.a.z")
    assert package_cycle({("a", "b"): [imp], ("b", "a"): [back]}) == ["a", "b", "a"]
    assert package_cycle({("a", "b"): [imp]}) is None
