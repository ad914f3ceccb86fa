"""Per-rank data access: check a shard against its manifest and load Parquet rows as tensors.

No command line; used by training and evaluation, e.g.

    python -c "from shardfuse.data import reader; \\
        print(reader.load_shard('results/shards/digits/w2-seed0', 0)[0].shape)"

Every rank reads only its own shard-{rank}.parquet. Its input layout (``shardfuse.data.shard_format``) sets
what a batch holds: numeric columns x0..x{F-1} give float32 [N, F], a tensor column ``x`` float32
[N, *shape] (e.g. images [N, 1, 8, 8]), a ``tokens`` column int64 [N, block_size + 1]; targets are the
``label`` column (int64 [N]), y0..y{K-1} (float32 [N, K]) or none (float32 [N, 0]).

Two ways to feed training: :func:`load_shard` (the whole shard in memory) and :class:`ShardReader`
(row groups streamed by a background thread; the first batch after one row group, memory flat in the
shard size). Figures: bench/RESULTS.md (bench/reader.py). The shard is checked against its manifest by
:func:`shardfuse.data.verify.verify_shard`; the normalisation statistics come from the manifest
(:mod:`shardfuse.data.moments`), dataset.json from :func:`shardfuse.data.dataset_info.read_dataset_info`.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from shardfuse.data.batches import rebatch, truncated
from shardfuse.data.epoch_steps import split_sizes
from shardfuse.data.manifest import RERUN_PARTITION, read_manifest
from shardfuse.data.shard_format import (
    REMAKE,
    ShardLayout,
    checked_values,
    list_values,
    open_parquet,
    prefetched,
    read_batches,
    read_layout,
    shard_name,
)
from shardfuse.data.verify import verify_shard
from shardfuse.io import UserError, error_reason, sha256_file


def num_features(path: str | Path) -> int:
    """Input values per row of a prepared Parquet file: F numeric columns, the size of a tensor, or the
    tokens of a block (block_size + 1); reads the footer only."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        return math.prod(read_layout(parquet_file, path).row_shape)


# A row's input as a model gets it: float32 numbers or tensors, int64 token ids (embedding tables
# take int64). Token blocks stay in their stored type (uint16 or int32) in windows and the cache, a
# quarter or half of int64's memory, and are widened per batch.
_BATCH_DTYPES = {"numeric": torch.float32, "tensor": torch.float32, "tokens": torch.int64}
# Types torch gathers (index_select) and widens; other integer token types are widened on read.
_TOKEN_STORAGE = {"uint8", "int16", "uint16", "int32", "int64"}


def _storage_dtype(layout: ShardLayout) -> np.dtype:
    """What the reader keeps a row's input in between the file and the batch."""
    if layout.kind == "tokens" and layout.features[0].dtype in _TOKEN_STORAGE:
        return np.dtype(layout.features[0].dtype)
    return np.dtype(np.int64 if layout.kind == "tokens" else np.float32)


def _empty_targets(layout: ShardLayout, num_rows: int) -> np.ndarray:
    """Targets by task: int64 [N] class indices, float32 [N, K] regression targets, float32 [N, 0] for
    token blocks (the targets are the next tokens; the empty array keeps every batch a pair), uint8
    [N, block_size] for token blocks with a loss mask (1: the next token counts)."""
    if layout.is_label:
        return np.empty(num_rows, dtype=np.int64)
    if layout.is_mask:
        return np.empty((num_rows, *layout.targets[0].shape), dtype=np.uint8)
    return np.empty((num_rows, len(layout.targets)), dtype=np.float32)


def _fill_rows(
    features: np.ndarray, labels: np.ndarray, data: pa.Table | pa.RecordBatch, layout: ShardLayout, path: Path
) -> None:
    """Copy one Arrow chunk into ``features`` [n, *row_shape] and ``labels`` (see :func:`_empty_targets`).

    Arrow stores columns and a model wants rows: numeric columns cost one copy per value, column by
    column; a tensor or token column is one block copy of a zero-copy view. No Python loop over rows."""
    if layout.kind == "numeric":
        for j, spec in enumerate(layout.features):
            features[:, j] = checked_values(data.column(spec.name), spec.name, path)
    else:
        features[...] = list_values(data.column(layout.features[0].name), layout.features[0], path)
    if layout.is_mask:
        labels[...] = list_values(data.column(layout.targets[0].name), layout.targets[0], path)
        return
    for j, spec in enumerate(layout.targets):
        values = checked_values(data.column(spec.name), spec.name, path)
        if layout.is_label:
            labels[:] = values
        else:
            labels[:, j] = values


def load_table(path: str | Path, batch_size: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a prepared Parquet file as (inputs, targets): inputs float32 [N, F] (numeric), float32
    [N, *shape] (tensor) or int64 [N, block_size + 1] (tokens); targets int64 [N] class indices,
    float32 [N, K] regression targets, or float32 [N, 0] for token blocks.

    Reading batch by batch into preallocated arrays keeps peak memory at those arrays plus one batch;
    torch.from_numpy then shares the arrays' memory."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        layout = read_layout(parquet_file, path)
        num_rows = parquet_file.metadata.num_rows
        features = torch.empty((num_rows, *layout.row_shape), dtype=_BATCH_DTYPES[layout.kind]).numpy()
        labels = _empty_targets(layout, num_rows)
        offset = 0
        columns = [*layout.feature_names, *layout.target_names]
        for batch in read_batches(
            parquet_file, f"data file {path}", REMAKE, batch_size=batch_size, columns=columns
        ):
            end = offset + batch.num_rows
            _fill_rows(features[offset:end], labels[offset:end], batch, layout, path)
            offset = end
    return torch.from_numpy(features), torch.from_numpy(labels)


class _Verification:
    """A shard's sha256 computed in a background thread (hashlib releases the GIL), so checking it
    overlaps with reading instead of costing a full extra read before the first batch."""

    def __init__(self, path: Path, rank: int, expected: str) -> None:
        self.path, self.rank, self.expected = path, rank, expected
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="shardfuse-verify")
        self.digest = self.executor.submit(sha256_file, path)
        self.executor.shutdown(wait=False)

    def check(self) -> None:
        if self.digest.result() != self.expected:
            raise UserError(
                f"shard of rank {self.rank} ({self.path}) does not match its sha256 in the manifest; "
                f"{RERUN_PARTITION}"
            )


def _open_shard(shard_dir: str | Path, rank: int, verify: bool) -> tuple[dict, Path, _Verification | None]:
    """Manifest, checked shard path (existence, size, name) and, if ``verify``, a running checksum."""
    manifest = read_manifest(shard_dir)
    path = verify_shard(shard_dir, rank, manifest, checksum=False)
    if path.name != shard_name(rank):
        raise UserError(f"shard manifest in {shard_dir} names {path.name} for rank {rank}; {RERUN_PARTITION}")
    verification = _Verification(path, rank, manifest["shards"][rank]["sha256"]) if verify else None
    return manifest, path, verification


def load_shard(shard_dir: str | Path, rank: int, verify: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Load rank's shard as (features, labels); touches only manifest.json and shard-{rank}.parquet.

    ``verify`` adds the sha256 check, computed while the shard loads; existence and size are always
    checked first."""
    _, path, verification = _open_shard(shard_dir, rank, verify)
    try:
        loaded = load_table(path)
    except Exception:
        # A damaged file usually fails to decode before the checksum is done: report the mismatch.
        if verification is not None:
            verification.check()
        raise
    if verification is not None:
        verification.check()
    return loaded


CACHE_BLOCK_ROWS = 8192  # rows gathered at once from the in-memory copy (cached epochs): 1 MB at 32 floats


class ShardReader:
    """Stream one rank's shard as shuffled mini-batches, one Parquet row group at a time::

        with ShardReader("results/shards/digits/w2-seed0", rank=0, seed=0) as reader:
            for epoch in range(num_epochs):
                for features, labels in reader.epoch(epoch, num_batches):
                    ...

    Why not :func:`load_shard`: it reads (and checksums) the whole shard before the first step and
    holds it all in memory. Here a background thread reads, converts and shuffles the next row groups
    while the caller trains, so the first batch is ready after one row group, and memory holds a
    shuffle window (``window_row_groups`` row groups) plus ``prefetch`` windows, whatever the shard size.

    Shuffling: every epoch visits the row groups in a new seeded order and shuffles the rows within
    each window (a shuffle buffer, as tf.data and webdataset do). Partition assigns rows to ranks at
    random, but keeps the input's order within a shard: if the input is sorted (e.g. by label), raise
    ``window_row_groups`` or use ``cache=True``. With ``cache=True`` epoch 0 streams and keeps what it
    reads, and epochs >= 1 draw a full random permutation of the shard from memory: load_shard's
    shuffle and memory, without its wait for the first batch.

    Batches are (inputs, targets) as :func:`load_table` gives them (float32 [B, F] or [B, *shape],
    int64 [B, block_size + 1] token ids). Token blocks stay in their stored type in memory (the cache
    of a uint16 corpus is a quarter of int64's) and are widened one batch at a time.

    An epoch may take fewer rows than the shard has (``num_rows``: the first rows of its order, so the
    next epoch's new order reaches others) or more: it cycles, each further pass over the shard in a new
    seeded order (from memory with ``cache=True``; :mod:`shardfuse.data.epoch_steps` says when).

    The batches depend only on (seed, epoch, num_batches, num_rows, cache), never on what ran before in
    this process, so a run resumed mid-epoch (``start_batch``) sees the batches of an uninterrupted one.
    ``verify`` checks the shard's sha256 in a background thread; a mismatch raises UserError when the
    first epoch ends, before the caller can save anything trained on it.
    """

    def __init__(
        self,
        shard_dir: str | Path,
        rank: int,
        *,
        seed: int = 0,
        window_row_groups: int = 4,
        prefetch: int = 2,
        cache: bool = False,
        verify: bool = True,
    ) -> None:
        self.rank = rank
        self.manifest, self.path, self._verification = _open_shard(shard_dir, rank, verify)
        self.seed, self.window_row_groups, self.prefetch = seed, max(1, window_row_groups), max(1, prefetch)
        self._file = open_parquet(self.path, "shard", RERUN_PARTITION)
        self.layout = read_layout(self._file, self.path)
        self._storage_dtype = _storage_dtype(self.layout)
        self._batch_dtype = _BATCH_DTYPES[self.layout.kind]
        metadata = self._file.metadata
        self.num_rows = metadata.num_rows
        self.num_features = math.prod(self.layout.row_shape)
        group_rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self._group_offsets = np.concatenate([[0], np.cumsum(group_rows, dtype=np.int64)])
        self._cache: tuple[np.ndarray, np.ndarray] | None = None
        if cache:
            self._cache = (
                np.empty((self.num_rows, *self.layout.row_shape), dtype=self._storage_dtype),
                _empty_targets(self.layout, self.num_rows),
            )
        self._cache_complete = False
        self._order_key: list[int] | None = None  # the pass whose order _order holds
        self._order = np.empty(0, dtype=np.int64)

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def epoch(
        self, epoch: int, num_batches: int, start_batch: int = 0, num_rows: int | None = None
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches: exactly ``num_batches`` of them over ``num_rows`` rows (default: the
        shard's), sized like torch.tensor_split, from batch ``start_batch`` on (resuming mid-epoch: the
        batches are the ones an uninterrupted epoch would have given, and skipped row groups are not
        read)."""
        rows = self.num_rows if num_rows is None else num_rows
        if not 1 <= num_batches <= rows or (rows > self.num_rows and not self.num_rows):
            raise UserError(
                f"{num_batches} batches per epoch do not fit the {rows} rows of an epoch of {self.path} "
                f"({self.num_rows} rows); use a batch size that gives between 1 and that many batches"
            )
        if not 0 <= start_batch <= num_batches:
            raise UserError(f"start batch {start_batch} is outside the epoch's {num_batches} batches")
        sizes = split_sizes(rows, num_batches)
        try:
            if self._cache is not None and epoch > 0:
                self._complete_cache()
                yield from self._cached_batches(epoch, sizes, start_batch)
            else:
                skip_rows = sum(sizes[:start_batch])
                windows = prefetched(self._epoch_windows(epoch, rows, skip_rows), self.prefetch)
                yield from rebatch(windows, sizes[start_batch:], self.path, self._batch_dtype)
        except UserError:
            # A damaged file usually fails to decode before its checksum is done: report the mismatch.
            if self._verification is not None:
                self._verification.check()
            raise
        if self._verification is not None:
            self._verification.check()
            self._verification = None

    def _complete_cache(self) -> None:
        """Every row in memory (epoch 0 stopped early or was resumed: the batches must not depend on it)."""
        if not self._cache_complete:
            self._read_window(np.arange(len(self._group_offsets) - 1), self.num_rows)
            self._cache_complete = True

    def _pass_order(self, epoch: int, index: int) -> np.ndarray:
        """The order of the epoch's pass ``index`` over the cached shard (pass 0: what every epoch >= 1
        was before epochs could cycle)."""
        key = [self.seed, epoch, 2] if index == 0 else [self.seed, epoch, 2, index]
        if self._order_key != key:
            self._order_key, self._order = key, np.random.default_rng(key).permutation(self.num_rows)
        return self._order

    def _epoch_order(self, epoch: int, start: int, stop: int) -> np.ndarray:
        """Positions ``start`` to ``stop`` of the epoch's sequence of cached rows: its passes one after
        another."""
        parts = []
        for index in range(start // self.num_rows, -(-stop // self.num_rows)):
            offset = index * self.num_rows
            lo, hi = max(start, offset) - offset, min(stop, offset + self.num_rows) - offset
            parts.append(self._pass_order(epoch, index)[lo:hi])
        return parts[0] if len(parts) == 1 else np.concatenate(parts)

    def _epoch_windows(
        self, epoch: int, rows: int, skip_rows: int
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Runs in the prefetch thread: the epoch's rows after its first ``skip_rows``, as windows. Its
        first pass (at most the shard) streams; further passes come from memory with ``cache``, else
        stream again in their own order."""
        first_pass = min(rows, self.num_rows)
        if skip_rows < first_pass:
            yield from truncated(self._shuffled_windows(epoch, skip_rows), first_pass - skip_rows)
            # Every row group was read (and kept) once a whole first pass streamed from its start.
            self._cache_complete |= self._cache is not None and skip_rows == 0 and rows >= self.num_rows
        for index in range(1, -(-rows // self.num_rows)):
            start, stop = max(skip_rows, index * self.num_rows), min(rows, (index + 1) * self.num_rows)
            if start >= stop:
                continue
            if self._cache is None:
                offset = index * self.num_rows
                yield from truncated(self._shuffled_windows(epoch, start - offset, index), stop - start)
                continue
            self._complete_cache()
            for first in range(start, stop, CACHE_BLOCK_ROWS):
                order = self._epoch_order(epoch, first, min(stop, first + CACHE_BLOCK_ROWS))
                yield self._cache[0][order], self._cache[1][order]

    def _cached_batches(
        self, epoch: int, sizes: list[int], start_batch: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        features, labels = (torch.from_numpy(array) for array in self._cache)
        bounds = [0, *itertools.accumulate(sizes)]
        # The rows of several batches are gathered at once (index_select, not fancy indexing: the same
        # gather, faster on CPU) and handed out as contiguous views: one call per block instead of two
        # per batch, and the random reads of a block overlap in the memory system. Batch by batch this
        # gather was a visible share of a small model's step; the reader's share as it is now (cached
        # epochs included) is bench/reader.py's "wait share", figures in bench/RESULTS.md.
        per_block = max(1, CACHE_BLOCK_ROWS // max(1, max(sizes)))
        for first in range(start_batch, len(sizes), per_block):
            last = min(first + per_block, len(sizes))
            rows = torch.from_numpy(self._epoch_order(epoch, bounds[first], bounds[last]))
            block_features, block_labels = features.index_select(0, rows), labels.index_select(0, rows)
            for index in range(first, last):
                start, stop = bounds[index] - bounds[first], bounds[index + 1] - bounds[first]
                yield block_features[start:stop].to(self._batch_dtype), block_labels[start:stop]

    def _shuffled_windows(
        self, epoch: int, skip_rows: int, pass_index: int = 0
    ) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Runs in the prefetch thread: read, convert and shuffle one window of row groups at a time;
        the first ``skip_rows`` rows of the pass are left out (whole windows without reading them).
        Pass 0 is every epoch's first; a cycling epoch's later passes (without cache) have their own keys."""
        again = [pass_index] if pass_index else []
        num_groups = len(self._group_offsets) - 1
        group_order = np.random.default_rng([self.seed, epoch, 0, *again]).permutation(num_groups)
        group_rows = np.diff(self._group_offsets)
        # The first window is a single row group, so the first batch waits for one read only.
        bounds = sorted({0, *range(1, len(group_order), self.window_row_groups), len(group_order)})
        window_start = 0
        for index, (first, stop) in enumerate(itertools.pairwise(bounds)):
            groups = group_order[first:stop]
            size = int(group_rows[groups].sum())
            window_start += size
            if window_start <= skip_rows:
                continue
            features, labels = self._read_window(groups, size)
            order = np.random.default_rng([self.seed, epoch, 1, index, *again]).permutation(size)
            drop = max(0, skip_rows - (window_start - size))
            yield features[order[drop:]], labels[order[drop:]]

    def _read_window(self, groups: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        features = np.empty((size, *self.layout.row_shape), dtype=self._storage_dtype)
        labels = _empty_targets(self.layout, size)
        columns = [*self.layout.feature_names, *self.layout.target_names]
        offset = 0
        for group in groups:
            try:
                table = self._file.read_row_group(int(group), columns=columns, use_threads=False)
            except (pa.ArrowException, OSError) as exc:
                raise UserError(
                    f"shard of rank {self.rank} ({self.path}) could not be read ({error_reason(exc)}); "
                    f"{RERUN_PARTITION}"
                ) from None
            end = offset + table.num_rows
            expected = self._group_offsets[group + 1] - self._group_offsets[group]
            if table.num_rows != expected:
                raise UserError(
                    f"row group {group} of the shard of rank {self.rank} ({self.path}) has "
                    f"{table.num_rows} rows, its footer says {expected}; {RERUN_PARTITION}"
                )
            _fill_rows(features[offset:end], labels[offset:end], table, self.layout, self.path)
            if self._cache is not None:
                start = self._group_offsets[group]
                self._cache[0][start : start + table.num_rows] = features[offset:end]
                self._cache[1][start : start + table.num_rows] = labels[offset:end]
            offset = end
        return features, labels
