"""The communication report: summary.csv's training columns drawn as merged score vs bytes all-reduced
per rank (``python -m shardfuse.plots communication``), wired into the workflow and attached to every
tracked run in MLflow next to the merge-methods plot."""

from __future__ import annotations

import csv
import json
from pathlib import Path

import matplotlib.colors
import matplotlib.image
import pytest
from mlflow.tracking import MlflowClient

from shardfuse import comparison
from shardfuse.io import UserError
from shardfuse.report import figures
from shardfuse.strategies.registry import mode_colors
from tests.support.report import points_by_mode

FIELDS = ("run", "training", "dataset", "world_size", "strategy", "merge_method", "test_accuracy_merged",
          "test_accuracy_best_rank", "mode", "bytes_all_reduced_per_rank")  # fmt: skip


def _row(run: str, mode: str, num_bytes: int | str, merged: float, training: str | None = None) -> dict:
    cells = {"run": run, "training": training or f"t-{run}", "dataset": "digits", "world_size": 2,
             "strategy": mode, "merge_method": "uniform", "test_accuracy_merged": merged}  # fmt: skip
    return {**cells, "test_accuracy_best_rank": 0.8, "mode": mode, "bytes_all_reduced_per_rank": num_bytes}


def _write(path: Path, rows: list[dict], fields=FIELDS) -> Path:
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


ROWS = [
    _row("ddp", "ddp", 500_000_000, 0.91),
    _row("localsgd", "localsgd", 40_000_000, 0.86),
    _row("diloco", "diloco", 2_000_000, 0.89),
    _row("indep_uniform", "independent", 0, 0.80, training="t-indep"),
    _row("indep_ties", "independent", 0, 0.82, training="t-indep"),
    _row("old", "localsgd", "", 0.84),  # a training from before train.json counted its bytes
]


def test_each_run_is_a_labelled_point_at_its_byte_count_coloured_by_mode(tmp_path):
    rows = figures.read_summary(_write(tmp_path / "summary.csv", ROWS))
    fig = figures.communication_figure(rows)
    (ax,) = [ax for ax in fig.axes if ax.get_visible()]
    assert ax.get_xscale() == "log"
    assert ax.get_ylabel() == "merged test accuracy (higher is better)"
    # Smallest non-zero count 2 MB: independent training (0 B) sits one decade left of its decade, 100 kB.
    assert points_by_mode(ax) == {
        "ddp": [(5e8, 0.91)],
        "localsgd": [(4e7, 0.86)],
        "diloco": [(2e6, 0.89)],
        "independent": [(1e5, 0.80), (1e5, 0.82)],
    }
    colors = {mode: matplotlib.colors.to_hex(c.get_facecolor()[0]) for mode, c in
              zip(points_by_mode(ax), ax.collections, strict=True)}  # fmt: skip
    assert colors == {mode: mode_colors()[mode] for mode in colors}
    assert sorted(text.get_text() for text in ax.texts) == sorted(r["run"] for r in ROWS if r["run"] != "old")
    ticks = {round(tick): label.get_text() for tick, label in zip(ax.get_xticks(), ax.get_xticklabels(),
                                                                   strict=True)}  # fmt: skip
    assert ticks == {100_000: "0 B", 1_000_000: "1 MB", 10_000_000: "10 MB", 100_000_000: "100 MB",
                     1_000_000_000: "1 GB"}  # fmt: skip
    low, high = ax.get_xlim()
    assert low < 1e5 < 3.2e5 < 2e6 and high > 5e8
    (separator,) = ax.get_lines()  # the dotted line between 0 B and the log scale
    assert separator.get_xdata()[0] == pytest.approx(1e5 * 10**0.5)
    assert fig.texts[0].get_text() == "Not shown (no byte count): old"
    figures.pyplot().close(fig)


def test_lower_is_better_scores_get_their_own_panel_and_say_so(tmp_path):
    rows = [
        _row("cls", "ddp", 1000, 0.9),
        {**_row("reg", "diloco", 250, ""), "test_accuracy_best_rank": "", "test_mse_merged": 0.25,
         "test_mse_best_rank": 0.3},
    ]  # fmt: skip
    fields = (*FIELDS, "test_mse_merged", "test_mse_best_rank")
    fig = figures.communication_figure(figures.read_summary(_write(tmp_path / "summary.csv", rows, fields)))
    assert [ax.get_ylabel() for ax in fig.axes] == [
        "merged test accuracy (higher is better)",
        "merged test mse (lower is better)",
    ]
    assert points_by_mode(fig.axes[1]) == {"diloco": [(250.0, 0.25)]}
    assert not fig.axes[0].get_lines()  # no run without communication: no 0 B tick, no separator
    assert "0 B" not in [label.get_text() for label in fig.axes[0].get_xticklabels()]
    figures.pyplot().close(fig)


def test_only_independent_runs_sit_on_the_0_b_tick_at_one_byte():
    points, left_out = figures.communication_points([_row("a", "independent", 0, 0.7)])
    assert left_out == [] and figures.zero_bytes_position(points) == 1.0
    assert figures.byte_ticks(points, 1.0) == {1.0: "0 B"}
    fig = figures.communication_figure([_row("a", "independent", 0, 0.7)])
    assert points_by_mode(fig.axes[0]) == {"independent": [(1.0, 0.7)]}
    figures.pyplot().close(fig)


def test_byte_labels_use_decimal_units_and_ticks_thin_out_over_many_decades():
    assert [figures.byte_label(v) for v in (1, 999, 1e3, 2.5e6, 1e9, 1e12, 1e18)] == [
        "1 B", "999 B", "1 kB", "2.5 MB", "1 GB", "1 TB", "1000 PB",
    ]  # fmt: skip
    points, _ = figures.communication_points([_row("a", "ddp", 10, 0.5), _row("b", "ddp", 10**12, 0.6)])
    ticks = figures.byte_ticks(points, figures.zero_bytes_position(points))
    assert list(ticks.values()) == ["10 B", "1 kB", "100 kB", "10 MB", "1 GB", "100 GB"]


def test_a_summary_without_byte_counts_draws_a_note_instead_of_failing(tmp_path):
    # summary.csv written before the training columns: every run left out, the figure says why.
    fields = tuple(f for f in FIELDS if f not in ("mode", "bytes_all_reduced_per_rank"))
    path = _write(tmp_path / "summary.csv", ROWS[:2], fields)
    fig = figures.communication_figure(figures.read_summary(path))
    (ax,) = fig.axes
    assert not ax.axison and "re-run the train or the summary stage" in ax.texts[0].get_text()
    assert fig.texts[0].get_text() == "Not shown (no byte count): ddp, localsgd"
    figures.pyplot().close(fig)


def test_comparison_attaches_both_plots_to_every_parent_once_per_name(tmp_path):
    uri = f"sqlite:///{tmp_path}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment = client.create_experiment("shardfuse", artifact_location=str(tmp_path / "artifacts"))
    records = []
    for run in ("a", "b"):
        parent = client.create_run(experiment, run_name=run)
        record = tmp_path / f"{run}.mlflow.json"
        record.write_text(json.dumps({"tracking_uri": uri, "parent_run_id": parent.info.run_id}))
        records.append((record, parent.info.run_id))
    pngs = [
        figures.save_figure(figures.communication_figure([_row("x", "ddp", 1000, 0.9)]), tmp_path / name)
        for name in ("merge_methods.png", "communication.png")
    ]
    summary = tmp_path / "summary.csv"
    summary.write_text(
        "run,merge_method,test_accuracy_merged,test_accuracy_ddp_baseline\na,uniform,0.9,\nb,ties,0.85,0.91\n"
    )
    for _ in range(2):  # re-logging overwrites the same files
        written = comparison.attach(pngs, [path for path, _ in records], summary)
    assert written == {
        "pngs": [str(png) for png in pngs],
        "artifacts": [
            "comparison/merge_methods.png", "comparison/communication.png", "merge_methods.png",
            "communication.png", "comparison_table.json",
        ],
        "parent_run_ids": sorted(run_id for _, run_id in records),
    }  # fmt: skip
    for _, run_id in records:
        artifacts = sorted(a.path for a in client.list_artifacts(run_id, "comparison"))
        assert artifacts == ["comparison/communication.png", "comparison/merge_methods.png"]
        root = sorted(a.path for a in client.list_artifacts(run_id) if not a.is_dir)
        assert root == ["communication.png", "comparison_table.json", "merge_methods.png"]
        # MLflow's table artifact: the summary's columns, one row per run, numbers as numbers.
        table = json.loads(
            Path(client.download_artifacts(run_id, "comparison_table.json", tmp_path)).read_text()
        )
        rows = [dict(zip(table["columns"], row, strict=True)) for row in table["data"]]
        assert [(r["run"], r["test_accuracy_merged"], r["test_accuracy_ddp_baseline"]) for r in rows] == [
            ("a", 0.9, None), ("b", 0.85, 0.91),
        ]  # fmt: skip
        tag = json.loads(client.get_run(run_id).data.tags["mlflow.loggedArtifacts"])
        assert tag == [{"path": "comparison_table.json", "type": "table"}]
    with pytest.raises(UserError, match=r"missing\.png does not exist; run the rule that draws it"):
        comparison.attach([tmp_path / "missing.png"], [records[0][0]])
    with pytest.raises(UserError, match=r"has no runs; re-run the summary rule"):
        (tmp_path / "empty.csv").write_text("run,merge_method\n")
        comparison.attach(pngs, [records[0][0]], tmp_path / "empty.csv")
