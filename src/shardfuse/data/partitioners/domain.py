"""The domain partitioner: one part of a domains dataset per rank (:mod:`shardfuse.data.sources.domains`:
its rows carry their part's index, 0..P-1 in the order of the dataset's ``parts``, in column ``domain``).

By default rank r gets part r, and the world size must equal the number of parts; ``groups`` maps parts
to ranks instead: a list of W lists of part indices, rank r's parts. Several parts on one rank
(``[[0, 1], [2]]``) train together there; one part named by several ranks (``[[0], [0], [1]]``: part 0 on
ranks 0 and 1) is split among them IID (each of its rows to one of them, a seeded uniformly random
assignment balanced to a row, as the iid partitioner deals); a part no list names is left out.

Without a shared part it is the column partitioner over ``domain`` with those groups, so each rank's
local test distribution is its parts' test rows. With a shared part, each part's test rows are a cell and
rank r's distribution weighs them by the training rows of each part it holds (as a label-skewed rank's
classes are weighed by its training labels): every rank, the fusion and the ensemble are scored per
domain (eval.json's ``local_<score>_…``, ``normalized_<score>``). Where we differ from torchtitan's
dataset mixtures: a part is a rank's whole data (or its IID share), never sampled into a mix; the ddp
baseline over the same dataset (partition: iid) trains on the union, row-weighted, or as the domains
dataset's ``mix_weights`` say.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from shardfuse.data.partitioners import column
from shardfuse.data.partitioners.assignment import Cells, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.cells import by_counts
from shardfuse.data.partitioners.dealing import MIN_ROWS, ValueIndex, require_min_rows, values_of
from shardfuse.data.sources.carried import DOMAIN_COLUMN
from shardfuse.io import UserError


def _is_index_groups(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(parts, list) and all(type(part) is int and part >= 0 for part in parts) for parts in value
    )


PARAMS = {
    "groups": Param(
        None,
        "null (part r on rank r) or a list of one list of part indices per rank",
        lambda v: v is None or _is_index_groups(v),
    ),
    "min_rows": MIN_ROWS,
}


def columns(params: dict[str, Any]) -> tuple[str, ...]:
    return (DOMAIN_COLUMN,)


def _as_column(params: dict[str, Any], groups: list[list[int]] | None) -> dict[str, Any]:
    return {"column": DOMAIN_COLUMN, "groups": groups, "min_rows": params["min_rows"]}


def _shared(groups: list[list[int]] | None) -> bool:
    """Whether some part is named by several ranks (then split among them)."""
    flat = [part for parts in groups or [] for part in parts]
    return len(set(flat)) != len(flat)


def check(name: str, params: dict[str, Any], world_size: int, num_classes: int | None) -> None:
    """Named groups: one non-empty list per rank, no part twice in one rank's list (a part in several
    ranks' lists is split among them)."""
    groups = params["groups"]
    if not _shared(groups):
        column.check(name, _as_column(params, groups), world_size, num_classes)
        return
    column.check(name, _as_column(params, None), world_size, num_classes)
    if len(groups) != world_size or not all(groups):
        raise UserError(
            f"partitioner {name}: partition_groups lists {len(groups)} lists of parts "
            f"({', '.join(str(len(parts)) for parts in groups)} parts) for {world_size} ranks; give every "
            "rank a non-empty list"
        )
    for rank, parts in enumerate(groups):
        if len(set(parts)) != len(parts):
            raise UserError(
                f"partitioner {name}: partition_groups names a part twice for rank {rank} ({parts}); name "
                "it once (a part named by several ranks is split among them)"
            )


def check_groups(name: str, params: dict[str, Any], world_size: int, num_groups: Mapping[str, int]) -> None:
    """Part r on rank r needs as many ranks as parts (known from the spec's ``parts`` before any job)."""
    found = num_groups.get(DOMAIN_COLUMN)
    if params["groups"] is None and found is not None and found != world_size:
        raise UserError(
            f"partitioner {name}: the dataset has {found} parts and the run {world_size} ranks; set "
            f"world_size: {found} (one part a rank), or partition_groups to map the parts to the ranks"
        )
    if params["groups"] is not None and found is not None:
        beyond = sorted({part for parts in params["groups"] for part in parts if part >= found})
        if beyond:
            raise UserError(
                f"partitioner {name}: partition_groups names part {beyond[0]}, but the dataset has parts "
                f"0..{found - 1}; fix partition_groups"
            )


def assign(layout: Layout, counts: Mapping[str, ValueCounts], params: dict[str, Any]) -> Deal:
    values = values_of("domain", DOMAIN_COLUMN, counts[DOMAIN_COLUMN])
    check_groups("domain", params, layout.world_size, {DOMAIN_COLUMN: len(values)})
    groups = params["groups"] if params["groups"] is not None else [[value] for value in values]
    if not _shared(groups):
        return column.assign(layout, counts, _as_column(params, groups))
    ranks_of = [[rank for rank, parts in enumerate(groups) if value in parts] for value in values]
    deal = SharedParts(values, ranks_of, counts[DOMAIN_COLUMN], layout)
    require_min_rows(
        "domain", deal.sizes, params["min_rows"], "map fewer ranks to a part or lower partition_min_rows"
    )
    return deal


class SharedParts:
    """The deal when a part is split among ranks: each of its rows (by occurrence, in stream order) goes
    to one of its ranks by a seeded random permutation of its rows taken modulo their number (balanced
    to a row); a part with one rank goes there whole, and a part no rank names is dropped."""

    def __init__(
        self, values: list[Any], ranks_of: list[list[int]], counts: ValueCounts, layout: Layout
    ) -> None:
        self.values = ValueIndex(values)
        dtype = np.min_scalar_type(layout.world_size)
        self.assigned = []
        sizes = np.zeros(layout.world_size + 1, dtype=np.int64)
        for index, (value, ranks) in enumerate(zip(values, ranks_of, strict=True)):
            ranks = ranks or [layout.world_size]
            order = np.random.default_rng([layout.seed, index]).permutation(counts[value])
            assigned = np.asarray(ranks, dtype=dtype)[order % len(ranks)]
            self.assigned.append(assigned)
            np.add.at(sizes, assigned, 1)
        self.sizes = sizes[: layout.world_size].tolist()
        self.seen = np.zeros(len(values), dtype=np.int64)
        self.dtype = dtype

    def __call__(self, num_rows: int, shown: Mapping[str, np.ndarray]) -> np.ndarray:
        rows_value = self.values.of(shown[DOMAIN_COLUMN])
        ranks = np.empty(num_rows, dtype=self.dtype)
        for value in np.unique(rows_value).tolist():
            rows = np.flatnonzero(rows_value == value)
            seen = int(self.seen[value])
            ranks[rows] = self.assigned[value][seen : seen + len(rows)]
            self.seen[value] = seen + len(rows)
        return ranks


def local(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    """Whole parts: the column partitioner's rule (a rank's parts' test rows). Shared parts: a cell per
    part, rank r's weights its training rows of each part (the manifest's ``value_counts``)."""
    if not _shared(params["groups"]):
        return column.local(layout, shards, _as_column(params, params["groups"]))
    held = [(shard.get("value_counts") or {}).get(DOMAIN_COLUMN, {}) for shard in shards]
    return by_counts(held, DOMAIN_COLUMN, int, "domain ")
