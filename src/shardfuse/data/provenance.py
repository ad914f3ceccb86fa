"""The files a dataset is built from, and one digest of their contents: the prepare rule's inputs and a
param of it, so that editing, adding, removing or replacing a data file re-runs prepare (and what reads
its splits). Snakemake's mtime and input-set triggers see edits, new and deleted files; the digest also
sees a file replaced under an older mtime (``cp -p``, a restored backup), which mtimes alone miss.

No command line; a library module, torch-free and light (the sources' records, the standard library): the
Snakefile calls it at every DAG build. By hand::

    python -c "from shardfuse.data.provenance import dataset_files
    print(len(dataset_files({'source': 'text', 'paths': ['{stdlib}/*.py'], 'exclude': []})))"

Hashing hundreds of files at every DAG build would be slow, so digests are cached per file, keyed by its
stat signature (size, mtime_ns, ctime_ns, inode). ctime cannot be set from user space: a file whose
contents changed has a new ctime even when its size and mtime were put back, so a cache hit is the same
bytes. A signature younger than ``RACY_NS`` is not cached (git's "racy" rule: on a filesystem with coarse
timestamps, a second write in the same tick would keep the signature).
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path
from stat import S_ISBLK, S_ISCHR, S_ISFIFO, S_ISREG, S_ISSOCK

from shardfuse.data.sources.registry import find_source
from shardfuse.io import UserError, sha256_file

CACHE_VERSION = 1
RACY_NS = 2_000_000_000


# ---------------------------------------------------------------- the files of a dataset


def dataset_files(spec: dict) -> list[str]:
    """Every file the dataset ``spec`` is built from, as its source's record lists them ([] for the
    built-in and synthetic sources): shardfuse.data.sources.files."""
    return find_source(spec["source"]).files(spec)


# ---------------------------------------------------------------- the digest of their contents


def _read_cache(cache_path: Path) -> dict[str, list]:
    try:
        cached = json.loads(cache_path.read_text())
    except (OSError, ValueError):
        return {}
    if not isinstance(cached, dict) or cached.get("version") != CACHE_VERSION:
        return {}
    return cached.get("files") or {}


def _write_cache(cache_path: Path, files: dict[str, list]) -> None:
    """Atomically (a concurrent dry run reads the old cache or the new, never half of one); a cache that
    cannot be written only costs hashing again."""
    try:
        cache_path.parent.mkdir(parents=True, exist_ok=True)
        temporary = cache_path.with_name(f"{cache_path.name}.{os.getpid()}.tmp")
        temporary.write_text(json.dumps({"version": CACHE_VERSION, "files": files}, sort_keys=True))
        os.replace(temporary, cache_path)
    except OSError:
        pass


def files_digest(paths: list[str], cache_path: Path | None) -> str:
    """sha256 over the sorted (path, content sha256) pairs of ``paths`` (folders count by name only; an
    unreadable or vanished file as such: prepare reports it). ``cache_path`` holds the per-file digests
    of the last call and is rewritten with exactly this call's files when one was hashed (None: no cache,
    every file hashed)."""
    cached = _read_cache(cache_path) if cache_path is not None else {}
    kept: dict[str, list] = {}
    pairs = []
    now = time.time_ns()
    for path in sorted(set(paths)):
        try:
            stat = os.stat(path)
            if os.path.isdir(path):
                pairs.append((path, "folder"))
                continue
            if not S_ISREG(stat.st_mode):  # opening a FIFO would wait for a writer for ever
                raise UserError(
                    f"dataset file {path} is {_kind(stat.st_mode)}, not a regular file; shardfuse reads "
                    "regular files only: put the data in a file and point the dataset at it"
                )
            signature = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
            entry = cached.get(path)
            content = entry[-1] if entry is not None and entry[:-1] == signature else sha256_file(path)
            if now - max(stat.st_mtime_ns, stat.st_ctime_ns) > RACY_NS:
                kept[path] = [*signature, content]
        except OSError as exc:
            content = f"unreadable: {exc.strerror}"
        pairs.append((path, content))
    if cache_path is not None and kept != cached:
        _write_cache(cache_path, kept)
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()


def _kind(mode: int) -> str:
    for test, kind in ((S_ISFIFO, "a FIFO (named pipe)"), (S_ISSOCK, "a socket"), (S_ISCHR, "a device")):
        if test(mode):
            return kind
    return "a device" if S_ISBLK(mode) else "not a file"


def init_files_digest(path: str | os.PathLike, cache_path: Path | None = None) -> str:
    """One digest of the contents of the files init_from's weights are read from
    (:func:`shardfuse.checkpoints.init_weights.weight_files`): the workflow passes it to the train stage
    (``--init-sha256``), so weights replaced under an older mtime (``cp -p``) re-train, and launch checks
    the files are still those before any rank starts."""
    from shardfuse.checkpoints.init_weights import weight_files  # torch-free: headers only

    return files_digest([str(file) for file in weight_files(path).paths], cache_path)
