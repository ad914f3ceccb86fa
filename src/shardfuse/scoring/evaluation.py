"""A training's models scored on every named evaluation set: the merged model, each rank's own model and
their ensemble, and the initial model, each on the sets its kind scores it on (shardfuse.scoring.sets).

The library half of the evaluate stage: each model is loaded once and scored on every set before the
next is loaded, so memory holds every rank's model at once (for the ensemble) and one batch of outputs,
whatever the number of sets. Sets that weigh the headline split's rows (each rank's local distribution,
shardfuse.scoring.local) are scored in the headline's pass: each model's sums per cell of its rows, mixed
per set (shardfuse.scoring.mixture). The caller has checked the files (trust, model specs) first. No
command line: see ``python -m shardfuse.evaluate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from shardfuse.scoring.mixture import Weighting, mix
from shardfuse.scoring.scorer import CellScores, Model, model_from_file, score_in_cells
from shardfuse.scoring.sets import HEADLINE, EvalSet, SetKind
from shardfuse.scoring.split import Split, load_split


@dataclass(frozen=True)
class TrainingModels:
    """The checkpoints evaluate scores: the merge, each rank's (rank number, file), the initial weights."""

    merged: Path
    ranks: list[tuple[int, Path]]
    base: Path


def load_sets(sets: list[tuple[SetKind, EvalSet]]) -> list[tuple[SetKind, Split]]:
    """Each set's rows in memory (a set that weighs the headline's rows has none of its own: left out);
    a set without rows is a one-line error saying how to give it some."""
    return [
        (
            kind,
            load_split(evaluation_set.path, evaluation_set.name).require_rows(
                evaluation_set.name, kind.empty_fix
            ),
        )
        for kind, evaluation_set in sets
        if kind.weighs is None
    ]


def score_sets(
    splits: list[tuple[SetKind, Split]],
    models: TrainingModels,
    spec: dict[str, Any],
    batch_size: int,
    weighted: tuple[SetKind, Weighting] | None = None,
) -> dict[str, dict[str, Any]]:
    """{set name: {"kind", "path", "rows", "merged", "ranks", "ensemble", "base"}}: the metrics of each
    model its kind scores (``ranks`` a list of {"rank", **metrics}), in the order the sets were given,
    then the sets of ``weighted`` (a kind and its weighting of the headline split's rows), each with
    what its weighting records of it."""
    for _, split in splits:
        split.check_fits(spec)  # before any model is built
    scored = {
        split.name: {"kind": kind.name, "path": str(split.path), "rows": split.rows} for kind, split in splits
    }
    weighing, weighting = weighted if weighted is not None else (None, None)
    if weighting is not None:
        scored |= {weighted_set.name: dict(weighted_set.record) for weighted_set in weighting.sets}

    def wanted(role: str) -> list[tuple[SetKind, Split]]:
        return [(kind, split) for kind, split in splits if role in kind.scores]

    def scores(role: str, split: Split, scoring: list[Model], ensemble: bool = False) -> CellScores:
        """One pass of ``scoring`` over ``split``, with the cells where the weighted sets score ``role``."""
        if weighting is None or split.name != HEADLINE or role not in weighing.scores:
            return score_in_cells(scoring, split, batch_size, ensemble=ensemble)
        of_row = torch.from_numpy(weighting.of_row)
        found = score_in_cells(
            scoring, split, batch_size, ensemble=ensemble, of_row=of_row, num_cells=weighting.num_cells
        )
        numbers = [number for number, _ in models.ranks] if role == "ranks" else None
        ensemble_too = "ensemble" in weighing.scores
        for weighted_set in weighting.sets:
            scored[weighted_set.name] |= mixtures(
                found, scoring, weighted_set.weights, numbers, ensemble_too, role
            )
        return found

    if on := wanted("merged"):
        merged = model_from_file(models.merged)
        for _, split in on:
            scored[split.name]["merged"] = scores("merged", split, [merged]).metrics[0]
        del merged
    if on := wanted("ranks"):
        ranks = [model_from_file(path) for _, path in models.ranks]
        for kind, split in on:
            found = scores("ranks", split, ranks, ensemble="ensemble" in kind.scores)
            scored[split.name]["ranks"] = [
                {"rank": number, **values}
                for (number, _), values in zip(models.ranks, found.metrics, strict=True)
            ]
            if found.ensemble is not None:
                scored[split.name]["ensemble"] = found.ensemble
        del ranks
    if on := wanted("base"):
        base = model_from_file(models.base)
        for _, split in on:
            scored[split.name]["base"] = scores("base", split, [base]).metrics[0]
    return scored


def mixtures(
    found: CellScores,
    scoring: list[Model],
    weights: tuple[float, ...],
    numbers: list[int] | None,
    ensemble: bool,
    role: str,
) -> dict[str, Any]:
    """A weighted set's figures from one pass's sums per cell: {role: metrics}, or for the ranks
    (``numbers``) {"ranks": [{"rank", **metrics}], "ensemble": metrics} (the ensemble where scored)."""
    mixed = [
        model.task.finish(mix(cells, weights)) for model, cells in zip(scoring, found.cells, strict=True)
    ]
    if numbers is None:
        return {role: mixed[0]}
    entry: dict[str, Any] = {
        "ranks": [{"rank": number, **values} for number, values in zip(numbers, mixed, strict=True)]
    }
    if ensemble and found.ensemble_cells is not None:
        entry["ensemble"] = scoring[0].task.finish(mix(found.ensemble_cells, weights))
    return entry
