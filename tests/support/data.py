"""Helpers that write input files as the stages expect them: Parquet splits of rows, tensors and tokens."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.data.shard_format import SHAPE_KEY
from tests.support.helpers import subprocess_env

# The dataset.json of a small three-class table, as model specs read it (models and scoring tests).
CLASSIFICATION_INFO = {
    "task": "classification",
    "num_features": 4,
    "num_classes": 3,
    "feature_names": ["a", "b", "c", "d"],
    "label_names": ["cat", "dog", "eel"],
}


def write_rows(
    path: Path, num_rows: int, num_classes: int = 3, row_group_size: int | None = None
) -> pa.Table:
    """A table whose ``id`` column is unique, so shards can be checked row by row; the string column and
    schema metadata check that partition keeps every column and the schema exactly."""
    ids = np.arange(num_rows, dtype=np.int64)
    table = pa.table(
        {
            "id": ids,
            "x0": (ids * 0.5).astype(np.float32),
            "note": [f"row {i}" for i in ids],
            "label": (ids * 7) % num_classes,
        }
    ).replace_schema_metadata({"origin": "test_partition"})
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


def write_tensor_split(
    path: Path,
    num_rows: int,
    shape: tuple[int, ...] = (1, 8, 8),
    row_group_size: int | None = None,
    list_size: int | None = None,
    targets: str = "label",
) -> pa.Table:
    """A prepared split in the tensor layout: ``x`` fixed_size_list<float32> with its shape in the field
    metadata (``list_size`` overrides the list's length, to make a mismatch), then ``label`` or y0, y1."""
    rng = np.random.default_rng(num_rows)
    size = list_size or int(np.prod(shape))
    values = pa.array(rng.standard_normal(num_rows * size).astype(np.float32))
    x = pa.FixedSizeListArray.from_arrays(values, size)
    fields = [pa.field("x", x.type, metadata={SHAPE_KEY: str(list(shape)).encode()})]
    columns = [x]
    if targets == "label":
        fields.append(pa.field("label", pa.int64()))
        columns.append(pa.array(rng.integers(0, 3, num_rows)))
    else:
        for name in ("y0", "y1"):
            fields.append(pa.field(name, pa.float32()))
            columns.append(pa.array(rng.standard_normal(num_rows).astype(np.float32)))
    table = pa.Table.from_arrays(columns, schema=pa.schema(fields))
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


def write_token_split(
    path: Path, num_rows: int, block_size: int = 16, dtype=np.uint16, row_group_size: int | None = None
) -> pa.Table:
    """A prepared causal-LM split: one ``tokens`` column of fixed_size_list<dtype>[block_size + 1], no
    targets. Token ids span the dtype's range (int32: beyond 65535)."""
    high = 70_000 if dtype == np.int32 else 65_536
    ids = np.random.default_rng(num_rows).integers(0, high, num_rows * (block_size + 1)).astype(dtype)
    table = pa.table({"tokens": pa.FixedSizeListArray.from_arrays(pa.array(ids), block_size + 1)})
    pq.write_table(table, path, row_group_size=row_group_size)
    return table


def prepare_and_partition(out_root: Path, name: str, spec: str, world_size: int = 2) -> tuple[Path, Path]:
    """(dataset dir, shard dir) made by the prepare and partition stages."""
    dataset, shards = out_root / name, out_root / f"{name}-shards" / f"w{world_size}-seed0"
    for stage, *args in (
        ("prepare", "--name", name, "--spec-json", spec, "--out-dir", dataset),
        (
            "partition",
            "--input",
            dataset / "train.parquet",
            "--world-size",
            world_size,
            "--seed",
            0,
            "--out-dir",
            shards,
        ),
    ):
        command = [sys.executable, "-m", f"shardfuse.{stage}", *map(str, args)]
        subprocess.run(command, check=True, env=subprocess_env(), capture_output=True)
    return dataset, shards


def write_grouped_rows(
    path: Path, num_rows: int, num_classes: int = 10, num_groups: int = 12, seed: int = 0
) -> pa.Table:
    """A prepared-looking split for the partitioners: a unique ``id``, two float features, a ``user``
    group column (integers; carried as data, not a model input) and class labels, all random."""
    rng = np.random.default_rng(seed)
    table = pa.table(
        {
            "id": np.arange(num_rows, dtype=np.int64),
            "x0": rng.normal(size=num_rows).astype(np.float32),
            "x1": rng.normal(size=num_rows).astype(np.float32),
            "user": rng.integers(0, num_groups, num_rows),
            "label": rng.integers(0, num_classes, num_rows),
        }
    )
    pq.write_table(table, path, row_group_size=max(1, num_rows // 5))
    return table
