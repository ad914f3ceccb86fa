"""How heterogeneous a shard set is, from its manifest's per-shard rows and label counts: one number for
label skew and one for size skew (issue 48).

- ``label_jsd_mean`` / ``label_jsd_max``: the Jensen-Shannon divergence, base 2 (0: the same label
  distribution as all shards pooled; 1: disjoint), of each rank's label distribution to the pooled one,
  averaged over the ranks and the largest; null without class labels (regression, causal_lm).
- ``rows_cv``: the coefficient of variation of the shards' rows (population std / mean; 0: equal).

The partition stage writes it into the manifest of every partitioner but iid (whose manifests keep their
bytes); :func:`manifest_heterogeneity` gives it for any manifest, computing it where it is not written.
Pure Python and NumPy, no pyarrow: the launcher, tracking and summary read manifests.
"""

from __future__ import annotations

from typing import Any

import numpy as np


def jensen_shannon(p: np.ndarray, q: np.ndarray) -> float:
    """JSD(p, q) in bits of two distributions over the same classes (0 log 0 = 0)."""
    middle = (p + q) / 2

    def kl(a: np.ndarray) -> float:
        held = a > 0
        return float(np.sum(a[held] * np.log2(a[held] / middle[held])))

    return max(0.0, (kl(p) + kl(q)) / 2)


def heterogeneity(shards: list[dict[str, Any]]) -> dict[str, float | None]:
    """The numbers above from manifest shard entries (``rows``, and ``label_counts`` where labels exist)."""
    rows = np.array([shard["rows"] for shard in shards], dtype=np.float64)
    rows_cv = float(rows.std() / rows.mean()) if rows.mean() > 0 else 0.0
    counts = [shard.get("label_counts") for shard in shards]
    if any(count is None for count in counts):
        return {"label_jsd_mean": None, "label_jsd_max": None, "rows_cv": rows_cv}
    classes = sorted({label for count in counts for label in count})
    table = np.array([[count.get(label, 0) for label in classes] for count in counts], dtype=np.float64)
    pooled = table.sum(axis=0) / table.sum()
    divergences = [jensen_shannon(row / row.sum(), pooled) for row in table if row.sum() > 0]
    return {
        "label_jsd_mean": float(np.mean(divergences)),
        "label_jsd_max": float(np.max(divergences)),
        "rows_cv": rows_cv,
    }


def manifest_heterogeneity(manifest: dict[str, Any]) -> dict[str, float | None]:
    """The manifest's recorded heterogeneity, or (an iid manifest, or one written before it) computed
    from its shards."""
    return manifest.get("heterogeneity") or heterogeneity(manifest["shards"])


def shard_metrics(manifest: dict[str, Any]) -> dict[str, float]:
    """The heterogeneity as a run's metrics (``shard_label_jsd_mean``, ``shard_label_jsd_max``,
    ``shard_rows_cv``; the label ones only where there are labels)."""
    numbers = manifest_heterogeneity(manifest)
    return {f"shard_{key}": value for key, value in numbers.items() if value is not None}
