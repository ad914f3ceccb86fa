"""Evaluation sets: the named sets evaluate scores a run's models on, one record per kind.

A kind says how its file is proved to be the one the workflow wrote, which models are scored on it, and
which named sets its file gives: ``test`` (the dataset's global test split, as prepare wrote it: the
headline of eval.json, summary.csv and MLflow) and ``local`` (a shard set's manifest: one set per rank,
``local_rank_<r>``, that rank's local test distribution, shardfuse.scoring.local) and ``domain`` (a
domains dataset's record: one set per part, ``domain_<part>``, shardfuse.scoring.domains). A kind whose
:meth:`SetKind.sets` names several sets from one input is one record here. A
kind with ``weighs`` holds no rows of its own: its sets weigh the headline split's rows
(shardfuse.scoring.mixture), scored in the headline's pass. The evaluate stage takes ``--set KIND=PATH``
(``--test PATH`` is ``--set test=PATH``), and eval.json's ``sets`` holds each set's scores under its name
(shardfuse.experiment.records.EvalRecord).

Records are looked up when called (:func:`set_kind`, reading ``RECORDS``), so a test that extends
``RECORDS`` extends the stage. Torch-free. By hand::

    python -c "from shardfuse.scoring.sets import set_kind; print(set_kind('test').scores)"
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from shardfuse.data.verify import check_split
from shardfuse.io import UserError, find_record
from shardfuse.scoring import domains, local

if TYPE_CHECKING:
    from shardfuse.checkpoints.gather_record import GatherRecord
    from shardfuse.scoring.mixture import Weighting

# What evaluate can score on a set: the merged model, each rank's own model, the ranks' ensemble (needs
# the ranks), the initial model.
MODELS = ("merged", "ranks", "ensemble", "base")
HEADLINE = "test"  # the set whose scores are eval.json's top-level fields, summary.csv's and MLflow's


@dataclass(frozen=True)
class EvalSet:
    """One named set to score: its name in eval.json, its kind's name, its file."""

    name: str
    kind: str
    path: Path


@dataclass(frozen=True)
class SetKind:
    name: str
    describe: str
    check: Callable[[Path], None]  # refuses a file that is not the one the workflow wrote for this kind
    empty_fix: str  # how to give the set rows, for the error when its file has none
    scores: tuple[str, ...] = MODELS  # which of MODELS are scored on its sets
    names: Callable[[Path], list[str]] | None = (
        None  # the sets its (checked) file gives; None: one, the kind's
    )
    # A kind whose sets weigh the headline split's rows instead of holding rows: (its file, the headline
    # split's file, the training's gather record) -> the weighting, its sets in the order ``names`` gives
    # them (it checks its file against both). None: its file holds its rows.
    weighs: Callable[[Path, Path, GatherRecord], Weighting] | None = None

    def sets(self, path: Path) -> list[EvalSet]:
        """The named sets this kind's file gives; one, named as the kind, unless its ``names`` says."""
        names = [self.name] if self.names is None else self.names(Path(path))
        return [EvalSet(name, self.name, Path(path)) for name in names]


def _test_split(path: Path) -> None:
    check_split(path, "test")  # the split prepare wrote, not another file in its place


RECORDS: tuple[SetKind, ...] = (
    SetKind(
        HEADLINE,
        "the dataset's global test split, as prepare wrote it (results/datasets/<dataset>/test.parquet)",
        _test_split,
        "raise the dataset's test_fraction",
    ),
    SetKind(
        local.KIND,
        "each rank's local test distribution: a shard set's manifest "
        "(results/shards/<dataset>/<shard set>/manifest.json) of any partitioner but iid",
        local.check,
        local.EMPTY_FIX,
        local.SCORED,
        names=local.set_names,
        weighs=local.weigh,
    ),
    SetKind(
        domains.KIND,
        "each part of a domains dataset: its record (results/datasets/<dataset>/dataset.json) beside the "
        "test split; the test rows of each part",
        domains.check,
        domains.EMPTY_FIX,
        domains.SCORED,
        names=domains.set_names,
        weighs=domains.weigh,
    ),
)


def set_kind(name: str) -> SetKind:
    return find_record(RECORDS, name, "evaluation set", "pass --set KIND=PATH with a known kind")


def parse_set(text: str) -> tuple[SetKind, Path]:
    """``KIND=PATH`` from the command line: the kind's record and the path."""
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise UserError(
            f"--set {text!r} is not KIND=PATH; pass e.g. --set test=results/datasets/digits/test.parquet"
        )
    return set_kind(name), Path(path)


def expand(requested: list[tuple[SetKind, Path]]) -> list[tuple[SetKind, EvalSet]]:
    """Every named set the requested kinds give, each file checked by its kind; the headline set must be
    among them and no name may repeat."""
    found: list[tuple[SetKind, EvalSet]] = []
    for kind, path in requested:
        kind.check(path)
        found += [(kind, evaluation_set) for evaluation_set in kind.sets(path)]
    names = [evaluation_set.name for _, evaluation_set in found]
    repeated = sorted({name for name in names if names.count(name) > 1})
    if repeated:
        raise UserError(f"evaluation set {repeated[0]!r} is given twice; pass each --set once")
    if HEADLINE not in names:
        raise UserError(
            f"evaluate scores the run on the global test split first: pass --test PATH (or --set "
            f"{HEADLINE}=PATH), the dataset's test.parquet"
        )
    return found
