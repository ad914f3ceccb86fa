"""Greedy soup (Wortsman et al. 2022, Algorithm 1), the selection behaviour of the greedy_soup record
(``select`` in shardfuse.fusion.methods.registry): ranks in order of their own validation score, each added
to the uniform soup if the soup's validation score does not get worse.

A selection gets the candidates' rank numbers, a way to merge any subset of them in memory (the merge path
runs the streaming engine into a MemorySink, one candidate in memory at a time) and a scorer on the
validation split (shardfuse.scoring.scorer.Scorer, which the merge path builds once the split is checked
against dataset.json: never the test split). It imports neither the engine nor torch, so the registry that
names it stays light.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from shardfuse.scoring.scorer import Scorer

# Merges the candidates at these indices (into the rank-number list) in memory: the weights to score.
MergeOf = Callable[[list[int]], Mapping[str, Any]]


@dataclass(frozen=True)
class Selection:
    """What a selection chose: the indices of the ranks that go in, each candidate's weight in the
    merge (0 for those left out; merge.json's ``weights``), and what merge.json records under the method's
    name (its ``greedy_soup`` entry)."""

    indices: list[int]
    weights: list[float]
    record: dict[str, Any]


Select = Callable[[Sequence[int], MergeOf, "Scorer"], Selection]


def greedy_soup(rank_numbers: Sequence[int], merge_of: MergeOf, scorer: Scorer) -> Selection:
    """Wortsman et al. 2022, Algorithm 1: sort ranks by their own validation score (the task's: accuracy,
    or mse / loss where lower is better), then add each to the soup (a uniform mean) if the soup's
    validation score does not get worse (ties accepted, as in the paper)."""
    task = scorer.task

    def score(indices: list[int]) -> float:
        return scorer.score(merge_of(indices))[task.score]

    alone = [score([index]) for index in range(len(rank_numbers))]
    order = sorted(range(len(rank_numbers)), key=lambda index: (task.sort_key(alone[index]), index))
    soup, best = [order[0]], alone[order[0]]
    key = f"soup_val_{task.score}"
    steps = [{"rank": rank_numbers[order[0]], key: best, "accepted": True}]
    for index in order[1:]:
        candidate = score(sorted([*soup, index]))
        accepted = task.better(candidate, best)
        steps.append({"rank": rank_numbers[index], key: candidate, "accepted": accepted})
        if accepted:
            soup.append(index)
            best = candidate
    record = {
        "val_split": str(scorer.split.path),
        "val_rows": scorer.split.rows,
        "score": task.score,
        "lower_is_better": task.lower_is_better,
        f"val_{task.score}": alone,
        "order": [rank_numbers[index] for index in order],
        "steps": steps,
        "selected": sorted(rank_numbers[index] for index in soup),
        key: best,
    }
    chosen = sorted(soup)
    weights = [1 / len(chosen) if index in chosen else 0.0 for index in range(len(rank_numbers))]
    return Selection(chosen, weights, record)
