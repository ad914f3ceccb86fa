"""The files a dataset is built from, and one digest of their contents: the prepare rule's inputs and a
param of it, so that editing, adding, removing or replacing a data file re-runs prepare (and what reads
its splits). Snakemake's mtime and input-set triggers see edits, new and deleted files; the digest also
sees a file replaced under an older mtime (``cp -p``, a restored backup), which mtimes alone miss.

No command line; a library module, torch-free and standard-library only: the Snakefile calls it at every
DAG build. By hand::

    python -c "from shardfuse.data.provenance import dataset_files
    print(len(dataset_files({'source': 'text', 'paths': ['{stdlib}/*.py'], 'exclude': []})))"

Hashing hundreds of files at every DAG build would be slow, so digests are cached per file, keyed by its
stat signature (size, mtime_ns, ctime_ns, inode). ctime cannot be set from user space: a file whose
contents changed has a new ctime even when its size and mtime were put back, so a cache hit is the same
bytes. A signature younger than ``RACY_NS`` is not cached (git's "racy" rule: on a filesystem with coarse
timestamps, a second write in the same tick would keep the signature).
"""

from __future__ import annotations

import fnmatch
import glob
import hashlib
import json
import os
import sysconfig
import time
from pathlib import Path

from shardfuse.data.sources.hf_tokenizer import PREFIX as HF_PREFIX
from shardfuse.io import sha256_file

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")  # what the image_folder source reads (case-insensitive)
PATH_SOURCES = ("parquet", "csv", "npz")  # a single file, named by the spec's ``path``
CACHE_VERSION = 1
RACY_NS = 2_000_000_000


# ---------------------------------------------------------------- the files of a dataset


def expand_stdlib(pattern: str) -> str:
    """``{stdlib}`` stands for the Python standard library's directory (a corpus every machine has)."""
    return pattern.replace("{stdlib}", glob.escape(sysconfig.get_paths()["stdlib"]))


def matching_text_files(spec: dict) -> list[str]:
    """The files a text spec's ``paths`` globs match, less those an ``exclude`` pattern matches (against
    the path as globbed or its absolute form), each once, sorted by absolute path; maybe none."""
    exclude = [expand_stdlib(pattern) for pattern in spec.get("exclude") or []]
    found: dict[str, str] = {}
    for pattern in spec["paths"]:
        for path in glob.glob(expand_stdlib(pattern), recursive=True):
            full = os.path.abspath(path)
            excluded = any(fnmatch.fnmatch(p, x) for p in (path, full) for x in exclude)
            if not excluded and os.path.isfile(path):
                found[full] = path
    return [found[full] for full in sorted(found)]


def image_files(root: str) -> list[str]:
    """Every image file under ``root``, at any depth (hidden files and folders left out, as the source
    leaves them out), sorted."""
    found = []
    for folder, subfolders, names in os.walk(root):
        subfolders[:] = [name for name in subfolders if not name.startswith(".")]
        found += [
            os.path.join(folder, name)
            for name in names
            if not name.startswith(".") and name.lower().endswith(IMAGE_SUFFIXES)
        ]
    return sorted(found)


def tokenizer_files(ref: str | None) -> list[str]:
    """The files a text dataset's tokenizer is read from: ``hf:DIR``'s tokenizer.json, or the module
    file of ``package.module:function`` when it lies in the working directory (an installed tokenizer is
    software, not data). Only files that exist: prepare names a missing one in its own error."""
    if not isinstance(ref, str):
        return []
    if ref.startswith(HF_PREFIX):
        candidates = [Path(ref[len(HF_PREFIX) :]) / "tokenizer.json"]
    else:
        module = Path(*ref.partition(":")[0].split("."))
        candidates = [module.with_name(module.name + ".py"), module / "__init__.py"]
    return [str(path) for path in candidates if path.is_file()][:1]


def dataset_files(spec: dict) -> list[str]:
    """Every file the dataset ``spec`` is built from ([] for the built-in and synthetic sources). An
    image folder is listed too (its mtime sees a class folder added or removed); a missing ``path`` is
    listed as given, so Snakemake reports it before any job runs."""
    source = spec["source"]
    if source in PATH_SOURCES:
        return [spec["path"]]
    if source == "image_folder":
        return [spec["path"], *image_files(spec["path"])]
    if source == "text":
        return [*matching_text_files(spec), *tokenizer_files(spec.get("tokenizer"))]
    return []


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


def files_digest(paths: list[str], cache_path: Path) -> str:
    """sha256 over the sorted (path, content sha256) pairs of ``paths`` (folders count by name only; an
    unreadable or vanished file as such: prepare reports it). ``cache_path`` holds the per-file digests
    of the last call and is rewritten with exactly this call's files when one was hashed."""
    cached = _read_cache(cache_path)
    kept: dict[str, list] = {}
    pairs = []
    now = time.time_ns()
    for path in sorted(set(paths)):
        try:
            stat = os.stat(path)
            if os.path.isdir(path):
                pairs.append((path, "folder"))
                continue
            signature = [stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns, stat.st_ino]
            entry = cached.get(path)
            content = entry[-1] if entry is not None and entry[:-1] == signature else sha256_file(path)
            if now - max(stat.st_mtime_ns, stat.st_ctime_ns) > RACY_NS:
                kept[path] = [*signature, content]
        except OSError as exc:
            content = f"unreadable: {exc.strerror}"
        pairs.append((path, content))
    if kept != cached:
        _write_cache(cache_path, kept)
    return hashlib.sha256(json.dumps(pairs, separators=(",", ":")).encode()).hexdigest()
