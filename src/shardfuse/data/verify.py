"""Check the data files a stage reads from another stage against the records that describe them, before
any work: a split against prepare's dataset.json (its rows and sha256), a shard set against that
dataset.json and the shards' own footers, one rank's shard against the manifest (its size and, when
asked, its sha256), and dataset.json's claims (num_classes, num_features) against the data where that is
cheap (the manifest's label counts, one Parquet footer).

A library module, torch-free (JSON and Parquet footers; merge imports it at start-up). The manifest's
own consistency (row counts adding up, no shard listed twice) is checked by
:func:`shardfuse.data.manifest.read_manifest`. dataset.json is found beside the split (prepare writes
both into one directory).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq

from shardfuse.data.manifest import RERUN_PARTITION
from shardfuse.data.shard_format import open_parquet, read_layout
from shardfuse.io import UserError, read_json, sha256_file

RERUN_PREPARE = "re-run the prepare stage (snakemake -R prepare_dataset)"
DATASET_INFO = "dataset.json"
SPLIT_NAMES = ("train", "val", "test")


def _short(digest: object) -> str:
    return f"{digest[:12]}…" if isinstance(digest, str) else repr(digest)


def _footer_rows(path: Path) -> int | None:
    """Rows of a Parquet file from its footer; None where it is not one."""
    try:
        return pq.read_metadata(path).num_rows
    except Exception:  # any unreadable file: the message then shows its sha256 only
        return None


def _split_digests(info: object) -> dict:
    """dataset.json's {split: sha256} (empty where the file records none)."""
    digests = info.get("sha256") if isinstance(info, dict) else None
    return digests if isinstance(digests, dict) else {}


def check_dataset_of(path: str | Path, split: str, train_sha256: str | None) -> None:
    """``path``'s dataset is the training's: the train split its dataset.json records has the sha256 the
    training's shards were cut from (gather.json's ``dataset_sha256``). A split of another prepared
    dataset (another seed or source) would score rows the ranks trained on. Nothing to check when the
    gather.json is older (``train_sha256`` None)."""
    if train_sha256 is None:
        return
    recorded = _split_digests(read_json(Path(path).parent / DATASET_INFO, "dataset info")).get("train")
    if recorded != train_sha256:
        raise UserError(
            f"{split} split {path} belongs to another prepared dataset: its {DATASET_INFO} records a train "
            f"split of sha256 {_short(recorded)}, but the training's shards were cut from "
            f"{_short(train_sha256)}; pass the {split}.parquet of the dataset the run trained on"
        )


def check_split(path: str | Path, split: str) -> None:
    """``path`` must be the dataset's ``split`` ("test", "val") exactly as prepare wrote it: the rows and
    sha256 that dataset.json beside it records for that split (one streamed sha256 of a small file)."""
    path = Path(path)
    info_path = path.parent / DATASET_INFO
    if not info_path.is_file():
        raise UserError(
            f"{split} split {path} has no {DATASET_INFO} beside it ({info_path}), so it cannot be checked "
            f"against what prepare wrote; pass the {split}.parquet of a prepared dataset "
            f"(results/datasets/<dataset>/{split}.parquet)"
        )
    info = read_json(info_path, "dataset info")
    digests = _split_digests(info)
    rows = info.get("rows") if isinstance(info, dict) else None
    recorded_digest = digests.get(split)
    recorded_rows = rows.get(split) if isinstance(rows, dict) else None
    if not isinstance(recorded_digest, str) or not isinstance(recorded_rows, int):
        raise UserError(
            f"dataset info {info_path} records no rows and sha256 for the {split} split; {RERUN_PREPARE}"
        )
    if not path.is_file():
        raise UserError(f"{split} split {path} does not exist; {RERUN_PREPARE}")
    digest = sha256_file(path)
    found_rows = _footer_rows(path)
    if digest == recorded_digest and found_rows == recorded_rows:
        return
    other = next((name for name in SPLIT_NAMES if name != split and digests.get(name) == digest), None)
    if other is not None:
        raise UserError(
            f"{path} is the dataset's {other} split (its sha256 is {DATASET_INFO}'s {other} entry), not the "
            f"{split} split; pass the {split}.parquet split"
        )
    has = f"{found_rows} rows and " if found_rows is not None else "no Parquet footer and "
    raise UserError(
        f"{split} split {path} has {has}sha256 {_short(digest)} but {info_path} records {recorded_rows} "
        f"rows and {_short(recorded_digest)} for the {split} split; {RERUN_PREPARE}"
    )


def check_shard_set(
    shard_dir: str | Path, manifest: dict[str, Any], dataset_dir: str | Path, info: dict[str, Any], rank: int
) -> None:
    """Before a rank builds anything: the (checked) manifest is a partition of this dataset's train split
    (its source's sha256 and rows are dataset.json's), rank's shard holds the rows the manifest says (its
    footer), and dataset.json's num_classes and num_features fit the data (its label_names, the
    manifest's label counts, the shard's columns). Each rank reads only its own shard's footer."""
    shard_dir = Path(shard_dir)
    manifest_path = shard_dir / "manifest.json"
    info_path = Path(dataset_dir) / DATASET_INFO
    source = manifest.get("source") if isinstance(manifest.get("source"), dict) else {}
    digests, rows = info.get("sha256"), info.get("rows")
    train_digest = digests.get("train") if isinstance(digests, dict) else None
    train_rows = rows.get("train") if isinstance(rows, dict) else None
    if (source.get("sha256"), source.get("rows")) != (train_digest, train_rows):
        raise UserError(
            f"shard manifest {manifest_path} partitions {source.get('rows')} rows with sha256 "
            f"{_short(source.get('sha256'))} but {info_path} records {train_rows} rows and "
            f"{_short(train_digest)} for the train split: the shards are not of this dataset; "
            f"{RERUN_PARTITION}"
        )
    entry = manifest["shards"][rank]
    path = shard_dir / entry["path"]
    if path.is_file():  # a missing shard is the reader's error
        with open_parquet(path, f"shard of rank {rank}", RERUN_PARTITION) as parquet_file:
            found_rows = parquet_file.metadata.num_rows
            layout = read_layout(parquet_file, path)
        if found_rows != entry["rows"]:
            raise UserError(
                f"shard of rank {rank} ({path}) has {found_rows} rows but the shard manifest "
                f"{manifest_path} records {entry['rows']}; {RERUN_PARTITION}"
            )
        num_features = math.prod(layout.row_shape)
        if info.get("num_features") != num_features:
            raise UserError(
                f"{info_path} records num_features {info.get('num_features')!r} but the shard of rank "
                f"{rank} ({path}) holds {num_features} input values per row; {RERUN_PREPARE}"
            )
    _check_classes(info, manifest, info_path)


def _check_classes(info: dict[str, Any], manifest: dict[str, Any], info_path: Path) -> None:
    """num_classes is what prepare derives it from (one per label name), and above every label the
    shards hold (the label counts partition recorded)."""
    num_classes, names = info.get("num_classes"), info.get("label_names")
    if isinstance(names, list) and num_classes != len(names):
        raise UserError(
            f"{info_path} records num_classes {num_classes!r} but its label_names lists {len(names)} "
            f"classes; {RERUN_PREPARE}"
        )
    labels = [
        int(label)
        for shard in manifest["shards"]
        for label in (shard.get("label_counts") or {})
        if label.lstrip("-").isdigit()
    ]
    if not labels or not isinstance(num_classes, int) or num_classes < 1:
        return  # no label column (regression, token blocks), or nothing to compare
    if not 0 <= min(labels) <= max(labels) < num_classes:
        raise UserError(
            f"{info_path} records num_classes {num_classes} but the shards hold labels "
            f"{min(labels)}..{max(labels)}; {RERUN_PREPARE}"
        )


def verify_shard(shard_dir: str | Path, rank: int, manifest: dict, checksum: bool = True) -> Path:
    """Return the path of rank's shard after checking it exists and matches the manifest's size and
    (if ``checksum``, which costs a full read) sha256."""
    world_size = manifest["world_size"]
    if not 0 <= rank < world_size:
        raise UserError(
            f"rank {rank} has no shard: {shard_dir} holds {world_size} shards (world size "
            f"{world_size}); partition for the world size you launch with"
        )
    entry = manifest["shards"][rank]
    path = Path(shard_dir) / entry["path"]
    if not path.is_file():
        raise UserError(f"shard of rank {rank} ({path}) is missing; {RERUN_PARTITION}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise UserError(
            f"shard of rank {rank} ({path}) has {size} bytes, manifest says {entry['bytes']}; "
            f"{RERUN_PARTITION}"
        )
    if checksum and sha256_file(path) != entry["sha256"]:
        raise UserError(
            f"shard of rank {rank} ({path}) does not match its sha256 in the manifest; {RERUN_PARTITION}"
        )
    return path
