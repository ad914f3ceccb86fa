"""Permutation alignment as the merge stage runs it: for ranks trained from a shared initialisation it is
a no-op (bitwise the same merged bytes as no alignment)."""

from __future__ import annotations

import shutil

from tests.support.helpers import call_stage
from tests.support.training import merge_and_evaluate


def test_alignment_of_shared_initialisation_ranks_is_a_bitwise_no_op(
    tmp_path, small_trainings, digits_dataset
):
    ranks = tmp_path / "independent" / "ranks"
    shutil.copytree(small_trainings / "results" / "trainings" / "independent" / "ranks", ranks)
    gather = ranks.parent / "gather.json"
    proc = call_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", gather)
    assert proc.returncode == 0, proc.stderr[-2000:]
    plain, _ = merge_and_evaluate(tmp_path, digits_dataset, gather, "none")
    aligned, _ = merge_and_evaluate(tmp_path, digits_dataset, gather, "weight_matching")
    assert aligned["alignment"]["ranks"] == [{"rank": 1, "sweeps": 1, "moved_units": {"hidden0": 0}}]
    assert aligned["sha256"] == plain["sha256"]  # the same merged bytes
    assert aligned["ingredients"] == plain["ingredients"]
