"""User model code: import a model factory by its path, and fingerprint the files it comes from.

No torch here (the Snakefile imports it to check model references before any job starts; importing the
user's own module may of course import torch). A library module, e.g.::

    python -c "from shardfuse.models import usercode; \\
        print(usercode.code_fingerprint('nets:build', ['workflow/models']))"

A model reference is a built-in name (``mlp``) or ``package.module:function``. ``code_paths`` are
directories (relative to the working directory) put in front of ``sys.path`` in every process that
builds the model, so the same files are imported locally and inside SLURM jobs. The fingerprint is the
sha256 of the files the model runs — the factory's module and every module of the code paths it
imports, transitively (the whole package when the factory comes from an installed one) — and of the
files it is built from (``model_files``, a pretrained folder): the training name and every checkpoint
carry it, so editing a user model re-trains instead of silently mixing networks, an unrelated file
beside it changes nothing, and a later stage finds the changed file by name.
:func:`stage_code` copies that code for a logged MLflow model.
"""

from __future__ import annotations

import ast
import hashlib
import importlib
import importlib.metadata
import importlib.util
import json
import shutil
import sys
import sysconfig
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from shardfuse.io import UserError, sha256_file
from shardfuse.models.catalog import builtin, names

FIX_MODEL = "fix `model` in the run (a built-in name or package.module:function)"


def is_builtin(ref: str) -> bool:
    return builtin(ref) is not None


def add_code_paths(code_paths: list[str] | tuple[str, ...]) -> None:
    for entry in reversed(list(code_paths)):
        resolved = str(Path(entry).resolve())
        if resolved not in sys.path:
            sys.path.insert(0, resolved)


def _python_files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def _module_file(name: str, roots: list[Path]) -> Path | None:
    """The file of module ``name`` in the first code path that holds it (a package: its __init__.py)."""
    parts = name.split(".")
    for root in roots:
        base = root.joinpath(*parts)
        for candidate in (base.with_suffix(".py"), base / "__init__.py"):
            if candidate.is_file():
                return candidate
    return None


def _imports_of(path: Path, name: str) -> set[str]:
    """Every module name an import in ``path`` (module ``name``) may load: absolute imports, relative
    ones resolved, and ``from X import y`` both as X and X.y (y may be a submodule)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return set()
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 packages
                pieces = package.split(".") if package else []
                anchor = pieces[: max(0, len(pieces) - (node.level - 1))]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            if base:
                found.add(base)
            found.update(f"{base}.{alias.name}" if base else alias.name for alias in node.names)
    return found


def _import_closure(module: str, roots: list[Path]) -> list[Path]:
    """The files of ``module`` and of every module of the code paths it imports, transitively (with
    their parent packages' __init__.py): what a model runs, not every .py file beside it. Imports made
    by name at run time (importlib) are not seen: name such files in ``model_files``."""
    seen: dict[str, Path | None] = {}
    queue = [module]
    while queue:
        name = queue.pop()
        if name in seen:
            continue
        seen[name] = path = _module_file(name, roots)
        if path is None:
            continue
        parts = name.split(".")
        queue += [".".join(parts[:i]) for i in range(1, len(parts))]
        queue += sorted(_imports_of(path, name))
    return sorted({path for path in seen.values() if path is not None})


def _module_root(module_name: str) -> Path | None:
    """The file or top-level package directory a module comes from, found without importing it (only
    its parent packages are imported)."""
    try:
        found = importlib.util.find_spec(module_name)
    except (ImportError, ValueError):
        return None
    if found is None or found.origin in (None, "built-in", "frozen"):
        return None
    origin = Path(found.origin)
    top = module_name.split(".")[0]
    for parent in origin.parents:  # a change anywhere in the package counts
        if parent.name == top and (parent / "__init__.py").is_file():
            return parent
    return origin


def _display(path: Path) -> str:
    """A path relative to the working directory where possible (stable across checkouts)."""
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path.resolve())


def check_reference(ref: str) -> None:
    if is_builtin(ref):
        return
    module_name, sep, attribute = ref.partition(":")
    if not sep or not module_name or not attribute:
        raise UserError(
            f"model {ref!r} is neither a built-in ({', '.join(names())}) nor an import path "
            f"package.module:function; {FIX_MODEL}"
        )


def model_files_of(
    ref: str, model_args: dict[str, Any], model_files: list[str] | tuple[str, ...]
) -> list[str]:
    """The files a model is built from besides code: the run's ``model_files`` and a built-in's pretrained
    folder (hf's ``model_args.pretrained``: its record's ``pretrained_arg``)."""
    files = list(model_files)
    record = builtin(ref)
    key = record.pretrained_arg if record is not None else None
    pretrained = model_args.get(key) if key is not None and isinstance(model_args, dict) else None
    if pretrained is not None and str(pretrained) not in files:
        files.append(str(pretrained))
    return files


def _data_files(entries: list[str] | tuple[str, ...]) -> list[Path]:
    """Every file under the model files (a folder: all its files, hidden ones and caches left out)."""
    found: list[Path] = []
    for entry in entries:
        path = Path(entry)
        if path.is_file():
            found.append(path)
        elif path.is_dir():
            found += sorted(
                p
                for p in path.rglob("*")
                if p.is_file() and not any(part.startswith(".") or part == "__pycache__" for part in p.parts)
            )
        else:
            raise UserError(
                f"model file {entry!r} does not exist; fix `model_files` or model_args.pretrained (paths "
                "relative to the working directory)"
            )
    return found


def code_fingerprint(
    ref: str, code_paths: list[str] | tuple[str, ...], model_files: list[str] | tuple[str, ...] = ()
) -> dict[str, Any] | None:
    """{"paths", "files": {path: sha256}, "digest"} of the code a model may run and the files it is
    built from ("model_files", recorded only when there are some); None for a built-in without either."""
    check_reference(ref)
    if is_builtin(ref) and not code_paths and not model_files:
        return None
    for entry in code_paths:
        if not Path(entry).is_dir():
            raise UserError(
                f"code path {entry!r} is not a directory; fix `code_paths` (directories relative to the "
                "working directory)"
            )
    add_code_paths(code_paths)
    paths = [Path(entry) for entry in code_paths]
    hashed: list[Path] = []
    if is_builtin(ref):  # no module to start from: everything the code paths hold
        hashed = [path for root in paths for path in _python_files(root)]
    else:
        module = ref.partition(":")[0]
        if _module_file(module, paths) is not None:
            hashed = _import_closure(module, paths)
        else:  # an installed or sys.path package: all of it
            module_root = _module_root(module)
            if module_root is not None:
                hashed = _python_files(module_root)
    files: dict[str, str] = {}
    for path in hashed:
        files[_display(path)] = hashlib.sha256(path.read_bytes()).hexdigest()
    for path in _data_files(model_files):
        files[_display(path)] = sha256_file(path)
    digest = hashlib.sha256(json.dumps(files, sort_keys=True).encode()).hexdigest()
    fingerprint = {"paths": list(code_paths), "files": files, "digest": digest}
    if model_files:
        fingerprint["model_files"] = list(model_files)
    return fingerprint


def check_code_unchanged(ref: str, code: dict[str, Any] | None, stage: str) -> None:
    """UserError naming the first user code file that changed (or vanished) since training."""
    if not code:
        return
    now = code_fingerprint(ref, code["paths"], code.get("model_files", ()))
    current = now["files"] if now else {}
    for name, digest in sorted(code["files"].items()):
        if current.get(name) != digest:
            state = "is missing" if name not in current else "changed"
            raise UserError(
                f"user model code {name} {state} since training (sha256 {digest[:12]}); {stage} would "
                "rebuild another network from it — restore the file, or re-train (snakemake -R train)"
            )


def load_factory(ref: str, code_paths: list[str] | tuple[str, ...] = ()) -> Callable[..., Any]:
    """The callable a (non-built-in) model reference names; UserError if it does not import or is not
    callable."""
    check_reference(ref)
    module_name, _, attribute = ref.partition(":")
    add_code_paths(code_paths)
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:  # any error while importing user code is the user's to fix
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise UserError(
            f"model {ref!r}: module {module_name!r} does not import ({reason}); add its directory to "
            "`code_paths` or install the package"
        ) from None
    factory = getattr(module, attribute, None)
    if factory is None or not callable(factory):
        raise UserError(
            f"model {ref!r}: module {module_name} has no callable {attribute!r}; name a function that "
            "returns an nn.Module"
        )
    return factory


# ---------------------------------------------------------------- staging (for the logged MLflow model)


def _imported_modules(path: Path) -> set[str]:
    """Top-level names of the absolute imports in a .py file (an unparsable file imports nothing here:
    training would have failed on it)."""
    try:
        tree = ast.parse(path.read_bytes())
    except (SyntaxError, ValueError):
        return set()
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_requirements(staged: list[Path], local: Collection[str]) -> list[str]:
    """The installed distributions the staged user code imports (transformers, peft, timm, ...), so a
    fresh environment made from the logged model's requirements can import it: neither the standard
    library, nor shardfuse, nor the user's own staged modules."""
    modules = set()
    for root in staged:
        for path in _python_files(root):
            modules |= _imported_modules(path)
    modules -= {*sys.stdlib_module_names, *local, "shardfuse", "__future__"}
    if not modules:
        return []
    distributions = importlib.metadata.packages_distributions()
    found: list[str] = []
    for module in sorted(modules):
        for name in distributions.get(module, [])[:1]:
            if name not in found:
                found.append(name)
    return found


def _not_python(directory: str, names: list[str]) -> set[str]:
    """copytree's ignore: all but .py files and the directories that may hold them."""
    keep = {n for n in names if n.endswith(".py") or Path(directory, n).is_dir()}
    return {n for n in names if n not in keep or n.startswith(".") or n == "__pycache__"}


def _stage(source: Path, staging: Path) -> Path:
    target = staging / source.name
    if source.is_dir():
        shutil.copytree(source, target, ignore=_not_python)
    else:
        shutil.copy2(source, target)
    return target


def _installed(origin: Path) -> bool:
    roots = {Path(sysconfig.get_paths()[key]).resolve() for key in ("purelib", "platlib")}
    return any(root in origin.resolve().parents for root in roots)


def _origin(ref: str, top: str) -> Path:
    """Where top-level module ``top`` comes from (finding it imports nothing)."""
    found = importlib.util.find_spec(top)
    if found is not None and found.origin and found.origin not in ("built-in", "frozen"):
        return Path(found.origin)
    if found is not None and found.submodule_search_locations:  # a namespace package
        return Path(next(iter(found.submodule_search_locations)), "__init__.py")
    raise UserError(
        f"model {ref!r}: module {top!r} is neither in the run's code paths nor importable here, so the "
        "logged model could not import it; add its directory to `code_paths`"
    )


def stage_code(
    spec: dict[str, Any], staging: Path, reserved: Collection[str] = ()
) -> tuple[list[str], list[str]]:
    """(paths, extra requirements): copies of a user model's code in ``staging``, for MLflow's code_paths.

    MLflow copies each entry into ``code/`` under its own name and puts ``code/`` on sys.path, so a
    code path ``X/models`` itself would import as ``models.*``: the entries are the modules and packages
    *inside* each code path (their .py files), and the first code path holding a name wins, as on the
    sys.path training used. A factory module outside the code paths is copied too, unless it is an
    installed distribution: that one is pinned instead. Names in ``reserved`` (staged by the caller)
    are never copied. A built-in model without code paths stages nothing."""
    code = spec.get("code")
    if not code:
        return [], []
    # Only the trained code may go into the model (a user package's __init__ is imported to find it).
    check_code_unchanged(spec["model"], code, "the logged model")
    staging.mkdir(parents=True, exist_ok=True)
    taken, staged = set(reserved), []
    for entry in code["paths"]:
        for source in sorted(Path(entry).iterdir()):
            is_code = source.suffix == ".py" if source.is_file() else any(source.rglob("*.py"))
            name = source.stem if source.is_file() else source.name
            if is_code and not name.startswith(".") and name not in taken:
                taken.add(name)
                staged.append(_stage(source, staging))
    extra = third_party_requirements([Path(p) for p in staged], taken)
    if is_builtin(spec["model"]):  # code paths of a built-in (model hf with model_files): nothing to find
        return [str(path) for path in staged], extra
    top = spec["model"].partition(":")[0].split(".")[0]
    if top not in taken:
        origin = _origin(spec["model"], top)
        if _installed(origin):
            extra += [
                d for d in importlib.metadata.packages_distributions().get(top, [])[:1] if d not in extra
            ]
        else:
            staged.append(_stage(origin.parent if origin.name == "__init__.py" else origin, staging))
    return [str(path) for path in staged], extra
