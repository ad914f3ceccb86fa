"""The synthetic dataset source: seeded Gaussian clusters (classification) or a seeded random network
plus noise (regression), generated chunk by chunk so tens of millions of rows fit in bounded memory.

No command line; a library module: :class:`Synthetic` is the source's behaviour (its record is in
:mod:`shardfuse.data.sources.registry`); it writes the chunks :func:`synthetic_data` yields into the split
files as they come. By hand::

    python -c "from shardfuse.data.sources.synthetic import synthetic_data
    from shardfuse.models.tasks import task_for
    spec = {'source': 'synthetic', 'num_rows': 1000, 'num_features': 4,
            'num_classes': 3, 'class_sep': 1.0, 'test_fraction': 0.2, 'val_fraction': 0.1, 'seed': 0}
    features, labels, masks = next(synthetic_data(spec, task_for('classification')).chunks)
    print(features.shape, {split: int(mask.sum()) for split, mask in masks.items()})"
    # (1000, 4) {'train': 700, 'val': 99, 'test': 201}

Every chunk draws from its own random stream, keyed by (seed, chunk index), and carries its own split
masks: labels cycle through the classes by global row index and each class's test (then validation)
rows are spread evenly over its rows, so the split is stratified across all chunks with no pass over
the whole data. The chunk size is a constant, not a knob (it decides the streams).
Only correctly rounded elementwise operations touch the data, so the bits do not depend on the CPU.

Classification rows are Gaussian clusters; ``class_sep`` (default 1.0) sets the difficulty independent
of num_features: nearest-centroid test accuracy with 10 classes is ~0.57 at 1.0, ~0.81 at 1.5, ~0.94 at
2.0 (chance at 0). Regression rows are x ~ N(0, 1), y = f(x) + noise * N(0, 1) (noise default 0.1),
with f a seeded random one-hidden-layer network scaled so each target's std is about 1.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.data.labels import find_layout, kept_class_codes
from shardfuse.data.sources.base import Described, SourceBehaviour, Written
from shardfuse.data.sources.checks import require_int, require_number
from shardfuse.data.sources.write import Chunk, input_of, write_chunks
from shardfuse.io import UserError
from shardfuse.models.task import CLASSES, Task

# Synthetic rows are generated in chunks of about this many values (rows x features; regression also
# counts its hidden layer and targets). It is a constant, not a tuning knob: chunk boundaries decide the
# random streams, so changing it changes the data.
SYNTHETIC_CHUNK_VALUES = 1 << 22
# Hidden width of the synthetic regression function, and the rows that calibrate its scale (constants:
# changing either changes the data).
SYNTHETIC_HIDDEN = 32
SYNTHETIC_CALIBRATION_ROWS = 1 << 12


class SyntheticData(NamedTuple):
    """A synthetic dataset: its names, and its rows as chunks generated as they are consumed."""

    feature_names: list[str]
    target_names: list[str]  # the class names (classes) or the target names (values)
    chunks: Iterator[Chunk]


def synthetic_chunk_rows(row_values: int) -> int:
    """Rows per chunk when each row takes ``row_values`` values (features, or all a row's arrays)."""
    return max(1, SYNTHETIC_CHUNK_VALUES // row_values)


def _chunk_masks(
    spec: dict, num_classes: int, rng: np.random.Generator, start: int, stop: int
) -> tuple[np.ndarray, dict[str, np.ndarray]]:
    """Rows [start, stop) in random order: labels cycle through the classes by global row index, so every
    class has num_rows // C or one more rows; the test rows of each class are spread evenly over its rows
    (Bresenham-style), which makes the split stratified across all chunks, not just within one. With one
    class (regression) it is a split of exactly round(num_rows * test_fraction) test rows; as the rows
    themselves are random draws, which row index is a test row does not matter."""
    test_fraction = spec["test_fraction"]
    rows = rng.permutation(np.arange(start, stop, dtype=np.int64))  # rows come out in random class order
    labels = rows % num_classes
    position = rows // num_classes  # index of the row within its class
    is_test = _spread(position, test_fraction)
    # The same rule once more over the non-test rows of each class (index: rows before it that are not
    # test rows), with the share that makes val_fraction of all rows.
    remaining_position = position - np.floor(position * test_fraction + 0.5).astype(np.int64)
    is_val = ~is_test & _spread(remaining_position, _val_share(spec))
    return labels, {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def _synthetic_chunk(
    spec: dict,
    centroids: np.ndarray,
    mix_source: np.ndarray,
    mix_weight: np.ndarray,
    chunk_index: int,
    start: int,
    stop: int,
) -> Chunk:
    rng = np.random.default_rng([spec["seed"], 1, chunk_index])  # stream 0 holds the shared parameters
    labels, masks = _chunk_masks(spec, spec["num_classes"], rng, start, stop)
    features = rng.standard_normal((stop - start, centroids.shape[1]))
    features += centroids[labels]
    # Mix each feature with one other: correlated features, elementwise so the bits do not depend on
    # the CPU (a BLAS matmul would).
    features += mix_weight * features[:, mix_source]
    return features.astype(np.float32), labels, masks


class RegressionFunction(NamedTuple):
    """y = (x W) / sqrt(1 + (x W)^2) V * scale: a one-hidden-layer network with a smooth saturating
    activation. Not tanh: NumPy's tanh may take a CPU-specific SIMD path, while this one is made of
    correctly rounded operations only, so the targets have the same bits on every CPU."""

    hidden_weight: np.ndarray  # (F, H)
    output_weight: np.ndarray  # (H, K)
    scale: np.ndarray  # (K,), 1 / each target's std over the calibration rows

    def __call__(self, features: np.ndarray) -> np.ndarray:
        # Products summed in a fixed order, elementwise, for the reason above (a BLAS matmul's order varies).
        x = features.astype(np.float64)
        hidden = np.zeros((len(x), self.hidden_weight.shape[1]))
        for j in range(x.shape[1]):
            hidden += x[:, j, None] * self.hidden_weight[j]
        hidden /= np.sqrt(1.0 + hidden * hidden)
        outputs = np.zeros((len(x), self.output_weight.shape[1]))
        for h in range(hidden.shape[1]):
            outputs += hidden[:, h, None] * self.output_weight[h]
        return outputs * self.scale


def synthetic_regression_function(spec: dict) -> RegressionFunction:
    """The seeded function of a synthetic regression spec (tests recompute targets with it)."""
    params = np.random.default_rng([spec["seed"], 0])
    num_features = spec["num_features"]
    # Pre-activations of std about 2: the activation saturates often enough that a linear model leaves
    # a clear share of the variance to a network, as a regression benchmark should.
    hidden_weight = params.standard_normal((num_features, SYNTHETIC_HIDDEN)) * (2 / math.sqrt(num_features))
    output_weight = params.standard_normal((SYNTHETIC_HIDDEN, spec["num_outputs"]))
    unscaled = RegressionFunction(hidden_weight, output_weight, np.ones(spec["num_outputs"]))
    calibration = params.standard_normal((SYNTHETIC_CALIBRATION_ROWS, num_features)).astype(np.float32)
    return unscaled._replace(scale=1.0 / unscaled(calibration).std(axis=0))


def _regression_chunk(
    spec: dict, function: RegressionFunction, chunk_index: int, start: int, stop: int
) -> Chunk:
    rng = np.random.default_rng([spec["seed"], 1, chunk_index])
    _, masks = _chunk_masks(spec, 1, rng, start, stop)
    features = rng.standard_normal((stop - start, spec["num_features"])).astype(np.float32)
    noise = rng.standard_normal((stop - start, spec["num_outputs"]))
    # The function of the stored float32 features, so a reader can recompute it exactly.
    return features, (function(features) + spec["noise"] * noise).astype(np.float32), masks


def _spread(position: np.ndarray, fraction: float) -> np.ndarray:
    """Bresenham-style: position p is picked when round((p + 1) * fraction) steps past round(p * fraction),
    so any n consecutive positions from 0 hold round(n * fraction) picks, spread evenly."""
    return np.floor((position + 1) * fraction + 0.5) > np.floor(position * fraction + 0.5)


def _val_share(spec: dict) -> float:
    return spec["val_fraction"] / (1 - spec["test_fraction"])


def _class_splits_both_ways(class_rows: int, test_fraction: float, val_share: float = 0.0) -> bool:
    """Whether a synthetic class of this size gets at least one train and one test row."""
    num_test = math.floor(class_rows * test_fraction + 0.5)  # what _chunk_masks's rule adds up to
    class_rows -= math.floor((class_rows - num_test) * val_share + 0.5)  # validation rows leave training
    return 1 <= num_test < class_rows


def _check_synthetic_rows(spec: dict, num_classes: int, task: Task) -> None:
    """Every class (regression: all rows, one class) must get a train and a test row."""
    num_rows, test_fraction, val_share = spec["num_rows"], spec["test_fraction"], _val_share(spec)
    if _class_splits_both_ways(num_rows // num_classes, test_fraction, val_share):
        return
    # Smallest workable class size: start from the analytic bound (without validation rows), step up.
    class_rows = max(2, math.ceil(0.5 / test_fraction), math.floor(0.5 / (1 - test_fraction)) + 1)
    while not _class_splits_both_ways(class_rows, test_fraction, val_share):
        class_rows += 1
    if task.labels == CLASSES:
        what, fault = f"{num_classes} classes", "some class would get no train or no test row"
    else:
        what, fault = "a regression split", "the split would get no train or no test row"
    raise UserError(
        f"num_rows={num_rows} is too small for {what} at test_fraction={test_fraction} "
        f"(val_fraction={spec['val_fraction']}): {fault}; use num_rows >= {num_classes * class_rows}"
    )


class Synthetic(SourceBehaviour):
    """Generated rows, streamed chunk by chunk (see the module docstring)."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_int(spec, "num_rows", 2)
        require_int(spec, "num_features", 1)
        if task.labels == CLASSES:
            require_int(spec, "num_classes", 2)
            require_number(spec, "class_sep", 0, math.inf, open_interval=False)
        else:
            require_int(spec, "num_outputs", 1)
            require_number(spec, "noise", 0, math.inf, open_interval=False)

    def describe(self, spec: dict[str, Any], task: Task) -> Described:
        width = int(spec["num_features"])
        if task.labels == CLASSES:
            targets = [str(c) for c in range(int(spec["num_classes"]))]
        else:
            targets = [f"y{k}" for k in range(int(spec["num_outputs"]))]
        return Described("numeric", [width], [f"x{j}" for j in range(width)], targets)

    def prepare(self, spec: dict[str, Any], task: Task, out_dir: Path, row_group_rows: int) -> Written:
        data = synthetic_data(spec, task)
        layout = find_layout(task.labels)
        num_features, num_targets = len(data.feature_names), len(data.target_names)
        rows = write_chunks(
            out_dir, data.chunks, num_features, num_targets, layout, row_group_rows, spec["num_rows"]
        )
        label_names, keys = layout.names(data.target_names)
        no_rows = np.zeros((0, num_features), dtype=np.float32)
        return Written(rows, data.feature_names, label_names, keys, input_of(no_rows, "numeric"))


def synthetic_data(spec: dict, task: Task) -> SyntheticData:
    """The synthetic dataset of a validated spec: Gaussian clusters for a task of classes, a random
    network's values otherwise. Checks the size first (UserError when a class would get no train or no
    test row); the rows are generated only as ``chunks`` is consumed."""
    num_rows, num_features = spec["num_rows"], spec["num_features"]
    feature_names = [f"x{j}" for j in range(num_features)]
    if task.labels != CLASSES:
        _check_synthetic_rows(spec, 1, task)
        function = synthetic_regression_function(spec)
        num_outputs = spec["num_outputs"]
        # A chunk holds the features, the hidden layer and the targets of its rows (float64).
        chunk_rows = synthetic_chunk_rows(num_features + SYNTHETIC_HIDDEN + num_outputs)
        chunks = (
            _regression_chunk(spec, function, index, start, min(start + chunk_rows, num_rows))
            for index, start in enumerate(range(0, num_rows, chunk_rows))
        )
        return SyntheticData(feature_names, [f"y{k}" for k in range(num_outputs)], chunks)

    num_classes = spec["num_classes"]
    _check_synthetic_rows(spec, num_classes, task)
    label_names = [str(c) for c in range(num_classes)]
    kept = kept_class_codes(spec["classes"], label_names) if "classes" in spec else None
    params = np.random.default_rng([spec["seed"], 0])
    # Centroid spread scales with 1/sqrt(F), so class_sep sets the difficulty whatever num_features is:
    # two centroids lie about 2 * sqrt(2) * class_sep noise standard deviations apart.
    centroids = params.standard_normal((num_classes, num_features)) * (
        2 * spec["class_sep"] / math.sqrt(num_features)
    )
    mix_source = params.permutation(num_features)
    mix_weight = params.uniform(-1.0, 1.0, num_features)
    chunk_rows = synthetic_chunk_rows(num_features)
    chunks = (
        _synthetic_chunk(
            spec, centroids, mix_source, mix_weight, index, start, min(start + chunk_rows, num_rows)
        )
        for index, start in enumerate(range(0, num_rows, chunk_rows))
    )
    if kept is not None:  # the rows of other classes are generated (same streams) and dropped
        chunks = (
            (features, labels, {split: mask & np.isin(labels, kept) for split, mask in masks.items()})
            for features, labels, masks in chunks
        )
    return SyntheticData(feature_names, label_names, chunks)
