"""What the schema cannot say about a run's partition keys: which partition_<param> keys its partitioner
takes, their values (the partitioner's record checks them), and whether its data can be split so (class
labels for a label partition; a group column the dataset's split files carry, with enough groups where
the spec says how many); each refused with the key and the fix, before any job (the partition stage
checks what only the data can tell: a column's type, the number of classes or groups, a draw's shard
sizes).
"""

from __future__ import annotations

from typing import Any

from shardfuse.data.partitioners import registry as partitioners
from shardfuse.data.sources.registry import find_source
from shardfuse.experiment.checks import dataset_task
from shardfuse.experiment.keys import partition_params, partitioner_of
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError
from shardfuse.models.task import CLASSES
from shardfuse.models.tasks import task_record


def check_partition(
    name: str, run: dict[str, Any], datasets: dict[str, dict[str, Any]] | None = None
) -> None:
    """The run's partitioner takes its partition_<param> keys (and no other), its record checks their
    values, and its data can be split so (a label partition on class labels, classes per rank within the
    classes the spec names): before any job, not at partition time."""
    where = f"config error at runs[{name}].partition"
    partitioner = partitioner_of(run)
    record = partitioners.find(partitioner)
    stray = sorted(
        key
        for key, value in run.items()
        if key.startswith("partition_")
        and value is not None
        and key[len("partition_") :] not in record.params
    )
    if stray:
        takes = ", ".join(f"partition_{param}" for param in record.params) or "no partition_<param> key"
        raise ConfigError(
            f"{where}: partitioner {partitioner} does not take {', '.join(stray)} (it takes {takes}); "
            "remove it, or set partition to the partitioner it belongs to"
        )
    if run.get("drop_remainder") and not record.drops_remainder:
        raise ConfigError(
            f"{where}: drop_remainder makes iid's shards equal; partitioner {partitioner} decides its own "
            "shard sizes, so set drop_remainder: false"
        )
    dataset = (datasets or {}).get(run["dataset"])
    try:
        params = partition_params(run, _known_classes(dataset))
    except UserError as exc:
        raise ConfigError(f"{where}: {exc}") from None
    if dataset is not None and record.reads_labels(params) and not _has_class_labels(dataset):
        raise ConfigError(
            f"{where}: partitioner {partitioner} splits by class labels, but dataset {run['dataset']} is a "
            f"{dataset_task(dataset)} dataset without them; use partition: size, column or continuous "
            "(or iid)"
        )
    if dataset is not None:
        _check_group_columns(where, run, record, params, dataset)


def _check_group_columns(
    where: str, run: dict[str, Any], record: partitioners.Partitioner, params: dict[str, Any], dataset: dict
) -> None:
    """The columns the partitioner groups rows by are carried by the dataset's split files (its source's
    record says which its spec asks for), with as many groups as the record needs where the spec says."""
    source = find_source(dataset["source"])
    carried = source.carried(dataset)
    for column in record.group_columns(params):
        if column in carried:
            continue
        has = (
            f"they carry {', '.join(carried)}"
            if carried
            else "they carry no column beyond inputs and targets"
        )
        fix = source.carry_fix or "a csv or parquet dataset carries its keep_columns"
        raise ConfigError(
            f"{where}: partitioner {record.name} groups rows by column {column!r}, which the split files of "
            f"dataset {run['dataset']} do not carry ({has}); {fix}"
        )
    if record.check_groups is not None:
        known = {column: groups for column, groups in carried.items() if groups is not None}
        try:
            record.check_groups(record.name, params, run["world_size"], known)
        except UserError as exc:
            raise ConfigError(f"{where}: {exc}") from None


def _has_class_labels(dataset: dict[str, Any]) -> bool:
    """The dataset's task trains on class labels (its record's layout of targets)."""
    return task_record(dataset_task(dataset)).labels == CLASSES


def _known_classes(dataset: dict[str, Any] | None) -> int | None:
    """The number of classes where the spec says it before prepare runs (a ``classes`` list, or
    synthetic's ``num_classes``); otherwise the partition stage checks against the data."""
    if dataset is None:
        return None
    if isinstance(dataset.get("classes"), list):
        return len(dataset["classes"])
    return dataset.get("num_classes") if isinstance(dataset.get("num_classes"), int) else None
