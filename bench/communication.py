"""Communication against quality: the README's training-loop experiment, as a table for RESULTS.md.

    python bench/communication.py                    # config/examples/communication.yaml (~4 min)
    python bench/communication.py --lm               # config/examples/communication_lm.yaml (~20 min)

Runs ``snakemake --cores all --configfile <example>`` in a fresh directory (a copy of config/), then
prints, per run: the merged model's test score and loss, the bytes each rank all-reduced, the sync
count and the training's loop seconds (train.json), with the ratio of bytes to ddp's. Every strategy
trains one epoch of the same shards, so all see the same samples. Not part of run_all: it is an
experiment, not a speed check, and takes minutes.
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common

REPO = Path(__file__).resolve().parents[1]


def run(example: Path, work_dir: Path) -> list[list[object]]:
    work_dir.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "config", work_dir / "config", dirs_exist_ok=True)
    started = time.perf_counter()
    measured = common.measure(
        [
            sys.executable, "-m", "snakemake", "--snakefile", REPO / "Snakefile", "--directory", work_dir,
            "--cores", "all", "--configfile", work_dir / "config" / "examples" / example.name,
        ],
        env=common.child_env(),
    )  # fmt: skip
    print(f"{example.name}: whole workflow {time.perf_counter() - started:.0f} s ({common.load_average()})")
    del measured  # a failure has raised with the output's tail
    return rows_of(work_dir)


def rows_of(work_dir: Path) -> list[list[object]]:
    """The table's rows from a finished experiment's results/ (summary, eval, merge, train records); the
    work dir holds one experiment, whose summary is under results/experiments/<experiment>/ unless it is
    the default one."""
    found = sorted((work_dir / "results").glob("experiments/*/summary.csv"))
    with open(found[0] if found else work_dir / "results" / "summary.csv", newline="") as fh:
        summary = list(csv.DictReader(fh))
    rows = []
    for row in summary:
        evaluation = json.loads((work_dir / "results" / "runs" / row["run"] / "eval.json").read_text())
        merge = json.loads((work_dir / "results" / "runs" / row["run"] / "merge.json").read_text())
        ranks = work_dir / "results" / "trainings" / merge["training"] / "ranks"
        train = json.loads((ranks / "train.json").read_text())
        score = evaluation["score"]
        rows.append(
            [
                row["run"],
                train["mode"] + (f", H = {train['sync_every']}" if train["sync_every"] else ""),
                f"{evaluation['merged'][score]:.4f}",
                f"{evaluation['merged'].get('bits_per_byte', evaluation['merged']['loss']):.4f}",
                train["num_steps"],
                train["bytes_all_reduced_per_rank"],
                train["num_syncs"],
                f"{train['train_seconds']:.1f}",
            ]
        )
    ddp_bytes = max(int(r[5]) for r in rows) or 1
    for r in rows:
        r.insert(6, f"{int(r[5]) / ddp_bytes:.4f}")
        r[5] = f"{int(r[5]) / 1e6:.2f} MB"
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lm", action="store_true", help="the stdlib transformer version")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "shardfuse-comm")
    parser.add_argument("--existing", type=Path, help="only tabulate the results of a finished run there")
    args = parser.parse_args()
    example = REPO / "config" / "examples" / ("communication_lm.yaml" if args.lm else "communication.yaml")
    if args.existing:
        rows = rows_of(args.existing)
    else:
        common.remove(args.work_dir)
        try:
            rows = run(example, args.work_dir)
        finally:
            common.remove(args.work_dir)
    header = ["run", "mode", "test score (merged)", "test loss (text: bits/byte)", "steps per rank",
              "bytes all-reduced per rank", "of ddp's", "syncs", "train seconds"]  # fmt: skip
    print(common.table(header, rows))


if __name__ == "__main__":
    main()
