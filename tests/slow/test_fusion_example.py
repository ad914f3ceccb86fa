"""The README's fusion example, run exactly as it shows it: ranks with their own initialisations,
averaged as they are and after weight matching."""

from __future__ import annotations

import csv
import json
import shlex

from tests.support.helpers import checkout_copy, readme_block, run_in, snakemake_failure


def test_weight_matching_recovers_the_ranks_that_plain_averaging_loses(tmp_path):
    checkout = checkout_copy(tmp_path)
    (line,) = [line for line in readme_block("examples-fusion").splitlines() if line.strip()]
    proc = run_in(checkout, shlex.split(line.split("#")[0]), timeout=1200)
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    with open(checkout / "results" / "experiments" / "shardfuse-align" / "summary.csv", newline="") as fh:
        rows = {row["run"]: row for row in csv.DictReader(fh)}
    plain, aligned = rows["own_uniform"], rows["own_aligned"]
    best = float(plain["test_accuracy_best_rank"])
    assert float(plain["test_accuracy_merged"]) < 0.5  # unrelated units averaged: toward chance
    assert float(aligned["test_accuracy_merged"]) > best - 0.05
    assert float(aligned["test_accuracy_ensemble"]) >= float(aligned["test_accuracy_merged"]) - 0.01
    record = json.loads((checkout / "results" / "runs" / "own_aligned" / "merge.json").read_text())
    assert [rank["rank"] for rank in record["alignment"]["ranks"]] == [1, 2, 3]
