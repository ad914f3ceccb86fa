"""Shared plumbing: user-facing errors, atomic writes, JSON and text reading, checksums, command-line
arguments. The CLI error gate and the console's one-line error are in :mod:`shardfuse.console`.

Every stage writes through these helpers so an interrupted job never leaves a file (or directory)
that looks complete: content goes to a temporary sibling first and is renamed into place.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import hashlib
import json
import os
import re
import shutil
import socket
import tempfile
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NoReturn


class UserError(Exception):
    """A problem with the user's input (config, data, checkpoint, CLI args).

    The message is one line that names the problem and the fix; no traceback is shown.
    """

    exit_status = 2


class Interrupted(UserError):
    """The work stopped before its end on request (a signal, a job's time limit) and can go on from
    where it stopped: one line, exit status 75 (EX_TEMPFAIL: try again)."""

    exit_status = 75


def find_record(records: Iterable[Any], name: str, kind: str, fix: str = "") -> Any:
    """The record called ``name`` in a registry's ``RECORDS`` (every extension point is a table of
    records with a ``name``), or a one-line UserError listing the known names. Registries look their
    records up through this at call time, so a test can extend ``RECORDS`` and the whole stage sees it."""
    records = tuple(records)
    for record in records:
        if record.name == name:
            return record
    known = ", ".join(record.name for record in records)
    raise UserError(f"unknown {kind} {name!r}; use one of {known}{'; ' + fix if fix else ''}")


def error_reason(exc: BaseException) -> str:
    """First line of an exception's message (Arrow's can span many), for a one-line UserError."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _base36(number: int, width: int) -> str:
    digits = ""
    while number:
        number, digit = divmod(number, 36)
        digits = "0123456789abcdefghijklmnopqrstuvwxyz"[digit] + digits
    return digits.rjust(width, "0")[-width:]


def _owner_tag() -> str:
    """Eight characters (the length of mkstemp's random part, so the longest name a run may have stays
    what it was): this process's pid in base 36 (5) and a hash of its host (3). Which process a
    temporary sibling belongs to (:func:`sweep_leftovers`)."""
    return _base36(os.getpid(), 5) + _base36(zlib.crc32(socket.gethostname().encode()), 3)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError):  # another user's process: alive
        return True
    return True


def sweep_leftovers(path: Path) -> list[Path]:
    """Remove the temporary siblings of ``path`` (``.X.tmp-<tag>``, :func:`_owner_tag`) that a killed
    process of this host left behind: their pid no longer runs. Another host's and a live process's are
    kept. Returns what was removed."""
    removed = []
    host = _owner_tag()[5:]
    prefix = f".{path.name}.tmp-"
    try:
        siblings = [p for p in path.parent.iterdir() if p.name.startswith(prefix)]
    except OSError:
        return removed
    for sibling in siblings:
        tag = sibling.name[len(prefix) :]
        try:
            pid = int(tag[:5], 36)
        except ValueError:
            continue
        if len(tag) != 8 or tag[5:] != host or pid == os.getpid() or _alive(pid):
            continue
        if sibling.is_dir() and not sibling.is_symlink():
            shutil.rmtree(sibling, ignore_errors=True)
        else:
            with contextlib.suppress(OSError):
                sibling.unlink()
        removed.append(sibling)
    return removed


def _tmp_sibling(path: Path, *, directory: bool) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    sweep_leftovers(path)  # a killed earlier write of this output left no .tmp-* behind for long
    prefix = f".{path.name}.tmp-"
    # mkstemp/mkdtemp create owner-only entries; outputs get the usual umask-based modes instead,
    # so results stay readable by the group (shared project directories on clusters).
    tmp = path.parent / f"{prefix}{_owner_tag()}"
    try:  # named by its owner; a second one of this process at once gets a random name
        if directory:
            tmp.mkdir()
        else:
            os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        if directory:
            tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=path.parent))
        else:
            fd, name = tempfile.mkstemp(prefix=prefix, dir=path.parent)
            os.close(fd)
            tmp = Path(name)
    tmp.chmod((0o777 if directory else 0o666) & ~_umask())
    return tmp


def _raise_naming(exc: BaseException, path: Path) -> NoReturn:
    """Re-raise ``exc``; an OSError without a file name (a write or close that hit a full or failing disk
    names no file) as the same error naming ``path``, the output being written."""
    if isinstance(exc, OSError) and exc.filename is None and exc.errno in WRITE_ERRNOS:
        raise OSError(exc.errno, exc.strerror or os.strerror(exc.errno), str(path)) from exc
    raise exc


def staging_dir(path: str | os.PathLike) -> Path:
    """A fresh temporary directory beside ``path`` (``.X.tmp-<owner>``), for a caller that renames
    it into place itself; a killed earlier one of this host is swept first (:func:`sweep_leftovers`)."""
    return _tmp_sibling(Path(path), directory=True)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary file path next to ``path``; rename it onto ``path`` only on success."""
    path = Path(path)
    tmp = _tmp_sibling(path, directory=False)
    try:
        yield tmp
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        _raise_naming(exc, path)


@dataclass(frozen=True)
class OutputFolder:
    """A folder a stage writes whole and may replace: only when it is missing, empty, or was written by
    that stage before (its own record ``record`` in it, a JSON object holding ``key``; where the stage's
    output has no record of its own the stage writes one, ``mark``). Anything else is the user's: it is
    refused in one line and left untouched (every stage's ``--out*`` folder goes through this rule)."""

    stage: str  # "export": the stage command, as the error names it
    flag: str  # "--out": the flag that named the folder
    record: str  # the file that says a folder is this stage's output
    key: str  # a key of that record only this stage writes
    value: Any = None  # and its value, where the key alone is not specific
    mark: bool = False  # the stage's output has no record of its own: ``record`` is written as a marker

    def written_here(self, path: Path) -> bool:
        """True if ``path`` is a folder this stage wrote (its record parses and names it)."""
        try:
            record = json.loads((path / self.record).read_text())
        except (OSError, ValueError):
            return False
        if not isinstance(record, dict) or self.key not in record:
            return False
        return self.value is None or record[self.key] == self.value

    def check(self, path: str | os.PathLike) -> None:
        """One line, before any work, if replacing ``path`` would destroy what this stage did not write."""
        path = Path(path)
        if path.is_symlink() or (path.exists() and not path.is_dir()):
            raise UserError(
                f"{self.flag} {path} exists and is not a folder; nothing was changed: give a new or empty "
                "folder"
            )
        if path.is_dir() and any(path.iterdir()) and not self.written_here(path):
            raise UserError(
                f"{self.flag} {path} holds files that {self.stage} did not write (no {self.record} of its "
                "own in it); nothing was changed: remove them yourself or give a new or empty folder"
            )

    def claim(self, staged: Path) -> None:
        """Write the marker into a staged folder, where the stage's output has no record of its own."""
        if self.mark:
            write_json(staged / self.record, {self.key: self.value if self.value is not None else True})


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike, owner: OutputFolder) -> Iterator[Path]:
    """Yield a temporary directory next to ``path``; it replaces ``path`` only on success, and only if
    ``owner``'s rule lets it (``path`` missing, empty, or written by that stage)."""
    path = Path(path)
    owner.check(path)
    tmp = _tmp_sibling(path, directory=True)
    try:
        yield tmp
        owner.claim(tmp)
        replace_dir(tmp, path, owner)
    except BaseException as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        _raise_naming(exc, path)


def replace_dir(src: Path, dst: Path, owner: OutputFolder) -> None:
    """Move directory ``src`` onto ``dst``; an old ``dst`` (checked against ``owner``'s rule again, just
    before: never a folder its stage did not write) is moved aside first, then removed."""
    owner.check(dst)
    if dst.exists():
        old = _tmp_sibling(dst, directory=True)
        os.replace(dst, old / dst.name)
        os.replace(src, dst)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(src, dst)


def write_json(path: str | os.PathLike, obj: Any) -> None:
    """Atomically write ``obj`` as indented JSON."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(obj, indent=2, sort_keys=False) + "\n")


def not_utf8(path: str | os.PathLike, data: bytes, exc: UnicodeDecodeError) -> str:
    """What is wrong with a file that is not UTF-8: the byte, its line and column."""
    line = data.count(b"\n", 0, exc.start) + 1
    column = exc.start - (data.rfind(b"\n", 0, exc.start) + 1) + 1
    return f"{path} is not UTF-8 text (byte 0x{data[exc.start]:02x} at line {line}, column {column})"


def read_text(path: str | os.PathLike, fix: str) -> str:
    """A text file's content as UTF-8; a byte that is not is a UserError naming the file, the line and
    ``fix`` (what to do about it)."""
    data = Path(path).read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{not_utf8(path, data, exc)}; {fix}") from None


MAX_EXPANDED_VALUES = 1_000_000  # a YAML file's values once its aliases are written out


def yaml_values(root: Any) -> int:
    """How many values a composed YAML document (``yaml.compose``) writes out to once each alias
    (``*name`` of an ``&name`` anchor) is replaced by what it names: a "billion laughs" (nine aliases of
    nine aliases of ...) is a few lines that write out to billions. Counted over the node graph, each node
    once, so counting costs the file's size, not the written-out size."""
    import yaml

    def children(node: Any) -> list[Any]:
        if isinstance(node, yaml.SequenceNode):
            return list(node.value)
        if isinstance(node, yaml.MappingNode):
            return [child for pair in node.value for child in pair]
        return []

    sizes: dict[int, int] = {}
    order: list[Any] = []
    stack: list[tuple[Any, bool]] = [(root, False)]
    while stack:  # children before parents, each node once (aliases share nodes)
        node, done = stack.pop()
        if done:
            order.append(node)
            continue
        if id(node) in sizes:
            continue
        sizes[id(node)] = 0
        stack.append((node, True))
        stack.extend((child, False) for child in children(node))
    for node in order:
        sizes[id(node)] = 1 + sum(sizes[id(child)] for child in children(node))
    return sizes[id(root)]


CONTENT_NAME = re.compile(r"[0-9a-f]{16}\.json")  # a file named by its content (content_name)


def content_name(obj: Any) -> str:
    """``<16 hex>.json``: the name of a JSON file the workflow writes named by its content (the first
    16 hex digits of the sha256 of its compact, key-sorted JSON), so a changed content is a new name."""
    text = json.dumps(obj, sort_keys=True, separators=(",", ":"))
    return f"{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def check_content_name(path: str | os.PathLike, obj: Any, what: str) -> None:
    """A file named by its content (:func:`content_name`) must still hold it: one edited by hand would be
    trusted as the workflow's. Other names are not checked."""
    path = Path(path)
    if CONTENT_NAME.fullmatch(path.name) and content_name(obj) != path.name:
        raise UserError(
            f"{what} {path} is not what the workflow wrote (its name is the digest of its content, and "
            "the content has changed since); delete it and re-run: the workflow writes it again"
        )


def read_json(path: str | os.PathLike, what: str = "file") -> Any:
    path = Path(path)
    if not path.is_file():
        raise UserError(f"{what} {path} does not exist; run the stage that produces it first")
    rerun = "delete it and re-run the stage that produces it"
    if path.suffix != ".json":  # not a record a stage writes (/etc/passwd): never advise deleting it
        rerun = f"it is no record a stage writes: pass the {what} file (a .json) the stage wrote"
    try:
        return json.loads(read_text(path, rerun))
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{what} {path} is not valid JSON ({exc.msg} at line {exc.lineno}); {rerun}"
        ) from None


# Each field's JSON kinds, by the outer type of its annotation (``int | None`` -> int); a float field
# takes an integer (JSON writes 1.0 as 1 in some tools), no field takes a boolean for a number.
KINDS: dict[str, tuple[type, ...]] = {
    "str": (str,),
    "int": (int,),
    "float": (int, float),
    "bool": (bool,),
    "dict": (dict,),
    "list": (list,),
}


def wrong_type(value: Any, annotation: Any) -> str | None:
    """How ``value`` fails the field's annotation (a string: ``dict[str, float] | None``), or None. A
    ``dict[str, float]`` must map to numbers too: the readers do arithmetic on them."""
    text = str(annotation)
    outer = text.split("|")[0].strip()
    kinds = KINDS.get(outer.split("[")[0])
    if value is None or kinds is None:
        return None
    if (isinstance(value, bool) and bool not in kinds) or not isinstance(value, kinds):
        return f"{json_kind(value)} {_short(value)}, not {outer.split('[')[0]}"
    if outer == "dict[str, float]":
        for key, item in value.items():
            if isinstance(item, bool) or not isinstance(item, (int, float)):
                return f"a mapping whose '{key}' is {json_kind(item)} {_short(item)}, not a number"
    return None


def json_kind(value: Any) -> str:
    """How JSON names the kind of ``value``: a string, a number, an object, ..."""
    names = {bool: "a boolean", str: "a string", int: "a number", float: "a number", dict: "an object"}
    return "null" if value is None else names.get(type(value), "a list")


def _short(value: Any) -> str:
    text = json.dumps(value)
    return text if len(text) <= 40 else text[:39] + "…"


def sha256_file(path: str | os.PathLike, chunk_size: int = 1 << 20) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk_size):
            digest.update(block)
    return digest.hexdigest()


# Checksums of checkpoints: sha256 (gather.json before format version 2, training's sidecars) and
# BLAKE3, several times faster on one core (bench/RESULTS.md, merge), which merge verifies.
HASH_ALGORITHMS = ("sha256", "blake3")


def new_hash(algorithm: str) -> Any:
    """A fresh hasher (``update``, ``hexdigest``) for one of HASH_ALGORITHMS. BLAKE3 runs on the
    calling thread (``max_threads=1``): callers hash in worker threads already, and both hashes
    release the GIL on large updates."""
    if algorithm == "sha256":
        return hashlib.sha256()
    if algorithm == "blake3":
        from blake3 import blake3  # deferred: only checkpoint checksums need it

        return blake3()
    raise ValueError(f"unknown hash algorithm {algorithm!r}; one of {', '.join(HASH_ALGORITHMS)}")


def file_digests(
    path: str | os.PathLike, algorithms: tuple[str, ...] = HASH_ALGORITHMS, chunk_size: int = 4 << 20
) -> dict[str, str]:
    """{algorithm: hex digest} of a file, every algorithm fed from one read of it."""
    digests = {algorithm: new_hash(algorithm) for algorithm in algorithms}
    buffer = bytearray(chunk_size)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as fh:
        while got := fh.readinto(buffer):
            for digest in digests.values():
                digest.update(view[:got])
    return {algorithm: digest.hexdigest() for algorithm, digest in digests.items()}


STAMPS_NAME = ".sha256-stamps.json"


def _stamp(path: Path) -> dict[str, int]:
    stat = path.stat()
    return {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def write_stamps(directory: str | os.PathLike, digests: dict[str, str]) -> None:
    """Record the sha256 of files in ``directory`` (name -> digest) with each file's size and mtime, in
    a hidden ``.sha256-stamps.json`` beside them (a cache, not an output: the stamps differ from run
    to run, the outputs do not)."""
    directory = Path(directory)
    write_json(
        directory / STAMPS_NAME,
        {name: {"sha256": digest, **_stamp(directory / name)} for name, digest in digests.items()},
    )


def recorded_sha256(path: str | os.PathLike) -> str | None:
    """The sha256 recorded for ``path`` by :func:`write_stamps`, while the file's size and mtime still
    match the record (the test make and rsync use); None when there is no such record or it is stale."""
    path = Path(path)
    try:
        record = json.loads((path.parent / STAMPS_NAME).read_text())[path.name]
        digest = record["sha256"]
        if {"bytes": record["bytes"], "mtime_ns": record["mtime_ns"]} == _stamp(path):
            return digest if isinstance(digest, str) and len(digest) == 64 else None
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def parse_json_arg(text: str, flag: str) -> Any:
    """Parse a JSON command-line argument, turning a syntax error into a one-line UserError."""
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"{flag} is not valid JSON ({exc.msg}); pass a JSON object, e.g. {flag} '{{\"key\": 1}}'"
        ) from None


# Seeds are 64-bit integers wherever they go (torch generators, JSON records, MLflow params).
MAX_SEED = 2**63 - 1


def seed_arg(text: str) -> int:
    """The argparse type of a seed flag: an integer from 0 to MAX_SEED (a bad one is StageParser's
    one-line error naming the flag)."""
    try:
        value = int(text)
    except ValueError:
        value = -1
    if not 0 <= value <= MAX_SEED:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not a seed; use an integer from 0 to {MAX_SEED} (seeds are 64-bit integers)"
        )
    return value


def refuse_shared_outputs(args: argparse.Namespace, *flags: str) -> None:
    """Two output flags of one stage naming one file: the later write would silently replace the
    earlier one, so it is refused before anything is read or written."""
    seen: dict[Path, str] = {}
    for flag in flags:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is None:
            continue
        path = Path(value).resolve()
        if path in seen:
            raise UserError(f"{seen[path]} and {flag} both name {value}; give each output its own path")
        seen[path] = flag


class StageParser(argparse.ArgumentParser):
    """argparse, but a bad flag is a one-line UserError (exit 2) like every other input error."""

    def error(self, message: str):  # type: ignore[override]
        raise UserError(f"{message}; see {self.prog} --help")


def destination(path: str | os.PathLike) -> Path:
    """The file a path stands for: a temporary sibling ``.X.tmp-abc`` (:func:`atomic_path`, or a
    directory of :func:`atomic_dir` on the way) is named as the ``X`` it was to become."""
    parts = [TMP_SIBLING.sub(r"\1", part) for part in Path(path).parts]
    return Path(*parts) if parts else Path(path)


TMP_SIBLING = re.compile(r"^\.(.+)\.tmp-[^/]+$")
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
NOT_WRITABLE = (errno.EROFS, errno.EACCES, errno.EPERM)
WRITE_ERRNOS = (*NO_SPACE, *NOT_WRITABLE, errno.EIO, errno.EFBIG)  # a disk's, not a socket's
