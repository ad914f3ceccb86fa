"""The order pytest-xdist hands test modules to its workers: the modules that train first.

xdist's own order (``--loadscope-reorder``) sorts modules by their number of tests, which puts a module
of few long tests (a workflow, a training killed and resumed) at the end, where one worker runs it while
the other has nothing left (11 s of the fast tier's 172 s). Here the scopes that train (a shared
training's group, tests/workflow, tests/slow) go first, then the rest by their number of tests, so the
short ones fill the end. Only the order changes: which tests run, and together on which worker, is as
before. (Ordering every module by the previous run's durations, longest first, was slower: 185 s
against 164 s, the two workers then ran trainings side by side on 2 cores instead of a training
beside short tests.)
"""

from __future__ import annotations

from collections import defaultdict

TRAINING_FOLDERS = ("tests/workflow/", "tests/slow/")


def order_items(items: list, scope_of, training_scopes: set[str]) -> None:
    """Reorder pytest's ``items`` in place: whole scopes, the training ones first, then by size; a
    scope's tests keep their order, and ties keep the collection's."""
    scopes: dict[str, list] = defaultdict(list)
    for item in items:
        scopes[scope_of(item.nodeid)].append(item)

    def rank(scope: str) -> tuple[bool, int]:
        trains = scope in training_scopes or scope.startswith(TRAINING_FOLDERS)
        return (not trains, -len(scopes[scope]))

    items[:] = [item for scope in sorted(scopes, key=rank) for item in scopes[scope]]
