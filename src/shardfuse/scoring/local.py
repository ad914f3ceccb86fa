"""Each rank's local test distribution as evaluation sets: the ``local`` kind of shardfuse.scoring.sets,
and the flat scores eval.json, summary.csv and MLflow carry of them (issue 48: each rank scored on its own
ground).

``--set local=<shard set>/manifest.json`` gives one set per rank, ``local_rank_<r>``: the test split's
rows weighted as the shard set's partitioner says rank r's data was drawn (its ``local`` rule,
shardfuse.data.local_sets: for label partitions the classes in rank r's training proportions, for
``column`` the test rows of rank r's groups, for ``size`` the whole split, for ``continuous`` the test
rows the same rule deals rank r). Each model is scored once per cell of the test split, in the test
split's own pass, and every set is a mixture of those sums (shardfuse.scoring.mixture): exact, no
resampling. iid shard sets have none (their runs' evaluate command never asks).

The flat keys, score s the task's (accuracy, mse, loss):

- ``local_<s>_merged_rank_<r>``: the merged model on rank r's distribution;
- ``local_<s>_rank_<r>``: rank r's own model on it (the model that trained on shard r: its replica
  under fsdp; absent where that replica was lost);
- ``local_<s>_merged_mean`` and ``local_<s>_merged_worst``: over the ranks;
- ``normalized_<s>``: the mean over the ranks of merged / own for a higher-is-better score, own / merged
  for a lower-is-better one (1.0: the merged model is as good as every rank on its own data; above 1:
  better). Absent where a denominator is 0.

Torch-free at import (the set records import it); no command line.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfuse.cluster.membership import Membership
from shardfuse.io import UserError

if TYPE_CHECKING:
    from shardfuse.checkpoints.gather_record import GatherRecord
    from shardfuse.models.task import Task
    from shardfuse.scoring.mixture import Weighting

KIND = "local"
SET_PREFIX = "local_rank_"
SCORED = ("merged", "ranks", "ensemble")  # the models a local set scores (the initial model: not here)
EMPTY_FIX = "raise the dataset's test_fraction (a rank's local test rows are a part of the test split)"
PASS_ITS_OWN = "pass the manifest of the run's own shard set"


def check(path: Path) -> None:
    """A shard manifest as partition wrote it, of a partitioner with local distributions."""
    from shardfuse.data.local_sets import local_partition  # deferred: pyarrow

    local_partition(path)


def set_names(path: Path) -> list[str]:
    """One set per rank of the (checked) shard set."""
    from shardfuse.data.local_sets import local_partition

    manifest, _, _ = local_partition(path)
    return [f"{SET_PREFIX}{rank}" for rank in range(manifest["world_size"])]


def weigh(path: Path, headline: Path, gather: GatherRecord) -> Weighting:
    """Each rank's local distribution over the headline (test) split's rows: the shard set must be the
    one the training trained on (its shards, and each one-shard model's rows) and partition the test
    split's dataset."""
    from shardfuse.data.local_sets import local_cells
    from shardfuse.scoring.mixture import Weighting, weighted_sets

    cells = local_cells(path, headline)
    membership = training_membership(path, cells.manifest, gather)
    gathered = {entry.rank for entry in gather.ranks}
    names = [f"{SET_PREFIX}{rank}" for rank in range(cells.manifest["world_size"])]
    found = weighted_sets(cells.names, cells.weights, cells.of_row, names, EMPTY_FIX)
    sets = []
    for rank, weighted in enumerate(found):
        replica = membership.member(rank).replica
        record = {
            "kind": KIND,
            "path": str(path),
            "rows": weighted.record["rows"],
            # the model that trained on this rank's shard (its replica under fsdp); null: lost
            "trained_by": replica if replica in gathered else None,
            **{key: value for key, value in weighted.record.items() if key != "rows"},
        }
        sets.append(replace(weighted, record=record))
    return Weighting(cells.of_row, len(cells.names), tuple(sets))


def training_membership(path: Path, manifest: dict[str, Any], gather: GatherRecord) -> Membership:
    """Which model trained on which shard (gather.json's membership; older files: rank r on shard r),
    after checking that the shard set is the training's: as many shards, and each model that trained on
    one shard trained on as many rows as that shard holds."""
    world_size = gather.world_size or len(gather.ranks)
    recorded = gather.membership
    membership = (
        Membership.full(world_size)
        if recorded is None
        else Membership.from_json(recorded, "gather.json", "re-run the gather stage")
    )
    shards = manifest["shards"]
    if membership.num_shards != len(shards):
        raise UserError(
            f"shard manifest {path} lists {len(shards)} shards but the training read "
            f"{membership.num_shards}; {PASS_ITS_OWN}"
        )
    for entry in gather.ranks:
        ranks = membership.ranks_of(entry.rank)
        if len(ranks) != 1 or entry.rows is None:
            continue  # a replica of several shards (fsdp) records one rank's rows: nothing to compare
        shard = shards[membership.shard_of(ranks[0])]
        if entry.rows != shard["rows"]:
            raise UserError(
                f"shard manifest {path} gives rank {ranks[0]} a shard of {shard['rows']} rows but its model "
                f"trained on {entry.rows}: the shard set is not the training's; {PASS_ITS_OWN}"
            )
    return membership


def local_scores(scored: dict[str, dict[str, Any]], task: Task) -> dict[str, float]:
    """The flat keys (module docstring) of eval.json's local sets; {} without any."""
    score = task.score
    local = {
        int(name.removeprefix(SET_PREFIX)): entry
        for name, entry in scored.items()
        if entry.get("kind") == KIND
    }
    if not local:
        return {}
    ranks = sorted(local)
    merged = [float(local[rank]["merged"][score]) for rank in ranks]
    own: list[float | None] = []
    for rank in ranks:
        mine = [model for model in local[rank]["ranks"] if model["rank"] == local[rank]["trained_by"]]
        own.append(float(mine[0][score]) if mine else None)
    keys = {f"local_{score}_merged_rank_{rank}": value for rank, value in zip(ranks, merged, strict=True)}
    keys |= {
        f"local_{score}_rank_{rank}": value
        for rank, value in zip(ranks, own, strict=True)
        if value is not None
    }
    keys[f"local_{score}_merged_mean"] = sum(merged) / len(merged)
    keys[f"local_{score}_merged_worst"] = max(merged, key=task.sort_key)
    ratios = [task.ratio(m, o) for m, o in zip(merged, own, strict=True) if o is not None]
    if ratios and all(ratio is not None for ratio in ratios):
        keys[f"normalized_{score}"] = sum(ratios) / len(ratios)
    return keys
