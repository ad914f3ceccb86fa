"""shardfuse.plots: real PNGs from fabricated run directories and summary tables (Agg backend)."""

from __future__ import annotations

import csv
import subprocess
import sys

import matplotlib.image
import numpy as np
import pytest

from shardfuse import plots
from shardfuse.io import UserError
from tests.helpers import subprocess_env
from tests.tracking_fixtures import make_run_dir

SUMMARY_FIELDS = ("run", "dataset", "world_size", "strategy", "merge_method", "test_accuracy_merged",
                  "test_accuracy_best_rank")  # fmt: skip


def _summary(path, rows, extra=()):
    with open(path, "w", newline="") as fh:
        writer = csv.DictWriter(fh, fieldnames=[*SUMMARY_FIELDS, *extra])
        writer.writeheader()
        writer.writerows(rows)
    return path


def _row(run, strategy, method, merged, **extra):
    return {"run": run, "dataset": "digits", "world_size": 2, "strategy": strategy, "merge_method": method,
            "test_accuracy_merged": merged, "test_accuracy_best_rank": 0.9, **extra}  # fmt: skip


def test_run_plots_are_three_deterministic_pngs_written_atomically(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "pictured", world_size=3, num_steps=120, training="shared")
    train_dir = tmp_path / "results" / "trainings" / "shared" / "ranks"
    written = plots.plot_run(run_dir, run_dir / "plots", train_dir)
    assert [p.name for p in written] == list(plots.RUN_PLOTS)
    for path in written:
        image = matplotlib.image.imread(path)
        assert image.shape[0] > 300 and image.shape[1] > 400
        assert image[..., :3].std() > 0.05  # not a blank canvas
    assert sorted(p.name for p in (run_dir / "plots").iterdir()) == sorted(plots.RUN_PLOTS)  # no temp files
    first = {p.name: p.read_bytes() for p in written}
    again = plots.plot_run(run_dir, run_dir / "plots", train_dir)
    assert {p.name: p.read_bytes() for p in again} == first  # same data, same bytes: no needless re-upload


def test_fusion_bars_show_merged_each_rank_best_mean_and_baselines_when_present(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "fused", world_size=2, ddp_baseline=True)
    evaluation = plots.read_json(run_dir / "eval.json")
    bars = plots.fusion_bars(evaluation)
    assert [(label, round(value, 3)) for label, value, _ in bars] == [
        ("merged", 0.8), ("rank 0", 0.7), ("rank 1", 0.72), ("best rank", 0.72), ("mean rank", 0.71),
        ("ddp baseline\n(ddp)", 0.83), ("initial model", 0.34),
    ]  # fmt: skip
    del evaluation["ddp_baseline"], evaluation["base"]
    assert [label for label, _, _ in plots.fusion_bars(evaluation)][-1] == "mean rank"
    del evaluation["merged"]
    with pytest.raises(UserError, match="re-run the evaluate stage"):
        plots.fusion_bars(evaluation)


def test_smoothing_keeps_a_trend_and_damps_noise():
    rng = np.random.default_rng(0)
    trend = np.linspace(2.0, 0.5, 500)
    noisy = trend + rng.normal(scale=0.2, size=500)
    smoothed = plots.smooth(noisy)
    assert smoothed.shape == noisy.shape
    assert np.abs(smoothed - trend).mean() < 0.4 * np.abs(noisy - trend).mean()
    np.testing.assert_allclose(plots.smooth(np.full(100, 3.0)), 3.0)


def test_runs_are_grouped_by_training_column_else_by_dataset_world_size_and_strategy():
    rows = [_row("a", "independent", "uniform", 0.8), _row("b", "independent", "weighted", 0.82),
            _row("c", "ddp", "consolidate", 0.9)]  # fmt: skip
    groups = plots.training_groups(rows)
    assert {k: [r["run"] for r in v] for k, v in groups.items()} == {
        "digits / world_size 2 / independent": ["a", "b"], "digits / world_size 2 / ddp": ["c"]
    }  # fmt: skip
    rows = [{**row, "training": "t1" if row["run"] != "b" else "t2"} for row in rows]
    assert {k: [r["run"] for r in v] for k, v in plots.training_groups(rows).items()} == {
        "t1": ["a", "c"],
        "t2": ["b"],
    }


def test_compare_cli_writes_the_merge_methods_png_and_fails_in_one_line_without_a_summary(tmp_path):
    rows = [
        _row(f"r{i}", "independent", method, 0.8 + 0.01 * i)
        for i, method in enumerate(("uniform", "weighted"))
    ]
    summary = _summary(tmp_path / "summary.csv", [*rows, _row("d", "ddp", "consolidate", 0.9)])
    out = tmp_path / "plots" / "merge_methods.png"
    cli = [sys.executable, "-m", "shardfuse.plots", "compare"]
    proc = subprocess.run([*cli, "--summary", summary, "--out", out], capture_output=True, text=True,
                          env=subprocess_env())  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    assert matplotlib.image.imread(out).shape[1] > 600
    proc = subprocess.run([*cli, "--summary", tmp_path / "none.csv", "--out", out], capture_output=True,
                          text=True, env=subprocess_env())  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"shardfuse.plots: error: {tmp_path / 'none.csv'} does not exist; run the summary stage first"
    )


def test_run_plots_without_metrics_are_a_one_line_user_error(tmp_path):
    run_dir, _ = make_run_dir(tmp_path, "unmeasured")
    for path in (run_dir / "train" / "metrics").glob("*.parquet"):
        path.unlink()
    with pytest.raises(UserError, match=r"train/metrics has no rank-\*\.parquet; re-run the train stage"):
        plots.plot_run(run_dir, run_dir / "plots", run_dir / "train")
