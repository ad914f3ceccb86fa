"""Permutation alignment (weight matching, Git Re-Basin) before a merge: hidden units found again
after a random permutation (MLP and CNN with BatchNorm), a no-op for shared-initialisation ranks
(bitwise the same merge), and the demonstration: ranks with their own initialisations collapse when
averaged as they are and recover when aligned first."""

from __future__ import annotations

import json

import pytest
import torch

from shardfuse.align import (
    apply_permutations,
    cnn_groups,
    is_identity,
    mlp_groups,
    permutation_groups,
    weight_matching,
)
from shardfuse.builtin_models import CNN
from shardfuse.checkpoint import load_weights
from shardfuse.io import UserError
from shardfuse.models import MLP
from tests.helpers import run_stage


def _shuffled(state: dict[str, torch.Tensor], groups, seed: int) -> tuple[dict, dict]:
    generator = torch.Generator().manual_seed(seed)
    perms = {
        group: torch.randperm(state[members[0][0]].shape[members[0][1]], generator=generator)
        for group, members in groups.items()
    }
    return apply_permutations(state, groups, perms), perms


def test_weight_matching_finds_a_random_permutation_of_an_mlp_again():
    torch.manual_seed(0)
    model = MLP(8, 3, [16, 12], "relu", 0.0)
    state = model.state_dict()
    groups = mlp_groups(list(state))
    assert sorted(groups) == ["hidden0", "hidden1"]
    shuffled, _ = _shuffled(state, groups, seed=1)
    other = MLP(8, 3, [16, 12], "relu", 0.0)
    other.load_state_dict(shuffled)
    inputs = torch.randn(7, 8)
    torch.testing.assert_close(other(inputs), model(inputs))  # a permutation keeps the function
    perms, _ = weight_matching(state, shuffled, groups)
    aligned = apply_permutations(shuffled, groups, perms)
    assert all(torch.equal(aligned[name], state[name]) for name in state)


def test_weight_matching_aligns_cnn_channels_with_their_batchnorm_statistics():
    torch.manual_seed(0)
    model = CNN((1, 8, 8), [6, 5], num_outputs=4, dropout=0.0, scale_targets=False)
    with torch.no_grad():  # non-trivial running statistics, so their permutation is checked too
        for module in model.modules():
            if isinstance(module, torch.nn.BatchNorm2d):
                module.running_mean.uniform_(-1, 1)
                module.running_var.uniform_(0.5, 2)
    state = model.state_dict()
    groups = cnn_groups(list(state))
    assert [name for name, _ in groups["channels0"]][-1] == "features.4.weight"  # after pooling: conv 2
    assert groups["channels1"][-1] == ("head.weight", 1)
    shuffled, _ = _shuffled(state, groups, seed=2)
    model.eval()
    other = CNN((1, 8, 8), [6, 5], num_outputs=4, dropout=0.0, scale_targets=False).eval()
    other.load_state_dict(shuffled)
    images = torch.randn(3, 1, 8, 8)
    torch.testing.assert_close(other(images), model(images), rtol=1e-5, atol=1e-6)
    perms, _ = weight_matching(state, shuffled, groups)
    aligned = apply_permutations(shuffled, groups, perms)
    assert all(torch.equal(aligned[name], state[name]) for name in state)


def test_a_model_matched_with_itself_keeps_the_identity():
    torch.manual_seed(3)
    state = MLP(8, 3, [16], "relu", 0.0).state_dict()
    perms, sweeps = weight_matching(state, state, mlp_groups(list(state)))
    assert is_identity(perms) and sweeps == 1


def test_a_user_model_without_permutation_groups_cannot_be_aligned(digits_dataset):
    from shardfuse.data import read_dataset_info
    from shardfuse.models import model_spec
    from tests.helpers import REPO

    code = [str(REPO / "config/examples/models")]
    spec = model_spec("resmlp:build", {"width": 8, "blocks": 1}, code, read_dataset_info(digits_dataset))
    with pytest.raises(
        UserError, match="declare them, 'resmlp:build' does not; give it a permutation_groups"
    ):
        permutation_groups(spec, ["model.x"])


def _train(tmp_path, dataset, shards, name, world_size, **cfg):
    out = tmp_path / name / "ranks"
    config = {
        "hidden_sizes": [128, 128], "activation": "relu", "dropout": 0.0, "optimizer": "adamw", "lr": 0.003,
        "momentum": 0.9, "weight_decay": 0.0, "batch_size": 32, "epochs": 20, "seed": 0,
        "strategy": "localsgd", "sync_every": 0, **cfg,
    }  # fmt: skip
    proc = run_stage(
        "launch", "--nproc-per-node", world_size, "--out-dir", out, "--", "--run-name", name,
        "--shard-dir", shards, "--dataset-dir", dataset, "--config-json", json.dumps(config), timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    gather = tmp_path / name / "gather.json"
    proc = run_stage("gather", "--train-dir", out, "--world-size", world_size, "--out", gather)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return gather


def _merge_and_score(tmp_path, dataset, gather, align: str) -> tuple[dict, dict]:
    merged, record, evaluation = (
        tmp_path / f"{gather.parent.name}-{align}{ext}" for ext in (".safetensors", ".json", ".eval.json")
    )
    proc = run_stage(
        "merge", "--gather", gather, "--method", "uniform", "--align", align,
        "--out-weights", merged, "--out-json", record,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    proc = run_stage(
        "evaluate", "--run", "r", "--test", dataset / "test.parquet", "--gather", gather,
        "--merged", merged, "--out", evaluation,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return json.loads(record.read_text()), json.loads(evaluation.read_text())


@pytest.mark.integration
def test_alignment_of_shared_initialisation_ranks_is_a_bitwise_no_op(tmp_path, digits_dataset, digits_shards):
    gather = _train(tmp_path, digits_dataset, digits_shards, "shared", 2, hidden_sizes=[32], epochs=3)
    plain, _ = _merge_and_score(tmp_path, digits_dataset, gather, "none")
    aligned, _ = _merge_and_score(tmp_path, digits_dataset, gather, "weight_matching")
    assert aligned["alignment"]["ranks"] == [{"rank": 1, "sweeps": 1, "moved_units": {"hidden0": 0}}]
    assert aligned["sha256"] == plain["sha256"]  # the same merged bytes
    assert aligned["ingredients"] == plain["ingredients"]


@pytest.mark.integration
@pytest.mark.slow
def test_weight_matching_recovers_what_averaging_independent_initialisations_destroys(
    tmp_path, digits_dataset
):
    from tests.conftest import prepare_and_partition

    dataset, shards = prepare_and_partition(
        tmp_path / "data", "digits", '{"source": "digits", "test_fraction": 0.2, "seed": 0}', world_size=4
    )
    gather = _train(tmp_path, dataset, shards, "own", 4, init="per_rank")
    _, plain = _merge_and_score(tmp_path, dataset, gather, "none")
    record, aligned = _merge_and_score(tmp_path, dataset, gather, "weight_matching")
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
