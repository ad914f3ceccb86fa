"""Greedy soup (Wortsman et al. 2022, Algorithm 1), the one merge method that builds the model: ranks in
order of their own validation score, each added to the uniform soup if the soup's validation score does
not get worse. Candidates are merged by the streaming engine, one in memory at a time. The merge stage
calls :func:`greedy_soup` for ``--method greedy_soup``, once it has checked the validation split
against dataset.json (``shardfuse.data.verify.check_split``: never the test split).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardfuse.checkpoints.stream import SafetensorsReader, file_order
from shardfuse.fusion.engine import BLOCK_BYTES, Engine, MemorySink
from shardfuse.io import UserError


def greedy_soup(
    readers: list[SafetensorsReader],
    rank_numbers: list[int],
    spec: dict[str, Any],
    val_split: Path,
    batch_size: int,
    block_bytes: int = BLOCK_BYTES,
) -> dict[str, Any]:
    """Wortsman et al. 2022, Algorithm 1: sort ranks by their own validation score (the task's: accuracy,
    or mse / loss where lower is better), then add each to the soup (a uniform mean) if the soup's
    validation score does not get worse (ties accepted, as in the paper).

    Candidates are merged from the files as the engine would write them, one in memory at a time."""
    from shardfuse.data.reader import load_table  # deferred: these import torch
    from shardfuse.models.registry import normalized_spec, score_state_dict
    from shardfuse.models.tasks import task_for

    features, labels = load_table(val_split)
    if labels.shape[0] == 0:
        raise UserError(
            f"validation split {val_split} has no rows; greedy_soup needs one — set the dataset's "
            "val_fraction > 0 (e.g. 0.1)"
        )
    task = task_for(normalized_spec(spec)["task"])
    tensors = readers[0].tensors
    names = file_order({name: (t.dtype.name, list(t.shape)) for name, t in tensors.items()})

    def score(indices: list[int]) -> float:
        sink = MemorySink(tensors)
        engine = Engine(
            [readers[i] for i in indices],
            None,
            "greedy_soup",
            {},
            [rank_numbers[i] for i in indices],
            block_bytes=block_bytes,
        )
        engine.run(names, sink)
        return score_state_dict(sink.tensors_for_torch(), spec, features, labels, batch_size)[task.score]

    alone = [score([index]) for index in range(len(readers))]
    order = sorted(range(len(readers)), key=lambda index: (task.sort_key(alone[index]), index))
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
    return {
        "val_split": str(val_split),
        "val_rows": int(labels.shape[0]),
        "score": task.score,
        "lower_is_better": task.lower_is_better,
        f"val_{task.score}": alone,
        "order": [rank_numbers[index] for index in order],
        "steps": steps,
        "selected": sorted(rank_numbers[index] for index in soup),
        key: best,
    }
