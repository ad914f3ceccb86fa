"""Every file a dataset is built from is an input of prepare (real Snakemake): editing, adding, removing
or replacing one under its old mtime plans prepare again, for that dataset only."""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from tests.support.helpers import snakemake

CHANGES = ("edit", "add", "remove", "replace", "same")


def write_png(path: Path, gray: int) -> None:
    from PIL import Image

    Image.new("L", (5, 7), gray).save(path)


def write_sources(root: Path) -> dict[str, dict]:
    """A text corpus and an image folder per kind of change, and the config's datasets over them."""
    datasets = {}
    for change in CHANGES:
        corpus = root / f"corpus_{change}"
        corpus.mkdir()
        for index in range(3):
            (corpus / f"{index}.txt").write_text(f"file {index}: the quick brown fox jumps over the dog\n")
        datasets[f"text_{change}"] = {"source": "text", "paths": [f"corpus_{change}/*.txt"], "block_size": 8}
        images = root / f"images_{change}"
        for label, gray in (("dark", 40), ("light", 210)):
            (images / label).mkdir(parents=True)
            for index in range(6):
                write_png(images / label / f"{index}.png", gray)
        datasets[f"images_{change}"] = {
            "source": "image_folder",
            "path": f"images_{change}",
            "image_size": [4, 4],
        }
    return datasets


def replace_keeping_mtime(path: Path, write) -> None:
    before = path.stat()
    write(path)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))


def planned_prepares(dry_run_stdout: str) -> dict[str, str]:
    """dataset -> the reason Snakemake gives for each prepare_dataset job of a dry run."""
    jobs = dry_run_stdout.split("rule prepare_dataset:")[1:]
    found = {}
    for job in jobs:
        dataset = re.search(r"wildcards: dataset=(\S+)", job).group(1)
        found[dataset] = re.search(r"reason: (.+)", job).group(1)
    return found


def test_editing_adding_removing_or_replacing_a_data_file_replans_prepare(tmp_path):
    datasets = write_sources(tmp_path)
    config = {
        "datasets": datasets,
        "runs": {"lm": {"strategy": "ddp", "merge_method": "consolidate"}},
        "run_defaults": {
            "dataset": "text_same",
            "world_size": 2,
            "model": "transformer",
            "model_args": {"width": 8, "layers": 1, "heads": 2},
        },
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "inputs"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    targets = [f"results/datasets/{name}/dataset.json" for name in datasets]
    snakemake(tmp_path, *targets)
    assert "Nothing to be done" in snakemake(tmp_path, "-n", *targets).stdout

    with (tmp_path / "corpus_edit/0.txt").open("a") as fh:
        fh.write("one more line\n")
    write_png(tmp_path / "images_edit/dark/0.png", 90)
    (tmp_path / "corpus_add/3.txt").write_text("a new file of the corpus\n")
    write_png(tmp_path / "images_add/dark/6.png", 40)
    (tmp_path / "corpus_remove/1.txt").unlink()
    (tmp_path / "images_remove/dark/1.png").unlink()
    # The text file keeps its size too: only its contents tell.
    replace_keeping_mtime(tmp_path / "corpus_replace/0.txt", lambda p: p.write_text(p.read_text()[::-1]))
    replace_keeping_mtime(tmp_path / "images_replace/dark/0.png", lambda p: write_png(p, 120))

    planned = planned_prepares(snakemake(tmp_path, "-n", *targets).stdout)
    changed = {f"{name}_{change}" for name in ("text", "images") for change in CHANGES if change != "same"}
    assert set(planned) == changed
    # mtimes cannot see a file replaced under its old mtime: the digest of the contents (a param) does.
    assert all(planned[f"{name}_replace"].startswith("Params have changed") for name in ("text", "images")), (
        planned
    )
