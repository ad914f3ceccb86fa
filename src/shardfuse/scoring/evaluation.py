"""A training's models scored on every named evaluation set: the merged model, each rank's own model and
their ensemble, and the initial model, each on the sets its kind scores it on (shardfuse.scoring.sets).

The library half of the evaluate stage: each model is loaded once and scored on every set before the
next is loaded, so memory holds every rank's model at once (for the ensemble) and one batch of outputs,
whatever the number of sets. The caller has checked the files (trust, model specs) first. No command
line: see ``python -m shardfuse.evaluate``.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfuse.scoring.scorer import model_from_file, score_models
from shardfuse.scoring.sets import EvalSet, SetKind
from shardfuse.scoring.split import Split, load_split


@dataclass(frozen=True)
class TrainingModels:
    """The checkpoints evaluate scores: the merge, each rank's (rank number, file), the initial weights."""

    merged: Path
    ranks: list[tuple[int, Path]]
    base: Path


def load_sets(sets: list[tuple[SetKind, EvalSet]]) -> list[tuple[SetKind, Split]]:
    """Each set's rows in memory; a set without rows is a one-line error saying how to give it some."""
    return [
        (
            kind,
            load_split(evaluation_set.path, evaluation_set.name).require_rows(
                evaluation_set.name, kind.empty_fix
            ),
        )
        for kind, evaluation_set in sets
    ]


def score_sets(
    splits: list[tuple[SetKind, Split]], models: TrainingModels, spec: dict[str, Any], batch_size: int
) -> dict[str, dict[str, Any]]:
    """{set name: {"kind", "path", "rows", "merged", "ranks", "ensemble", "base"}}: the metrics of each
    model its kind scores (``ranks`` a list of {"rank", **metrics}), in the order the sets were given."""
    for _, split in splits:
        split.check_fits(spec)  # before any model is built
    scored = {
        split.name: {"kind": kind.name, "path": str(split.path), "rows": split.rows} for kind, split in splits
    }

    def wanted(role: str) -> list[tuple[SetKind, Split]]:
        return [(kind, split) for kind, split in splits if role in kind.scores]

    if on := wanted("merged"):
        merged = model_from_file(models.merged)
        for _, split in on:
            scored[split.name]["merged"] = score_models([merged], split, batch_size)[0][0]
        del merged
    if on := wanted("ranks"):
        ranks = [model_from_file(path) for _, path in models.ranks]
        for kind, split in on:
            metrics, ensemble = score_models(ranks, split, batch_size, ensemble="ensemble" in kind.scores)
            scored[split.name]["ranks"] = [
                {"rank": number, **values} for (number, _), values in zip(models.ranks, metrics, strict=True)
            ]
            if ensemble is not None:
                scored[split.name]["ensemble"] = ensemble
        del ranks
    if on := wanted("base"):
        base = model_from_file(models.base)
        for _, split in on:
            scored[split.name]["base"] = score_models([base], split, batch_size)[0][0]
    return scored
