"""The figure of a shard set: what each rank was dealt (issue 48), from its manifest.json.

One stacked bar per rank, its height the shard's rows, its parts the classes (the manifest's
``label_counts``; like Flower Datasets' ``plot_label_distributions``), or plain bars without labels
(regression, tokens); the title names the partitioner and the heterogeneity numbers
(:mod:`shardfuse.data.heterogeneity`: the label Jensen-Shannon divergence of each rank to the pooled
labels, mean and max, and the coefficient of variation of the shard rows). Classes beyond
:data:`MAX_CLASSES` are drawn as one part, "other classes". A library, no command line: the plots stage
draws it for every run (``shards.png``; ``python -m shardfuse.plots ... --manifest MANIFEST``).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.data.heterogeneity import manifest_heterogeneity
from shardfuse.report.figures import RANK_COLOR, pyplot, save_figure

MAX_CLASSES = 20  # more would be a legend longer than the figure


def class_table(shards: list[dict[str, Any]]) -> tuple[list[str], np.ndarray]:
    """The classes (in the manifest's value order) and rows x ranks counts; classes past MAX_CLASSES
    summed into a last row, "other classes"."""
    classes: list[str] = []
    for shard in shards:
        classes += [label for label in shard["label_counts"] if label not in classes]
    table = np.array([[shard["label_counts"].get(label, 0) for shard in shards] for label in classes])
    if len(classes) > MAX_CLASSES:
        kept = MAX_CLASSES - 1
        table = np.vstack([table[:kept], table[kept:].sum(axis=0, keepdims=True)])
        classes = [*classes[:kept], "other classes"]
    return classes, table


def title_of(manifest: dict[str, Any], name: str) -> str:
    partition = manifest.get("partition") or {"name": "iid", "params": {}}
    params = ", ".join(f"{key} {value}" for key, value in partition["params"].items() if value is not None)
    numbers = manifest_heterogeneity(manifest)
    measured = [f"rows CV {numbers['rows_cv']:.2f}"]
    if numbers["label_jsd_mean"] is not None:
        measured.insert(
            0, f"label JSD mean {numbers['label_jsd_mean']:.3f}, max {numbers['label_jsd_max']:.3f}"
        )
    return f"{name}: {partition['name']}{f' ({params})' if params else ''}\n{'; '.join(measured)}"


def shard_set_figure(manifest: dict[str, Any], name: str):
    plt = pyplot()
    shards = manifest["shards"]
    ranks = np.arange(len(shards))
    fig, ax = plt.subplots(figsize=(max(4.0, 1.0 + 0.6 * len(shards)), 3.6))
    if all(shard.get("label_counts") for shard in shards):
        classes, table = class_table(shards)
        colors = pyplot().get_cmap("tab20")(np.linspace(0, 1, max(len(classes), 2)))
        bottom = np.zeros(len(shards))
        for label, counts, color in zip(classes, table, colors, strict=False):
            ax.bar(ranks, counts, bottom=bottom, color=color, label=label, width=0.8)
            bottom += counts
        ax.legend(title="class", fontsize="small", loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        ax.bar(ranks, [shard["rows"] for shard in shards], color=RANK_COLOR, width=0.8)
    ax.set_xticks(ranks, [str(rank) for rank in ranks])
    ax.set_xlabel("rank")
    ax.set_ylabel("training rows")
    ax.set_title(title_of(manifest, name), fontsize="medium")
    return fig


def plot_shard_set(manifest: dict[str, Any], name: str, out: Path) -> Path:
    return save_figure(shard_set_figure(manifest, name), out)
