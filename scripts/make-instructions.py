#!/usr/bin/env python3
"""Make instruction pairs locally from the Python standard library, one JSON Lines file per package.

Each public function and method of a package's modules with a docstring and a signature becomes one
record: the prompt is its signature as a ``def`` line, the completion the first paragraph of its
docstring (the "write the docstring for this function" task of code-instruction sets). Each package is
a domain: its own vocabulary of concepts and its own docstring style. Nothing is downloaded::

    python scripts/make-instructions.py data/instructions      # asyncio, logging, unittest
    python scripts/make-instructions.py data/instructions --packages email http

writes ``data/instructions/<package>.jsonl`` ({"prompt": ..., "completion": ...} per line), what
config/examples/domains.yaml reads with ``source: jsonl`` (``prompt_field`` / ``completion_field``:
the loss counts the completion's tokens only). The records are sorted by qualified name, so the files
are the same on every run with one Python version. Private modules and names (``_x``) and test
packages are left out; a module that cannot be imported here (a platform's own) is skipped.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import json
import os
import pkgutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path

DEFAULT_PACKAGES = ("asyncio", "logging", "unittest")


def module_names(package: str) -> list[str]:
    """The package and its public submodules, sorted."""
    module = importlib.import_module(package)
    names = [package]
    if hasattr(module, "__path__"):
        names += [info.name for info in pkgutil.walk_packages(module.__path__, f"{package}.")]
    private = ("test", "tests", "__main__")
    return sorted(
        name
        for name in names
        if not any(part.startswith("_") or part in private for part in name.split(".")[1:])
    )


def documented(module_name: str) -> Iterator[tuple[str, object]]:
    """(qualified name, function) of the module's own public functions and its classes' methods."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            module = importlib.import_module(module_name)
    except Exception:  # a module of another platform (e.g. asyncio.windows_events)
        return
    for name, value in vars(module).items():
        if name.startswith("_") or getattr(value, "__module__", None) != module_name:
            continue
        if inspect.isfunction(value):
            yield f"{module_name}.{name}", value
        elif inspect.isclass(value):
            for method_name, method in vars(value).items():
                if not method_name.startswith("_") and inspect.isfunction(method):
                    yield f"{module_name}.{name}.{method_name}", method


def pairs(package: str) -> list[dict[str, str]]:
    """The package's prompt/completion records, sorted by qualified name."""
    found = {}
    for module_name in module_names(package):
        for qualified, function in documented(module_name):
            doc = function.__doc__  # its own, not one inherited from a base class
            if not doc or qualified in found:
                continue
            try:
                signature = inspect.signature(function)
            except (TypeError, ValueError):
                continue
            completion = inspect.cleandoc(doc).split("\n\n")[0].strip()
            if completion:
                found[qualified] = {"prompt": f"def {qualified}{signature}:\n", "completion": completion}
    return [found[name] for name in sorted(found)]


def write_jsonl(path: Path, records: list[dict[str, str]]) -> None:
    """Write the records atomically (a temporary file beside ``path``, then a rename)."""
    handle, staged = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(handle, "w", encoding="utf-8") as file:
            for record in records:
                file.write(json.dumps(record, ensure_ascii=False) + "\n")
        os.replace(staged, path)
    except BaseException:
        os.unlink(staged)
        raise


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path, help="the folder to write <package>.jsonl into (created)")
    parser.add_argument("--packages", nargs="+", default=list(DEFAULT_PACKAGES))
    args = parser.parse_args()
    if args.out.exists() and not args.out.is_dir():
        sys.exit(f"make-instructions: error: {args.out} is not a folder; name a folder to write into")
    args.out.mkdir(parents=True, exist_ok=True)
    for package in args.packages:
        try:
            records = pairs(package)
        except ImportError:
            sys.exit(f"make-instructions: error: no standard-library package {package!r}; fix --packages")
        if not records:
            sys.exit(
                f"make-instructions: error: package {package!r} has no documented function; fix --packages"
            )
        write_jsonl(args.out / f"{package}.jsonl", records)
        print(f"wrote {args.out / f'{package}.jsonl'}: {len(records)} pairs")


if __name__ == "__main__":
    main()
