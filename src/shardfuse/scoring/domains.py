"""Each part of a domains dataset as an evaluation set: the ``domain`` kind of shardfuse.scoring.sets,
and the flat scores eval.json, summary.csv and MLflow carry of them (issue "one domain per rank").

``--set domain=results/datasets/<dataset>/dataset.json`` (the domains dataset's record, beside the test
split) gives one set per part, ``domain_<part>``: the test rows of that part (the split's ``domain``
column), scored in the test split's own pass like the local sets. The workflow passes it for the runs of
a domains dataset with iid shards (ddp on the union): a run partitioned by domain has the same sets as
its local ones (rank r's is part r's test rows, with each rank's own model beside the fusion), and
evaluate takes one kind of set that weighs the test split's rows.

The flat keys, score s the task's (accuracy, mse, loss): ``domain_<s>_merged_<part>`` (the merged model
on that part's test rows), ``domain_<s>_ensemble_<part>`` (the ranks' ensemble there, where scored),
``domain_<s>_merged_mean`` and ``domain_<s>_merged_worst`` over the parts.

Torch-free at import; no command line.
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError

if TYPE_CHECKING:
    from shardfuse.checkpoints.gather_record import GatherRecord
    from shardfuse.models.task import Task
    from shardfuse.scoring.mixture import Weighting

KIND = "domain"
SET_PREFIX = "domain_"
SCORED = ("merged", "ranks", "ensemble")
EMPTY_FIX = "raise the parts' test_fraction (each part's test rows are its own test split)"
COLUMN = "domain"


def _parts(path: Path) -> list[str]:
    try:
        info = json.loads(Path(path).read_text())
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot read dataset record {path} ({exc}); pass the domains dataset's dataset.json"
        ) from None
    parts = info.get("parts") if isinstance(info, dict) else None
    if not (isinstance(parts, list) and parts and all(isinstance(part, str) for part in parts)):
        raise UserError(
            f"{path} is not the record of a domains dataset (it names no parts); pass --set domain=... only "
            "for a run of a domains dataset (the workflow does)"
        )
    return parts


def check(path: Path) -> None:
    _parts(path)


def set_names(path: Path) -> list[str]:
    return [f"{SET_PREFIX}{part}" for part in _parts(path)]


def weigh(path: Path, headline: Path, gather: GatherRecord) -> Weighting:
    """One cell per part, the test rows of that part (the headline split's ``domain`` column); the
    record must be the one beside the headline split (the same dataset)."""
    import numpy as np

    from shardfuse.data.shard_format import open_parquet, read_batches
    from shardfuse.scoring.mixture import Weighting, weighted_sets

    if Path(path).resolve().parent != Path(headline).resolve().parent:
        raise UserError(
            f"dataset record {path} is not the one beside the test split {headline}; pass the record of the "
            "test split's own dataset"
        )
    parts = _parts(path)
    what = f"test split {headline}"
    fix = "re-run the prepare stage (snakemake -R prepare_dataset)"
    with open_parquet(Path(headline), what, fix) as parquet_file:
        if COLUMN not in parquet_file.schema_arrow.names:
            raise UserError(f"{what} has no column {COLUMN!r}, so it is not a domains dataset's; {fix}")
        pieces = [
            batch.column(COLUMN).to_numpy(zero_copy_only=False).astype(np.int64)
            for batch in read_batches(parquet_file, what, fix, columns=[COLUMN])
        ]
    of_row = np.concatenate(pieces) if pieces else np.empty(0, dtype=np.int64)
    if len(of_row) and not 0 <= of_row.min() <= of_row.max() < len(parts):
        raise UserError(f"{what} holds domain {int(of_row.max())} beyond its {len(parts)} parts; {fix}")
    weights = np.eye(len(parts), dtype=np.float64)
    names = [f"{SET_PREFIX}{part}" for part in parts]
    found = weighted_sets(parts, weights, of_row, names, EMPTY_FIX)
    sets = tuple(
        replace(weighted, record={"kind": KIND, "path": str(path), **weighted.record}) for weighted in found
    )
    return Weighting(of_row, len(parts), sets)


def domain_scores(scored: dict[str, dict[str, Any]], task: Task) -> dict[str, float]:
    """The flat keys (module docstring) of eval.json's domain sets; {} without any."""
    score = task.score
    domains = {
        name.removeprefix(SET_PREFIX): entry for name, entry in scored.items() if entry.get("kind") == KIND
    }
    if not domains:
        return {}
    keys: dict[str, float] = {}
    merged = []
    for part, entry in domains.items():
        merged.append(float(entry["merged"][score]))
        keys[f"domain_{score}_merged_{part}"] = merged[-1]
        if entry.get("ensemble"):
            keys[f"domain_{score}_ensemble_{part}"] = float(entry["ensemble"][score])
    keys[f"domain_{score}_merged_mean"] = sum(merged) / len(merged)
    keys[f"domain_{score}_merged_worst"] = max(merged, key=task.sort_key)
    return keys
