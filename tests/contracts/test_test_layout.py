"""The test suite's own layout: tiers are folders, every test module sits in one, helpers live in
tests/support/ (no test module imports another), and the Makefile's tiers run every folder once."""

from __future__ import annotations

import ast
import re

from tests.support.helpers import REPO

TESTS = REPO / "tests"
TIERS = {"unit", "contracts", "stages", "workflow", "slow", "services"}


def module_paths() -> list:
    return sorted(TESTS.rglob("test_*.py"))


def test_every_test_module_lives_in_a_tier_folder():
    outside = [
        str(p.relative_to(TESTS)) for p in module_paths() if p.relative_to(TESTS).parts[0] not in TIERS
    ]
    assert outside == []
    assert {p.name for p in TESTS.iterdir() if p.is_dir() and not p.name.startswith(("_", "."))} == TIERS | {
        "support"
    }


def test_no_test_module_imports_another_or_the_conftest():
    offenders = []
    for path in sorted(TESTS.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module:
                names = [node.module, *(f"{node.module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            offenders += [
                f"{path.relative_to(TESTS)}: {name}"
                for name in names
                if name.startswith("tests.") and re.search(r"\.(test_\w+|conftest)$", name)
            ]
    assert offenders == []


def test_the_makefile_tiers_run_every_tier_folder_exactly_once():
    makefile = (REPO / "Makefile").read_text()
    folders = []
    for variable in ("FAST_TESTS", "SLOW_TESTS", "SERVICE_TESTS"):
        (value,) = re.findall(rf"^{variable} := (.+)$", makefile, flags=re.MULTILINE)
        folders += value.split()
    assert sorted(folders) == sorted(f"tests/{tier}" for tier in TIERS)


def test_tier_markers_are_gone_and_every_marker_is_declared():
    pyproject = (REPO / "pyproject.toml").read_text()
    declared = set(re.findall(r'^    "(\w+):', pyproject, flags=re.MULTILINE))
    used = set()
    for path in module_paths():
        used |= set(re.findall(r"pytest\.mark\.(\w+)", path.read_text()))
    builtin = {"parametrize", "timeout", "skipif", "xfail", "filterwarnings", "usefixtures"}
    assert used - builtin <= declared
    assert not {"integration", "slow"} & (declared | used)


def test_xdist_gets_the_modules_that_train_first_then_the_largest():
    from types import SimpleNamespace

    from tests.support.schedule import order_items

    ids = ["tests/unit/a.py::t1", "tests/unit/a.py::t2", "tests/unit/a.py::t3", "tests/stages/s.py::t"]
    ids += ["tests/workflow/w.py::t", "tests/stages/b.py::t", "tests/stages/c.py::t"]
    shared = {"tests/stages/b.py": "group", "tests/stages/c.py": "group"}
    items = [SimpleNamespace(nodeid=i) for i in ids]
    order_items(items, lambda n: shared.get(n.split("::")[0], n.split("::")[0]), {"group"})
    # The training scopes (a shared training's group, tests/workflow) first, then by number of tests;
    # a scope's tests stay together and in order.
    assert [item.nodeid for item in items] == [ids[5], ids[6], ids[4], *ids[:3], ids[3]]
