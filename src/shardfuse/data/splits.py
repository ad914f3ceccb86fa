"""The train/validation/test split of a prepared dataset: seeded and stratified by class (each class
sends its share to each side, at least one row where it can), or plainly random with the same rules when
there are no classes. The test split does not depend on val_fraction (its own random stream).
"""

from __future__ import annotations

import math

import numpy as np


def stratified_test_mask(labels: np.ndarray, num_classes: int, test_fraction: float, seed: int) -> np.ndarray:
    """Seeded stratified split: each class sends round(n_c * test_fraction) rows, at least 1 and at most
    n_c - 1, to the test side. Returns a boolean mask, True for test rows."""
    rng = np.random.default_rng(seed)
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_test = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        num_test = min(max(math.floor(count * test_fraction + 0.5), 1), count - 1)
        is_test[rng.permutation(members)[:num_test]] = True
    return is_test


def stratified_val_mask(
    labels: np.ndarray, is_test: np.ndarray, num_classes: int, val_fraction: float, seed: int
) -> np.ndarray:
    """The validation rows, carved from the non-test rows like the test split: each class sends
    round(n_c * val_fraction) rows (n_c counts all its rows), at least 1 if val_fraction > 0, and always
    leaves at least one row of the class for training. Its own random stream, so the test split does not
    depend on val_fraction."""
    rng = np.random.default_rng([seed, 2])
    order = np.argsort(labels, kind="stable")
    counts = np.bincount(labels, minlength=num_classes)
    is_val = np.zeros(len(labels), dtype=bool)
    start = 0
    for count in counts:
        members = order[start : start + count]
        start += count
        remaining = members[~is_test[members]]
        wanted = math.floor(count * val_fraction + 0.5)
        num_val = min(max(wanted, 1 if val_fraction > 0 else 0), len(remaining) - 1)
        if num_val > 0:
            is_val[rng.permutation(remaining)[:num_val]] = True
    return is_val


def split_masks(labels: np.ndarray, num_classes: int, spec: dict) -> dict[str, np.ndarray]:
    """The train/val/test masks: stratified by class, or (``labels`` an int array of zeros, one class)
    a plain seeded random split with the same rules."""
    is_test = stratified_test_mask(labels, num_classes, spec["test_fraction"], spec["seed"])
    is_val = stratified_val_mask(labels, is_test, num_classes, spec["val_fraction"], spec["seed"])
    return {"train": ~(is_test | is_val), "val": is_val, "test": is_test}


def random_split_masks(num_rows: int, spec: dict) -> dict[str, np.ndarray]:
    """A seeded random split, not stratified: the stratified rules with every row in one class."""
    return split_masks(np.zeros(num_rows, dtype=np.int64), 1, spec)
