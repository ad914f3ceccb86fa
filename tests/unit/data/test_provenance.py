"""The files a dataset is built from, and the cached digest of their contents (shardfuse.data.provenance)."""

from __future__ import annotations

import os
from pathlib import Path

from shardfuse.data import provenance
from shardfuse.data.provenance import dataset_files, files_digest


def test_a_cached_digest_is_reused_until_the_contents_change_even_under_the_old_size_and_mtime(
    tmp_path, monkeypatch
):
    monkeypatch.setattr(provenance, "RACY_NS", -1)  # cache every entry (these files are not seconds old)
    files = [str(tmp_path / name) for name in ("a.txt", "b.txt")]
    for path in files:
        Path(path).write_text(f"contents of {path}")
    cache = tmp_path / "cache.json"
    first = files_digest(files, cache)
    hashed, sha256 = [], provenance.sha256_file
    monkeypatch.setattr(provenance, "sha256_file", lambda path: hashed.append(path) or sha256(path))
    assert files_digest(files, cache) == first and hashed == []

    stat = os.stat(files[0])
    Path(files[0]).write_text(Path(files[0]).read_text().upper())  # same size, and the old mtime back
    os.utime(files[0], ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert files_digest(files, cache) != first and hashed == [files[0]]
    assert files_digest(files[1:], cache) != first  # a file less is another set


def test_dataset_files_are_the_images_the_text_globs_and_the_tokenizer_module(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    for name in (
        "images/a/1.png",
        "images/a/deep/2.JPG",
        "images/b/3.jpeg",
        "images/b/notes.txt",
        "images/.x/4.png",
    ):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_bytes(b"")
    assert dataset_files({"source": "image_folder", "path": "images"}) == [
        "images",
        "images/a/1.png",
        "images/a/deep/2.JPG",
        "images/b/3.jpeg",
    ]
    for name in ("corpus/x.txt", "corpus/skip.txt", "mytok.py", "hf/tokenizer.json"):
        Path(name).parent.mkdir(parents=True, exist_ok=True)
        Path(name).write_text("")
    text = {"source": "text", "paths": ["corpus/*.txt"], "exclude": ["*/skip.txt"]}
    assert dataset_files({**text, "tokenizer": "mytok:encode"}) == ["corpus/x.txt", "mytok.py"]
    assert dataset_files({**text, "tokenizer": "hf:hf"}) == ["corpus/x.txt", "hf/tokenizer.json"]
    assert dataset_files({**text, "tokenizer": "installed.pkg:encode"}) == ["corpus/x.txt"]
    assert dataset_files({"source": "csv", "path": "missing.csv"}) == ["missing.csv"]
    assert dataset_files({"source": "digits"}) == []


def test_a_fifo_among_the_files_is_one_line_and_never_opened(tmp_path):
    import pytest

    from shardfuse.io import UserError

    table = tmp_path / "rows.csv"
    os.mkfifo(table)  # opening it would wait for a writer for ever
    with pytest.raises(UserError) as refused:
        files_digest([str(table)], tmp_path / "cache.json")
    assert str(refused.value) == (
        f"dataset file {table} is a FIFO (named pipe), not a regular file; shardfuse reads regular files "
        "only: put the data in a file and point the dataset at it"
    )


def test_linked_image_folders_are_listed_each_file_once_and_a_link_loop_ends(tmp_path):
    from shardfuse.data.sources.files import image_files

    (tmp_path / "data" / "cat").mkdir(parents=True)
    (tmp_path / "data" / "cat" / "1.png").write_bytes(b"png")
    (tmp_path / "elsewhere" / "dog").mkdir(parents=True)
    (tmp_path / "elsewhere" / "dog" / "2.png").write_bytes(b"png")
    (tmp_path / "data" / "dog").symlink_to(tmp_path / "elsewhere" / "dog")  # a class folder linked in
    (tmp_path / "data" / "cat" / "again").symlink_to(tmp_path / "data")  # a loop
    os.mkfifo(tmp_path / "data" / "cat" / "pipe.png")  # no image: the source reads regular files only
    assert image_files(str(tmp_path / "data")) == [
        str(tmp_path / "data" / "cat" / "1.png"),
        str(tmp_path / "data" / "dog" / "2.png"),
    ]


def test_a_text_glob_through_a_link_reads_each_file_once(tmp_path):
    from shardfuse.data.sources.files import matching_text_files

    (tmp_path / "v2").mkdir()
    for name in ("a.py", "b.py"):
        (tmp_path / "v2" / name).write_text(f"# {name}\n")
    (tmp_path / "latest").symlink_to(tmp_path / "v2")
    files = matching_text_files({"paths": [f"{tmp_path}/**/*.py"]})
    assert files == [f"{tmp_path}/latest/a.py", f"{tmp_path}/latest/b.py"]  # not v2's copies again
