"""The plots and comparison stages' command lines: deterministic PNGs from the summary stage's output and
one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys

import matplotlib

from shardfuse import summary
from shardfuse.report import figures
from tests.support.helpers import subprocess_env
from tests.support.report import points_by_mode, summary_row, write_summary_csv
from tests.support.tracking import regression_evaluation


def test_compare_cli_writes_the_merge_methods_png_and_fails_in_one_line_without_a_summary(tmp_path):
    rows = [
        summary_row(f"r{i}", "independent", method, 0.8 + 0.01 * i)
        for i, method in enumerate(("uniform", "weighted"))
    ]
    summary = write_summary_csv(
        tmp_path / "summary.csv", [*rows, summary_row("d", "ddp", "consolidate", 0.9)]
    )
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


def test_cli_draws_a_deterministic_png_from_the_summary_stage_output(tmp_path):
    """summary.csv as the summary stage writes it (train.json with and without the new fields)."""
    trainings = {
        "diloco": {"mode": "diloco", "effective_batch_size": 64, "bytes_all_reduced_per_rank": 3_000_000},
        "indep": {"mode": "independent", "effective_batch_size": 64, "bytes_all_reduced_per_rank": 0},
        "old": {"strategy": "ddp", "sync_every": 0},
    }
    runs = {}
    for run, train in trainings.items():
        run_dir = tmp_path / "runs" / run
        run_dir.mkdir(parents=True)
        (run_dir / "eval.json").write_text(json.dumps(regression_evaluation(run)))
        (run_dir / "merge.json").write_text(
            json.dumps({"method": "uniform", "max_abs_diff_between_ranks": 0})
        )
        ranks = tmp_path / "trainings" / run / "ranks"
        ranks.mkdir(parents=True)
        (ranks / "train.json").write_text(json.dumps({"num_steps": 5, "train_seconds": 1.0, **train}))
        runs[run] = {"training": run, "dataset": "d", "world_size": 2, "strategy": "x", "sync_every": 0}
    csv_path = tmp_path / "summary.csv"
    summary.write_summary(runs, tmp_path / "runs", tmp_path / "trainings", csv_path)

    fig = figures.communication_figure(figures.read_summary(csv_path))
    assert points_by_mode(fig.axes[0]) == {"diloco": [(3e6, 0.25)], "independent": [(1e5, 0.25)]}
    assert fig.texts[0].get_text() == "Not shown (no byte count): old"
    figures.pyplot().close(fig)

    out = tmp_path / "plots" / "communication.png"
    cli = [sys.executable, "-m", "shardfuse.plots", "communication", "--summary", str(csv_path)]
    proc = subprocess.run([*cli, "--out", str(out)], capture_output=True, text=True, env=subprocess_env())
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == f"wrote {out}"
    image = matplotlib.image.imread(out)
    assert image.shape[1] > 500 and image[..., :3].std() > 0.05
    first = out.read_bytes()
    subprocess.run([*cli, "--out", str(out)], check=True, capture_output=True, env=subprocess_env())
    assert out.read_bytes() == first  # same summary, same bytes: no needless re-upload
    proc = subprocess.run([*cli[:-1], str(tmp_path / "none.csv"), "--out", str(out)], capture_output=True,
                          text=True, env=subprocess_env())  # fmt: skip
    assert proc.returncode == 2
    assert proc.stderr.strip() == (
        f"shardfuse.plots: error: {tmp_path / 'none.csv'} does not exist; run the summary stage first"
    )
