"""Every partitioner, one record each: its deal, its parameters with their defaults, the columns it reads,
its check, its reference, what it adds to the identity of the shard sets it makes, and each rank's local
test distribution (its ``local`` rule, which evaluate scores the models on).

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

from shardfuse.data.partitioners import column, continuous, dirichlet, domain, iid, pathological, shards, size
from shardfuse.data.partitioners.assignment import LABEL_COLUMN, Deal, Layout, LocalRule, Param, ValueCounts
from shardfuse.data.partitioners.cells import by_label, whole_split
from shardfuse.io import UserError, find_record

Assign = Callable[[Layout, Mapping[str, ValueCounts], dict[str, Any]], Deal]
# (partitioner, resolved params, world size, the number of classes where known before the data is read)
Check = Callable[[str, dict[str, Any], int, "int | None"], None]
# (partitioner, resolved params, world size, {counted column: its number of groups} where known)
GroupsCheck = Callable[[str, dict[str, Any], int, Mapping[str, int]], None]


def no_columns(params: dict[str, Any]) -> tuple[str, ...]:
    return ()


@dataclass(frozen=True)
class Partitioner:
    name: str
    assign: Assign
    reference: str
    params: dict[str, Param] = field(default_factory=dict)
    # The columns the deal is shown (and, unless ``counted`` says otherwise, the counting pass counts),
    # from the resolved params (the label, a column a param names); none: no counting pass, the deal
    # sees row counts only.
    columns: Callable[[dict[str, Any]], tuple[str, ...]] = no_columns
    # The columns whose values the counting pass counts (None: the columns above); a float column's
    # counts would be as large as the data, so a rule that reads one counts nothing (continuous).
    counted: Callable[[dict[str, Any]], tuple[str, ...]] | None = None
    check: Check | None = None  # checks across parameters and the world size, after each passed its own
    # Checks against the number of groups of a counted column where the dataset's spec tells it, so the
    # config refuses before any job what the deal would refuse (the column partitioner: a group a rank).
    check_groups: GroupsCheck | None = None
    # Whether it honours drop_remainder (equal shards of N // W rows); the others decide their own sizes.
    drops_remainder: bool = False
    # Whether its shard sets are named by its name and params (beside world size, seed, drop_remainder):
    # false only for iid, whose shard sets, commands and trainings keep the names they had before
    # partitioners existed.
    named: bool = True
    # Each rank's local test distribution (:class:`.assignment.Cells`), which evaluate scores every model
    # on beside the global test split; None: none but the global one (iid), and no local scores at all.
    local: LocalRule | None = None

    def identity(self, params: dict[str, Any]) -> dict[str, Any]:
        """What this partitioner adds to a shard set's identity (as flat run keys): its name and its
        resolved params, or nothing where it is not ``named``."""
        if not self.named:
            return {}
        return {"partition": self.name, **{f"partition_{key}": value for key, value in params.items()}}

    def counted_columns(self, params: dict[str, Any]) -> tuple[str, ...]:
        return self.columns(params) if self.counted is None else self.counted(params)

    def group_columns(self, params: dict[str, Any]) -> tuple[str, ...]:
        """The columns whose values it counts as groups: its counted columns but the label. A
        dataset's split files carry them only where its spec asks (shardfuse.data.sources.carried)."""
        return tuple(column for column in self.counted_columns(params) if column != LABEL_COLUMN)

    def reads_labels(self, params: dict[str, Any]) -> bool:
        """Whether it reads the class labels (a label partition: classification data only)."""
        return LABEL_COLUMN in self.columns(params)


RECORDS: tuple[Partitioner, ...] = (
    Partitioner(
        "iid",
        iid.assign,
        "a seeded uniformly random split into shards whose sizes differ by at most one row",
        named=False,
        drops_remainder=True,
    ),
    Partitioner(
        "dirichlet",
        dirichlet.assign,
        "label skew: each class split over the ranks by p ~ Dir(alpha) (Hsu et al. 2019; Flower's "
        "DirichletPartitioner)",
        dirichlet.PARAMS,
        columns=dirichlet.columns,
        local=by_label,
    ),
    Partitioner(
        "pathological",
        pathological.assign,
        "each rank sees classes_per_rank classes (McMahan et al. 2017; Flower's PathologicalPartitioner)",
        pathological.PARAMS,
        columns=pathological.columns,
        check=pathological.check,
        local=by_label,
    ),
    Partitioner(
        "shards",
        shards.assign,
        "rows sorted by label, cut into shards, shards_per_rank dealt to each rank (FedAvg; Flower's "
        "ShardPartitioner)",
        shards.PARAMS,
        columns=shards.columns,
        local=by_label,
    ),
    Partitioner(
        "column",
        column.assign,
        "natural groups: each value of a column one group, groups dealt to ranks balanced by rows or as "
        "named (Flower's NaturalIdPartitioner)",
        column.PARAMS,
        columns=column.columns,
        check=column.check,
        check_groups=column.check_groups,
        local=column.local,
    ),
    Partitioner(
        "domain",
        domain.assign,
        "one part of a domains dataset per rank (or as partition_groups maps them): the column partitioner "
        "over the parts",
        domain.PARAMS,
        columns=domain.columns,
        check=domain.check,
        check_groups=domain.check_groups,
        local=domain.local,
    ),
    Partitioner(
        "size",
        size.assign,
        "quantity skew: iid rows in shards of given fractions or by a law (Flower's SizePartitioner, "
        "Linear/Square/ExponentialPartitioner)",
        size.PARAMS,
        check=size.check,
        local=whole_split,
    ),
    Partitioner(
        "continuous",
        continuous.assign,
        "skew along a numeric column: sorted by strictness x z + (1 - strictness) x noise, cut in W runs "
        "(Flower's ContinuousPartitioner)",
        continuous.PARAMS,
        columns=continuous.columns,
        counted=continuous.counted,
        local=continuous.local,
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


def resolve_params(name: str, params: Any, world_size: int, num_classes: int | None = None) -> dict[str, Any]:
    """Check ``params`` of partitioner ``name`` for ``world_size`` ranks (and ``num_classes``, where the
    number of classes is known before the data is read); fill in defaults."""
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
        resolved[key] = param.normalize(value)
    if record.check is not None:
        record.check(name, resolved, world_size, num_classes)
    return resolved


def shardset_identity(name: str, params: dict[str, Any]) -> dict[str, Any]:
    """What partitioner ``name`` with resolved ``params`` adds to a shard set's identity ({} for iid)."""
    return find(name).identity(params)
