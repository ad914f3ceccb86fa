"""Normalisation statistics from the shard manifest: the mean and std of numeric columns over every
shard, from the column moments partition recorded (``ShardWriter.column_moments`` in
:mod:`shardfuse.data.shard_writer`), so every rank has the same statistics without a pass over the data
or a collective.
"""

from __future__ import annotations

import numpy as np
import torch


def feature_stats(manifest: dict, num_features: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mean and (population) std of x0..x{F-1} over every shard, from the column moments partition
    recorded in the manifest: no pass over the data and no collective, and the same on every rank.

    None when the manifest has no moments (made by an older partition) or a sum is not finite; the
    caller then computes the statistics from the data."""
    return column_stats(manifest, [f"x{j}" for j in range(num_features)])


def column_stats(manifest: dict, names: list[str]) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Mean and (population) std of the numeric columns ``names`` from the manifest's moments (see
    :func:`feature_stats`); regression targets use it for their scale."""
    count, total, squares = np.zeros(len(names)), np.zeros(len(names)), np.zeros(len(names))
    for shard in manifest["shards"]:
        moments = shard.get("column_moments")
        if not isinstance(moments, dict):
            return None
        for j, name in enumerate(names):
            entry = moments.get(name)
            if not isinstance(entry, dict) or entry.get("sum") is None or entry.get("sum_squares") is None:
                return None
            count[j] += entry["count"]
            total[j] += entry["sum"]
            squares[j] += entry["sum_squares"]
    if not count.all():
        return None
    mean = total / count
    std = np.sqrt(np.clip(squares / count - mean**2, 0.0, None))
    return torch.from_numpy(mean).float(), torch.from_numpy(std).float()
