"""Per-rank data access: check a shard against its manifest and load Parquet rows as tensors.

No command line; used by training and evaluation, e.g.

    python -c "import shardfuse.data as d; print(d.load_shard('results/shards/digits/w4', 0)[0].shape)"

Every rank reads only its own shard-{rank}.parquet. Feature columns are x0..x{F-1} (float32 tensor [N, F]),
labels the ``label`` column (int64 tensor [N]), as written by ``shardfuse.prepare``.
"""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from shardfuse.io import UserError, read_json, sha256_file
from shardfuse.partition import (
    LABEL_COLUMN,
    MANIFEST_FORMAT,
    MANIFEST_NAME,
    open_parquet,
    read_batches,
    shard_name,
)

FEATURE_COLUMN = re.compile(r"x(0|[1-9][0-9]*)")  # no leading zeros: x01 is not feature 1
REMAKE = "re-create it with the prepare (or partition) stage"
RERUN_PARTITION = "re-run the partition stage (snakemake -R partition)"
MANIFEST_KEYS = (
    "format",
    "world_size",
    "seed",
    "drop_remainder",
    "source",
    "total_rows",
    "dropped_rows",
    "schema",
    "shards",
)
SHARD_KEYS = ("rank", "path", "rows", "sha256", "bytes")
DATASET_KEYS = (
    "name",
    "source",
    "num_features",
    "num_classes",
    "feature_names",
    "label_names",
    "rows",
    "test_fraction",
    "seed",
    "sha256",
)


def read_manifest(shard_dir: str | Path) -> dict:
    """Read and check shard_dir/manifest.json (format tag, keys, one entry per rank in rank order)."""
    path = Path(shard_dir) / MANIFEST_NAME
    manifest = read_json(path, "shard manifest")
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        found = manifest.get("format") if isinstance(manifest, dict) else type(manifest).__name__
        raise UserError(
            f"shard manifest {path} has format {found!r}, expected {MANIFEST_FORMAT!r}; {RERUN_PARTITION}"
        )
    missing = [key for key in MANIFEST_KEYS if key not in manifest]
    shards = manifest.get("shards")
    if not missing and isinstance(shards, list):
        missing = [
            f"shards[{i}].{key}"
            for i, shard in enumerate(shards)
            for key in SHARD_KEYS
            if not isinstance(shard, dict) or key not in shard
        ]
    if missing:
        raise UserError(f"shard manifest {path} lacks {', '.join(missing[:5])}; {RERUN_PARTITION}")
    world_size = manifest["world_size"]
    if not isinstance(world_size, int) or world_size < 1:
        raise UserError(f"shard manifest {path} has world_size {world_size!r}; {RERUN_PARTITION}")
    if not isinstance(shards, list) or [shard["rank"] for shard in shards] != list(range(world_size)):
        raise UserError(
            f"shard manifest {path} does not list ranks 0..{world_size - 1} in order; {RERUN_PARTITION}"
        )
    return manifest


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


def feature_columns(schema: pa.Schema, path: str | Path) -> list[str]:
    """Names x0..x{F-1} in numeric order (x10 after x9); UserError if none or one is missing."""
    indices = sorted(
        int(match.group(1)) for name in schema.names if (match := FEATURE_COLUMN.fullmatch(name))
    )
    if not indices:
        raise UserError(
            f"{path} has no feature columns x0, x1, ... (columns found: {', '.join(schema.names)}); {REMAKE}"
        )
    missing = sorted(set(range(indices[-1] + 1)) - set(indices))
    if missing:
        raise UserError(
            f"{path} lacks feature column(s) {', '.join(f'x{i}' for i in missing[:10])}; {REMAKE}"
        )
    return [f"x{i}" for i in indices]


def num_features(path: str | Path) -> int:
    """Number of feature columns of a prepared Parquet file (reads the footer only)."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        return len(feature_columns(parquet_file.schema_arrow, path))


def _table_columns(schema: pa.Schema, path: Path) -> list[str]:
    """Feature column names in order, after checking that they and the label have usable types."""
    names = feature_columns(schema, path)
    if LABEL_COLUMN not in schema.names:
        raise UserError(f"{path} has no {LABEL_COLUMN!r} column; {REMAKE}")
    for name in [*names, LABEL_COLUMN]:
        kind = schema.field(name).type
        if not (pa.types.is_integer(kind) or (name != LABEL_COLUMN and pa.types.is_floating(kind))):
            expected = "an integer" if name == LABEL_COLUMN else "a number"
            raise UserError(f"column {name!r} of {path} has type {kind}, expected {expected}; {REMAKE}")
    return names


def load_table(path: str | Path, batch_size: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a prepared Parquet file as (features float32 [N, F], labels int64 [N]).

    Arrow stores columns, a model wants rows, so one copy into a preallocated [N, F] array is
    unavoidable; reading batch by batch keeps peak memory at that array plus one batch.
    torch.from_numpy then shares the arrays' memory."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        names = _table_columns(parquet_file.schema_arrow, path)
        num_rows = parquet_file.metadata.num_rows
        features = np.empty((num_rows, len(names)), dtype=np.float32)
        labels = np.empty(num_rows, dtype=np.int64)
        offset = 0
        for batch in read_batches(
            parquet_file, f"data file {path}", REMAKE, batch_size=batch_size, columns=[*names, LABEL_COLUMN]
        ):
            end = offset + batch.num_rows
            for j, name in enumerate([*names, LABEL_COLUMN]):
                column = batch.column(name)
                if column.null_count:
                    raise UserError(
                        f"column {name!r} of {path} has {column.null_count} missing value(s); {REMAKE}"
                    )
                if name == LABEL_COLUMN:
                    labels[offset:end] = column.to_numpy()
                else:
                    features[offset:end, j] = column.to_numpy()
            offset = end
    return torch.from_numpy(features), torch.from_numpy(labels)


def load_shard(shard_dir: str | Path, rank: int, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Load rank's shard as (features, labels); touches only manifest.json and shard-{rank}.parquet.

    ``verify`` adds the sha256 check (a full extra read); existence and size are always checked."""
    manifest = read_manifest(shard_dir)
    path = verify_shard(shard_dir, rank, manifest, checksum=verify)
    if path.name != shard_name(rank):
        raise UserError(f"shard manifest in {shard_dir} names {path.name} for rank {rank}; {RERUN_PARTITION}")
    return load_table(path)


def read_dataset_info(dataset_dir: str | Path) -> dict:
    """Read dataset_dir/dataset.json (written by prepare): num_features, num_classes, names, rows, ..."""
    path = Path(dataset_dir) / "dataset.json"
    info = read_json(path, "dataset info")
    missing = [key for key in DATASET_KEYS if not isinstance(info, dict) or key not in info]
    if missing:
        raise UserError(
            f"dataset info {path} lacks {', '.join(missing)}; re-run the prepare stage "
            "(snakemake -R prepare_dataset)"
        )
    return info
