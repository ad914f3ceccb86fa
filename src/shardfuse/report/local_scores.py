"""The fusion figure's second panel for a run of a non-iid shard set: on each rank's own test distribution
(eval.json's local scores, :mod:`shardfuse.scoring.local`), the merged model beside that rank's own model,
titled with ``normalized_<score>`` (1.0: the merged model is as good as every rank on its own data).

A library, no command line: the plots stage draws it into ``fusion.png``
(:func:`shardfuse.plots.fusion_figure`).
"""

from __future__ import annotations

from typing import NamedTuple

from shardfuse.models.tasks import Task
from shardfuse.report.figures import MERGED_COLOR, RANK_COLOR, number, score_label, zoomed_limits


class LocalPoints(NamedTuple):
    """Per rank (in rank order): the merged model's and the rank's own model's local score (None: the
    rank's model was lost), and the run's normalized score (None where eval.json has none)."""

    ranks: list[int]
    merged: list[float]
    own: list[float | None]
    normalized: float | None


def local_points(local: dict[str, float], score: str) -> LocalPoints | None:
    """The panel's figures from eval.json's local keys; None for a run without them (iid shard sets)."""
    prefix = f"local_{score}_merged_rank_"
    ranks = sorted(int(key.removeprefix(prefix)) for key in local if key.startswith(prefix))
    if not ranks:
        return None
    return LocalPoints(
        ranks,
        [float(local[f"{prefix}{rank}"]) for rank in ranks],
        [local.get(f"local_{score}_rank_{rank}") for rank in ranks],
        local.get(f"normalized_{score}"),
    )


def local_panel(ax, task: Task, points: LocalPoints) -> None:
    """A pair of dots per rank, its own model's and the merged model's score on that rank's test
    distribution, joined by a line; the axis zoomed to them."""
    for x, (merged, own) in enumerate(zip(points.merged, points.own, strict=True)):
        if own is not None:
            ax.plot([x, x], [own, merged], color=RANK_COLOR, linewidth=1, zorder=1)
    own_x = [x for x, own in enumerate(points.own) if own is not None]
    ax.scatter(
        own_x, [points.own[x] for x in own_x], s=60, color=RANK_COLOR, zorder=3, label="rank's own model"
    )
    ax.scatter(range(len(points.ranks)), points.merged, s=60, color=MERGED_COLOR, zorder=3, label="merged")
    values = points.merged + [own for own in points.own if own is not None]
    low, high = zoomed_limits(values, margin=0.1)
    ax.set_ylim(low, high)
    ax.set_xlim(-0.6, len(points.ranks) - 0.4)
    ax.set_xticks(range(len(points.ranks)), [f"rank {rank}" for rank in points.ranks])
    ax.set_ylabel(f"local {score_label(task).removeprefix('test ')}")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize="small")
    normalized = "" if points.normalized is None else f"\nnormalized {task.score} {number(points.normalized)}"
    ax.set_title(f"on each rank's own test data{normalized}", fontsize="medium")
