"""Every partitioner, one record each: its deal, its parameters with their defaults, the columns it reads,
its check, its reference, and what it adds to the identity of the shard sets it makes.

The partition stage's ``--partitioner`` and ``--params-json``, the config's ``partition`` enum and
``partition_<param>`` keys, a shard set's directory name, its trainings' names and the partition rule's
command all derive from ``RECORDS`` (tests/contracts hold the schema equal to it). Records are looked up
by name at call time (:func:`find`), so a record added to ``RECORDS`` is seen everywhere. Adding a
partitioner is one module with its ``assign`` (the contract is :mod:`.assignment`) and one record here.
Torch-free and pyarrow-free: the workflow imports it to name shard sets. By hand::

    python -c "from shardfuse.data.partitioners import registry; \\
        print(registry.shardset_identity('iid', {}), registry.resolve_params('iid', {}, 4))"
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from shardfuse.data.partitioners import iid
from shardfuse.data.partitioners.assignment import Deal, Layout, Param, ValueCounts
from shardfuse.io import UserError, find_record

Assign = Callable[[Layout, Mapping[str, ValueCounts], dict[str, Any]], Deal]
Check = Callable[[str, dict[str, Any], int], None]  # (partitioner, resolved params, world size)


def no_columns(params: dict[str, Any]) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Partitioner:
    name: str
    assign: Assign
    reference: str
    params: dict[str, Param] = field(default_factory=dict)
    # The columns the counting pass counts and the deal is shown, from the resolved params (the label,
    # a column a param names); none: no counting pass, the deal sees row counts only.
    columns: Callable[[dict[str, Any]], tuple[str, ...]] = no_columns
    check: Check | None = None  # checks across parameters and the world size, after each passed its own
    # Whether its shard sets are named by its name and params (beside world size, seed, drop_remainder):
    # false only for iid, whose shard sets, commands and trainings keep the names they had before
    # partitioners existed.
    named: bool = True

    def identity(self, params: dict[str, Any]) -> dict[str, Any]:
        """What this partitioner adds to a shard set's identity (as flat run keys): its name and its
        resolved params, or nothing where it is not ``named``."""
        if not self.named:
            return {}
        return {"partition": self.name, **{f"partition_{key}": value for key, value in params.items()}}


RECORDS: tuple[Partitioner, ...] = (
    Partitioner(
        "iid",
        iid.assign,
        "a seeded uniformly random split into shards whose sizes differ by at most one row",
        named=False,
    ),
)

# The schema's default of the config key `partition` (tests/contracts hold them equal).
DEFAULT = "iid"


def names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS)


def find(name: str) -> Partitioner:
    return find_record(
        RECORDS, name, "partitioner", "set the run key partition (or --partitioner) to one of them"
    )


def resolve_params(name: str, params: Any, world_size: int) -> dict[str, Any]:
    """Check ``params`` of partitioner ``name`` for ``world_size`` ranks; fill in defaults."""
    record = find(name)
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise UserError(
            f"partition parameters must be a JSON object, got {type(params).__name__}; "
            "pass e.g. --params-json '{\"alpha\": 0.5}'"
        )
    unknown = sorted(set(params) - set(record.params))
    if unknown:
        valid = f"valid: {', '.join(record.params)}" if record.params else "it takes none"
        raise UserError(
            f"partitioner {name} has no parameter {', '.join(map(repr, unknown))} ({valid}); "
            "remove its partition_<param> key (or --params-json entry)"
        )
    resolved = {}
    for key, param in record.params.items():
        value = params.get(key, param.default)
        if not param.accept(value):
            raise UserError(
                f"partitioner {name}: parameter {key!r} must be {param.describe}, got {value!r}; "
                f"fix run key partition_{key} (or --params-json)"
            )
        resolved[key] = value
    if record.check is not None:
        record.check(name, resolved, world_size)
    return resolved


def shardset_identity(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """What partitioner ``name`` with resolved ``params`` adds to a shard set's identity ({} for iid)."""
    return find(name).identity(params)
