"""The files a dataset source reads, listed from its spec alone: each source's record names its lister
(:mod:`shardfuse.data.sources.registry`), and :func:`shardfuse.data.provenance.dataset_files` makes them the
prepare rule's inputs. Standard library only: the Snakefile lists them at every DAG build. By hand::

    python -c "from shardfuse.data.sources.files import matching_text_files
    print(len(matching_text_files({'paths': ['{stdlib}/json/*.py']})))"
"""

from __future__ import annotations

import fnmatch
import glob
import os
import sysconfig
from pathlib import Path

from shardfuse.data.sources.hf_tokenizer import CONFIG_FILE, TEMPLATE_FILE
from shardfuse.data.sources.hf_tokenizer import PREFIX as HF_PREFIX

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")  # what the image_folder source reads (case-insensitive)


def expand_stdlib(pattern: str) -> str:
    """``{stdlib}`` stands for the Python standard library's directory (a corpus every machine has)."""
    return pattern.replace("{stdlib}", glob.escape(sysconfig.get_paths()["stdlib"]))


def once_each(paths: list[str]) -> list[str]:
    """``paths`` sorted, each file once: a path that reaches a file already listed through another (a
    symbolic link such as ``latest -> v2``, a folder linked twice) is left out, the first in sorted
    order kept. Without links this is ``sorted(paths)``."""
    seen: set[str] = set()
    kept = []
    for path in sorted(paths):
        real = os.path.realpath(path)
        if real not in seen:
            seen.add(real)
            kept.append(path)
    return kept


def matching_text_files(spec: dict) -> list[str]:
    """The files a text spec's ``paths`` globs match, less those an ``exclude`` pattern matches (against
    the path as globbed or its absolute form), each once (by absolute path, and by real path: a file
    reached through a link twice is read once), sorted by absolute path; maybe none."""
    exclude = [expand_stdlib(pattern) for pattern in spec.get("exclude") or []]
    found: dict[str, str] = {}
    for pattern in spec["paths"]:
        for path in glob.glob(expand_stdlib(pattern), recursive=True):
            full = os.path.abspath(path)
            excluded = any(fnmatch.fnmatch(p, x) for p in (path, full) for x in exclude)
            if not excluded and os.path.isfile(path):
                found[full] = path
    return [found[full] for full in once_each(list(found))]


def image_files(root: str) -> list[str]:
    """Every image file under ``root``, at any depth, through linked folders too (each real folder
    walked once, so a link loop ends), each file once (:func:`once_each`); hidden files and folders left
    out, as the source leaves them out; sorted."""
    found = []
    walked: set[str] = set()
    for folder, subfolders, names in os.walk(root, followlinks=True):
        walked.add(os.path.realpath(folder))
        subfolders[:] = [
            name
            for name in subfolders
            if not name.startswith(".") and os.path.realpath(os.path.join(folder, name)) not in walked
        ]
        found += [
            os.path.join(folder, name)
            for name in names
            if not name.startswith(".")
            and name.lower().endswith(IMAGE_SUFFIXES)
            and os.path.isfile(os.path.join(folder, name))  # as the source reads: no FIFO, no socket
        ]
    return once_each(found)


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


def chat_template_files(spec: dict) -> list[str]:
    """A chat spec's (``messages_field``) template files: ``hf:DIR``'s chat_template.jinja and
    tokenizer_config.json, those that exist (the template and its bos and eos tokens shape the tokens)."""
    ref = spec.get("tokenizer")
    if not spec.get("messages_field") or not (isinstance(ref, str) and ref.startswith(HF_PREFIX)):
        return []
    folder = Path(ref[len(HF_PREFIX) :])
    return [str(folder / name) for name in (TEMPLATE_FILE, CONFIG_FILE) if (folder / name).is_file()]


# ---------------------------------------------------------------- the listers the records name


def no_files(spec: dict) -> list[str]:
    """A built-in or generated source reads no file."""
    return []


def path_file(spec: dict) -> list[str]:
    """A single file, named by the spec's ``path`` (listed as given: a missing one is Snakemake's
    error before any job)."""
    return [spec["path"]]


def image_folder_files(spec: dict) -> list[str]:
    """The folder (its mtime sees a class folder added or removed) and every image in it."""
    return [spec["path"], *image_files(spec["path"])]


def hf_disk_files(spec: dict) -> list[str]:
    """The datasets folder of the spec's split: its Arrow and JSON files (and the DatasetDict's own
    dataset_dict.json); the tokenizer's file for token blocks. Missing ones are the source's error."""
    root = Path(spec["path"])
    folder = root / spec["split"] if (root / "dataset_dict.json").is_file() and spec.get("split") else root
    found = [str(root / "dataset_dict.json")] if folder != root else []
    if folder.is_dir():
        found += sorted(
            str(path) for path in folder.iterdir() if path.suffix in (".arrow", ".json") and path.is_file()
        )
    return [*found, *tokenizer_files(spec.get("tokenizer")), *chat_template_files(spec)] or [spec["path"]]


def domain_part_files(spec: dict) -> list[str]:
    """The parts' prepared split files and dataset.json (their prepare jobs' outputs: the workflow
    chains them before this dataset's)."""
    parts = spec.get("parts") if isinstance(spec.get("parts"), list) else []
    names = ("train.parquet", "val.parquet", "test.parquet", "dataset.json")
    return [f"results/datasets/{part}/{name}" for part in parts for name in names]


def text_files_of(spec: dict) -> list[str]:
    """The text files the globs match and the tokenizer's files."""
    return [*matching_text_files(spec), *tokenizer_files(spec.get("tokenizer")), *chat_template_files(spec)]
