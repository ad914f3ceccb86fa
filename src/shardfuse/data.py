"""Per-rank data access: check a shard against its manifest and load Parquet rows as tensors.

No command line; used by training and evaluation, e.g.

    python -c "import shardfuse.data as d; print(d.load_shard('results/shards/digits/w2-seed0', 0)[0].shape)"

Every rank reads only its own shard-{rank}.parquet. Feature columns are x0..x{F-1} (float32 tensor [N, F]),
labels the ``label`` column (int64 tensor [N]), as written by ``shardfuse.prepare``.

Two ways to feed training: :func:`load_shard` (the whole shard in memory) and :class:`ShardReader`
(row groups streamed by a background thread; the first batch after one row group, memory flat in the
shard size). :func:`feature_stats` gives the normalisation statistics from the manifest, without a
pass over the data. Figures: bench/RESULTS.md (bench/reader.py).
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import torch

from shardfuse.io import UserError, error_reason, read_json, sha256_file
from shardfuse.manifest import RERUN_PARTITION, read_manifest
from shardfuse.shard_format import (
    LABEL_COLUMN,
    column_values,
    open_parquet,
    prefetched,
    read_batches,
    shard_name,
)

FEATURE_COLUMN = re.compile(r"x(0|[1-9][0-9]*)")  # no leading zeros: x01 is not feature 1
REMAKE = "re-create it with the prepare (or partition) stage"
DATASET_KEYS = (
    "name",
    "source",
    "num_features",
    "num_classes",
    "feature_names",
    "label_names",
    "rows",
    "test_fraction",
    "seed",
    "sha256",
)


def verify_shard(shard_dir: str | Path, rank: int, manifest: dict, checksum: bool = True) -> Path:
    """Return the path of rank's shard after checking it exists and matches the manifest's size and
    (if ``checksum``, which costs a full read) sha256."""
    world_size = manifest["world_size"]
    if not 0 <= rank < world_size:
        raise UserError(
            f"rank {rank} has no shard: {shard_dir} holds {world_size} shards (world size "
            f"{world_size}); partition for the world size you launch with"
        )
    entry = manifest["shards"][rank]
    path = Path(shard_dir) / entry["path"]
    if not path.is_file():
        raise UserError(f"shard of rank {rank} ({path}) is missing; {RERUN_PARTITION}")
    size = path.stat().st_size
    if size != entry["bytes"]:
        raise UserError(
            f"shard of rank {rank} ({path}) has {size} bytes, manifest says {entry['bytes']}; "
            f"{RERUN_PARTITION}"
        )
    if checksum and sha256_file(path) != entry["sha256"]:
        raise UserError(
            f"shard of rank {rank} ({path}) does not match its sha256 in the manifest; {RERUN_PARTITION}"
        )
    return path


def feature_columns(schema: pa.Schema, path: str | Path) -> list[str]:
    """Names x0..x{F-1} in numeric order (x10 after x9); UserError if none or one is missing."""
    indices = sorted(
        int(match.group(1)) for name in schema.names if (match := FEATURE_COLUMN.fullmatch(name))
    )
    if not indices:
        raise UserError(
            f"{path} has no feature columns x0, x1, ... (columns found: {', '.join(schema.names)}); {REMAKE}"
        )
    missing = sorted(set(range(indices[-1] + 1)) - set(indices))
    if missing:
        raise UserError(
            f"{path} lacks feature column(s) {', '.join(f'x{i}' for i in missing[:10])}; {REMAKE}"
        )
    return [f"x{i}" for i in indices]


def num_features(path: str | Path) -> int:
    """Number of feature columns of a prepared Parquet file (reads the footer only)."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        return len(feature_columns(parquet_file.schema_arrow, path))


TARGET_COLUMN = re.compile(r"y(0|[1-9][0-9]*)")


@dataclass(frozen=True)
class TargetColumns:
    """The columns a split's targets come from, by task: ``label`` (classification: int64 [N]),
    ``y0..y{K-1}`` (regression: float32 [N, K]) or none (causal_lm: the targets are the next tokens of
    the inputs; an empty float32 [N, 0] stands in, so every batch is still an (inputs, targets) pair)."""

    names: tuple[str, ...]

    @property
    def is_label(self) -> bool:
        return self.names == (LABEL_COLUMN,)

    def empty(self, num_rows: int) -> np.ndarray:
        if self.is_label:
            return np.empty(num_rows, dtype=np.int64)
        return np.empty((num_rows, len(self.names)), dtype=np.float32)


def target_columns(schema: pa.Schema) -> TargetColumns:
    if LABEL_COLUMN in schema.names:
        return TargetColumns((LABEL_COLUMN,))
    indices = sorted(int(match.group(1)) for name in schema.names if (match := TARGET_COLUMN.fullmatch(name)))
    return TargetColumns(tuple(f"y{i}" for i in indices))


def _table_columns(schema: pa.Schema, path: Path) -> tuple[list[str], TargetColumns]:
    """Feature column names in order and the target columns, after checking their types."""
    names = feature_columns(schema, path)
    targets = target_columns(schema)
    for name in [*names, *targets.names]:
        kind = schema.field(name).type
        if not (pa.types.is_integer(kind) or (name != LABEL_COLUMN and pa.types.is_floating(kind))):
            expected = "an integer" if name == LABEL_COLUMN else "a number"
            raise UserError(f"column {name!r} of {path} has type {kind}, expected {expected}; {REMAKE}")
    return names, targets


def _fill_rows(
    features: np.ndarray,
    labels: np.ndarray,
    data: pa.Table | pa.RecordBatch,
    names: list[str],
    targets: TargetColumns,
    path: Path,
) -> None:
    """Copy one Arrow chunk into row-major ``features`` [n, F] (float32) and ``labels`` (int64 [n] or
    float32 [n, K], see :class:`TargetColumns`).

    Arrow stores columns and a model wants rows, so this one copy per value is unavoidable; NumPy
    does it column by column without a Python loop over rows."""
    for j, name in enumerate([*names, *targets.names]):
        column = data.column(name)
        if column.null_count:
            raise UserError(f"column {name!r} of {path} has {column.null_count} missing value(s); {REMAKE}")
        if targets.is_label and name == LABEL_COLUMN:
            labels[:] = column_values(column)
        elif j >= len(names):
            labels[:, j - len(names)] = column_values(column)
        else:
            features[:, j] = column_values(column)


def load_table(path: str | Path, batch_size: int = 65536) -> tuple[torch.Tensor, torch.Tensor]:
    """Read a prepared Parquet file as (features float32 [N, F], targets: int64 [N] class indices,
    float32 [N, K] regression targets, or float32 [N, 0] for token blocks).

    Reading batch by batch into preallocated arrays keeps peak memory at those arrays plus one batch;
    torch.from_numpy then shares the arrays' memory."""
    path = Path(path)
    with open_parquet(path, "data file", REMAKE) as parquet_file:
        names, targets = _table_columns(parquet_file.schema_arrow, path)
        num_rows = parquet_file.metadata.num_rows
        features = np.empty((num_rows, len(names)), dtype=np.float32)
        labels = targets.empty(num_rows)
        offset = 0
        for batch in read_batches(
            parquet_file, f"data file {path}", REMAKE, batch_size=batch_size, columns=[*names, *targets.names]
        ):
            end = offset + batch.num_rows
            _fill_rows(features[offset:end], labels[offset:end], batch, names, targets, path)
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


CACHE_BLOCK_ROWS = 8192  # rows gathered at once from the in-memory copy (cached epochs): 1 MB at 32 floats


def split_sizes(num_rows: int, num_batches: int) -> list[int]:
    """Batch sizes of one epoch, as torch.tensor_split(range(num_rows), num_batches) cuts it."""
    base, extra = divmod(num_rows, num_batches)
    return [base + 1] * extra + [base] * (num_batches - extra)


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

    The batches depend only on (seed, epoch, num_batches, cache), never on what ran before in this
    process, so a run resumed mid-epoch (``start_batch``) sees the batches of an uninterrupted one.
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
        self.names, self.targets = _table_columns(self._file.schema_arrow, self.path)
        metadata = self._file.metadata
        self.num_rows = metadata.num_rows
        self.num_features = len(self.names)
        group_rows = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        self._group_offsets = np.concatenate([[0], np.cumsum(group_rows, dtype=np.int64)])
        self._cache: tuple[np.ndarray, np.ndarray] | None = None
        if cache:
            self._cache = (
                np.empty((self.num_rows, self.num_features), dtype=np.float32),
                self.targets.empty(self.num_rows),
            )
        self._cache_complete = False

    def __enter__(self) -> ShardReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def epoch(
        self, epoch: int, num_batches: int, start_batch: int = 0
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        """The epoch's batches: exactly ``num_batches`` of them, sized like torch.tensor_split, from
        batch ``start_batch`` on (resuming mid-epoch: the batches are the ones an uninterrupted epoch
        would have given, and skipped row groups are not read)."""
        if not 1 <= num_batches <= self.num_rows:
            raise UserError(
                f"{num_batches} batches per epoch do not fit the {self.num_rows} rows of {self.path}; "
                "use a batch size that gives between 1 and that many batches"
            )
        if not 0 <= start_batch <= num_batches:
            raise UserError(f"start batch {start_batch} is outside the epoch's {num_batches} batches")
        sizes = split_sizes(self.num_rows, num_batches)
        try:
            if self._cache is not None and epoch > 0:
                if not self._cache_complete:  # resumed after epoch 0: the batches must not depend on that
                    self._read_window(np.arange(len(self._group_offsets) - 1), self.num_rows)
                    self._cache_complete = True
                yield from self._cached_batches(epoch, sizes, start_batch)
            else:
                skip_rows = sum(sizes[:start_batch])
                windows = prefetched(self._shuffled_windows(epoch, skip_rows), self.prefetch)
                yield from _rebatch(windows, sizes[start_batch:], self.path)
                self._cache_complete = self._cache is not None and skip_rows == 0
        except UserError:
            # A damaged file usually fails to decode before its checksum is done: report the mismatch.
            if self._verification is not None:
                self._verification.check()
            raise
        if self._verification is not None:
            self._verification.check()
            self._verification = None

    def _cached_batches(
        self, epoch: int, sizes: list[int], start_batch: int
    ) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        features, labels = (torch.from_numpy(array) for array in self._cache)
        order = torch.from_numpy(np.random.default_rng([self.seed, epoch, 2]).permutation(self.num_rows))
        bounds = [0, *itertools.accumulate(sizes)]
        # The rows of several batches are gathered at once (index_select, not fancy indexing: the same
        # gather, faster on CPU) and handed out as contiguous views: one call per block instead of two
        # per batch, and the random reads of a block overlap in the memory system. Batch by batch this
        # gather was a visible share of a small model's step; the reader's share as it is now (cached
        # epochs included) is bench/reader.py's "wait share", figures in bench/RESULTS.md.
        per_block = max(1, CACHE_BLOCK_ROWS // max(1, max(sizes)))
        for first in range(start_batch, len(sizes), per_block):
            last = min(first + per_block, len(sizes))
            rows = order[bounds[first] : bounds[last]]
            block_features, block_labels = features.index_select(0, rows), labels.index_select(0, rows)
            for index in range(first, last):
                start, stop = bounds[index] - bounds[first], bounds[index + 1] - bounds[first]
                yield block_features[start:stop], block_labels[start:stop]

    def _shuffled_windows(self, epoch: int, skip_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
        """Runs in the prefetch thread: read, convert and shuffle one window of row groups at a time;
        the first ``skip_rows`` rows of the epoch are left out (whole windows without reading them)."""
        group_order = np.random.default_rng([self.seed, epoch, 0]).permutation(len(self._group_offsets) - 1)
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
            order = np.random.default_rng([self.seed, epoch, 1, index]).permutation(size)
            drop = max(0, skip_rows - (window_start - size))
            yield features[order[drop:]], labels[order[drop:]]

    def _read_window(self, groups: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
        features = np.empty((size, self.num_features), dtype=np.float32)
        labels = self.targets.empty(size)
        columns = [*self.names, *self.targets.names]
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
            _fill_rows(features[offset:end], labels[offset:end], table, self.names, self.targets, self.path)
            if self._cache is not None:
                start = self._group_offsets[group]
                self._cache[0][start : start + table.num_rows] = features[offset:end]
                self._cache[1][start : start + table.num_rows] = labels[offset:end]
            offset = end
        return features, labels


def _rebatch(
    windows: Iterator[tuple[np.ndarray, np.ndarray]], sizes: list[int], path: Path
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Cut a stream of shuffled windows into batches of ``sizes``; a batch inside one window is a view
    (no copy), one spanning two windows is stitched together."""
    features = np.empty((0, 0), dtype=np.float32)
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
        yield torch.from_numpy(batch_features), torch.from_numpy(batch_labels)
    if next(windows, None) is not None:
        raise UserError(f"shard {path} has more rows than its footer says; {RERUN_PARTITION}")


def read_dataset_info(dataset_dir: str | Path) -> dict:
    """Read dataset_dir/dataset.json (written by prepare): num_features, num_classes, names, rows, ..."""
    path = Path(dataset_dir) / "dataset.json"
    info = read_json(path, "dataset info")
    missing = [key for key in DATASET_KEYS if not isinstance(info, dict) or key not in info]
    if missing:
        raise UserError(
            f"dataset info {path} lacks {', '.join(missing)}; re-run the prepare stage "
            "(snakemake -R prepare_dataset)"
        )
    return info
