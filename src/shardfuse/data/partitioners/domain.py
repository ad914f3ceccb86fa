"""The domain partitioner: one part of a domains dataset per rank (:mod:`shardfuse.data.sources.domains`:
its rows carry their part's index, 0..P-1 in the order of the dataset's ``parts``, in column ``domain``).

By default rank r gets part r, and the world size must equal the number of parts; ``groups`` maps parts
to ranks instead (a list of W lists of part indices, e.g. ``[[0, 1], [2]]``: two parts on rank 0; a part
no list names is left out). It is the column partitioner over ``domain`` with those groups, so each rank's
local test distribution is its parts' test rows: every rank, the fusion and the ensemble are scored per
domain (eval.json's ``local_<score>_…``, ``normalized_<score>``). Where we differ from torchtitan's
dataset mixtures: a part is a rank's whole data, never sampled into a mix; the ddp baseline over the same
dataset (partition: iid) trains on the union, row-weighted. A part cannot yet be split over several ranks.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from shardfuse.data.partitioners import column
from shardfuse.data.partitioners.assignment import Cells, Deal, Layout, Param, ValueCounts
from shardfuse.data.partitioners.dealing import MIN_ROWS, values_of
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


def check(name: str, params: dict[str, Any], world_size: int, num_classes: int | None) -> None:
    column.check(name, _as_column(params, params["groups"]), world_size, num_classes)


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
    return column.assign(layout, counts, _as_column(params, groups))


def local(layout: Layout, shards: Sequence[Mapping[str, Any]], params: dict[str, Any]) -> Cells:
    return column.local(layout, shards, _as_column(params, params["groups"]))
