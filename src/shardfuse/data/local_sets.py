"""Each rank's local test distribution, read off its shard set's manifest and the dataset's test split: the
partitioner's local rule (``Partitioner.local`` in :mod:`shardfuse.data.partitioners.registry`, the
contract :class:`shardfuse.data.partitioners.assignment.Cells`) applied to the test rows, in one pass over
the columns the partitioner reads (the label, a group column, the continuous column).

An iid shard set has no local distributions but the global one: its manifest is refused here, and the
workflow never asks (its runs keep the evaluate command they had). A library module (pyarrow, no torch);
evaluate's local sets use it (shardfuse.scoring.local). By hand::

    python -c "from shardfuse.data.local_sets import local_cells; \\
        print(local_cells('results/shards/digits/<shard set>/manifest.json', \\
                          'results/datasets/digits/test.parquet').weights)"
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.data.manifest import MANIFEST_NAME, RERUN_PARTITION, read_manifest
from shardfuse.data.partitioners import registry
from shardfuse.data.partitioners.assignment import Layout
from shardfuse.data.partitioners.passes import shown_columns
from shardfuse.data.shard_format import open_parquet, read_batches
from shardfuse.data.verify import DATASET_INFO, RERUN_PREPARE
from shardfuse.io import UserError, read_json


@dataclass(frozen=True)
class LocalCells:
    """The local rule's cells over one test split: their names, each rank's weights [ranks, cells] (rows
    sum to 1) and each test row's cell (-1: in none); the shard set's checked manifest."""

    partitioner: str
    names: tuple[str, ...]
    weights: np.ndarray
    of_row: np.ndarray
    manifest: dict[str, Any]


def manifest_path(path: str | Path) -> Path:
    """A shard set's manifest.json, given it or its directory."""
    path = Path(path)
    return path if path.name == MANIFEST_NAME else path / MANIFEST_NAME


def local_partition(path: str | Path) -> tuple[dict[str, Any], registry.Partitioner, dict[str, Any]]:
    """(the checked manifest, its partitioner's record, its resolved params) of a shard set whose
    partitioner has local distributions; an iid one (or one whose rule has none) is a one-line error."""
    path = manifest_path(path)
    manifest = read_manifest(path.parent)
    partition = manifest.get("partition") or {}  # iid's manifests name no partitioner
    name = partition.get("name", registry.DEFAULT)
    record = registry.find(name)
    if record.local is None:
        raise UserError(
            f"shard set {path.parent} is partitioned {name}, whose ranks have no local test distribution but "
            "the global one, so there are no local scores; drop --set local=... (the workflow passes it "
            "for the other partitioners only)"
        )
    params = registry.resolve_params(name, partition.get("params"), manifest["world_size"])
    return manifest, record, params


def check_dataset(path: Path, manifest: dict[str, Any], test_path: Path) -> None:
    """The shard set partitions the train split of the test split's dataset (dataset.json beside it)."""
    info_path = test_path.parent / DATASET_INFO
    info = read_json(info_path, "dataset info")
    digests, rows = info.get("sha256") or {}, info.get("rows") or {}
    source = manifest.get("source") or {}
    if (source.get("sha256"), source.get("rows")) != (digests.get("train"), rows.get("train")):
        raise UserError(
            f"shard manifest {path} partitions {source.get('rows')} rows that are not the train split "
            f"{info_path} records: the shard set is not of this test split's dataset; pass the run's own "
            f"shard set, or {RERUN_PARTITION}"
        )


def local_cells(path: str | Path, test_path: str | Path, batch_size: int = 65536) -> LocalCells:
    """Each rank's local distribution over the test split at ``test_path`` (checked by the caller as the
    one prepare wrote): the shard set at ``path`` must partition that dataset's train split, and the
    test split must carry the columns its partitioner reads."""
    path, test_path = manifest_path(path), Path(test_path)
    manifest, record, params = local_partition(path)
    check_dataset(path, manifest, test_path)
    columns = record.columns(params)
    what = f"test split {test_path}"
    with open_parquet(test_path, what, RERUN_PREPARE) as parquet_file:
        names = parquet_file.schema_arrow.names
        missing = [column for column in columns if column not in names]
        if missing:
            raise UserError(
                f"partitioner {record.name} finds each rank's local test rows by column {missing[0]!r}, "
                f"which {what} does not have (it has {', '.join(names)}); re-run the prepare stage so "
                "that the splits carry it (snakemake -R prepare_dataset)"
            )

        def batches():
            for batch in read_batches(
                parquet_file, what, RERUN_PREPARE, batch_size=batch_size, columns=list(columns)
            ):
                yield batch.num_rows, shown_columns(batch, columns)

        def scan():
            return (shown for _, shown in batches())

        layout = Layout(parquet_file.metadata.num_rows, manifest["world_size"], manifest["seed"], scan=scan)
        cells = record.local(layout, manifest["shards"], params)
        parts = [np.asarray(cells.cell_of(num_rows, shown), dtype=np.int64) for num_rows, shown in batches()]
    of_row = np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)
    weights = np.array(cells.weights, dtype=np.float64).reshape(manifest["world_size"], len(cells.names))
    if len(of_row) != layout.num_rows or (
        len(of_row) and not -1 <= of_row.min() <= of_row.max() < len(cells.names)
    ):
        raise ValueError(
            f"partitioner {record.name}'s local rule gave cells outside 0..{len(cells.names) - 1}"
        )
    return LocalCells(record.name, cells.names, weights, of_row, manifest)
