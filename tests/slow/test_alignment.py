"""The alignment demonstration: ranks with their own initialisations collapse when averaged as they are
and recover most of the best rank's accuracy when aligned by weight matching first."""

from __future__ import annotations

from shardfuse.checkpoints.weights import load_weights
from tests.support.data import prepare_and_partition
from tests.support.training import merge_and_evaluate, train_and_gather


def test_weight_matching_recovers_what_averaging_independent_initialisations_destroys(
    tmp_path, digits_dataset
):
    dataset, shards = prepare_and_partition(
        tmp_path / "data", "digits", '{"source": "digits", "test_fraction": 0.2, "seed": 0}', world_size=4
    )
    gather = train_and_gather(tmp_path, dataset, shards, "own", 4, init="per_rank")
    _, plain = merge_and_evaluate(tmp_path, dataset, gather, "none")
    record, aligned = merge_and_evaluate(tmp_path, dataset, gather, "weight_matching")
    best = plain["best_rank_accuracy"]
    print(
        f"init per_rank, 4 ranks, MLP [128, 128] on digits: best rank {best:.4f}, uniform "
        f"{plain['merged']['accuracy']:.4f}, weight matching + uniform {aligned['merged']['accuracy']:.4f}"
    )
    assert plain["merged"]["accuracy"] < 0.5  # averaging unrelated units: toward chance (0.1)
    assert aligned["merged"]["accuracy"] > best - 0.05  # most of the best rank's accuracy back
    assert all(sum(rank["moved_units"].values()) > 100 for rank in record["alignment"]["ranks"])
    tensors, _ = load_weights(gather.parent / "ranks" / "rank-0.safetensors")
    assert tensors  # the reference rank's file is read, never rewritten
