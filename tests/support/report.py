"""Helpers of the report tests: summary.csv rows as the summary stage writes them, and what a figure drew."""

from __future__ import annotations

import csv


def write_summary_csv(path, rows, extra=()):
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*SUMMARY_FIELDS, *extra])
        writer.writeheader()
        writer.writerows(rows)
    return path


def summary_row(run, strategy, method, merged, **extra):
    return {"run": run, "dataset": "digits", "world_size": 2, "strategy": strategy, "merge_method": method,
            "test_accuracy_merged": merged, "test_accuracy_best_rank": 0.9, **extra}  # fmt: skip


def points_by_mode(ax) -> dict[str, list[tuple[float, float]]]:
    legend = [text.get_text() for text in ax.get_legend().get_texts()]
    return {
        mode: [tuple(map(float, xy)) for xy in collection.get_offsets()]
        for mode, collection in zip(legend, ax.collections, strict=True)
    }


SUMMARY_FIELDS = ("run", "dataset", "world_size", "strategy", "merge_method", "test_accuracy_merged",
                  "test_accuracy_best_rank")  # fmt: skip
