"""Cutting a stream of shuffled windows of a shard (:class:`shardfuse.data.reader.ShardReader`'s) into
batches of given sizes, and an epoch's stream that ends before the shard does.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from shardfuse.data.manifest import RERUN_PARTITION
from shardfuse.io import UserError


def truncated(
    windows: Iterator[tuple[np.ndarray, np.ndarray]], num_rows: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """The first ``num_rows`` rows of ``windows`` (an epoch that stops before the shard's end); no
    window is read past them."""
    if num_rows <= 0:
        return
    for features, labels in windows:
        yield features[:num_rows], labels[:num_rows]
        num_rows -= len(labels)
        if num_rows <= 0:
            return


def rebatch(
    windows: Iterator[tuple[np.ndarray, np.ndarray]], sizes: list[int], path: Path, dtype: torch.dtype
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a stream of shuffled windows into batches of ``sizes`` of inputs in ``dtype``; a batch inside
    one window is a view (no copy, unless token ids are widened), one spanning two windows is stitched
    together."""
    features = np.empty(0, dtype=np.float32)
    labels = np.empty(0, dtype=np.int64)
    position = 0
    for size in sizes:
        if position + size <= len(labels):
            batch_features, batch_labels = (
                features[position : position + size],
                labels[position : position + size],
            )
            position += size
        else:
            have = len(labels) - position
            parts_f, parts_l = ([features[position:]], [labels[position:]]) if have else ([], [])
            while have < size:
                window = next(windows, None)
                if window is None:
                    raise UserError(f"shard {path} has fewer rows than its footer says; {RERUN_PARTITION}")
                features, labels = window
                take = min(size - have, len(labels))
                parts_f.append(features[:take])
                parts_l.append(labels[:take])
                have += take
                position = take
            batch_features, batch_labels = np.concatenate(parts_f), np.concatenate(parts_l)
        yield torch.from_numpy(batch_features).to(dtype), torch.from_numpy(batch_labels)
    if next(windows, None) is not None:
        raise UserError(f"shard {path} has more rows than its footer says; {RERUN_PARTITION}")
