"""Permutation alignment (weight matching, Git Re-Basin) before a merge: hidden units found again
after a random permutation (MLP and CNN with BatchNorm), a no-op for shared-initialisation ranks
(bitwise the same merge), and the demonstration: ranks with their own initialisations collapse when
averaged as they are and recover when aligned first."""

from __future__ import annotations

import pytest
import torch

from shardfuse.fusion.align import apply_permutations, is_identity, permutation_groups, weight_matching
from shardfuse.io import UserError
from shardfuse.models.builtin import CNN, cnn_groups
from shardfuse.models.mlp import MLP, mlp_groups


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
    from shardfuse.data.dataset_info import read_dataset_info
    from shardfuse.models.spec import model_spec
    from tests.support.helpers import REPO

    code = [str(REPO / "config/examples/models")]
    spec = model_spec("resmlp:build", {"width": 8, "blocks": 1}, code, read_dataset_info(digits_dataset))
    with pytest.raises(
        UserError, match="declare them, 'resmlp:build' does not; give it a permutation_groups"
    ):
        permutation_groups(spec, ["model.x"])
