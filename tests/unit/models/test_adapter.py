"""The model adapter in-process: ties found from the module (meta device too), stored once and re-tied
on load, differing copies refused; dict and ModelOutput outputs; any dtype hashed; a buffer the forward
updates found by a probe that changes nothing."""

from __future__ import annotations

import sys
from collections import OrderedDict
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.io import UserError
from shardfuse.models.adapter import (
    expand_ties,
    file_ties,
    load_state,
    select_output,
    storable_state,
    tensor_bytes,
    ties_of,
)
from shardfuse.models.registry import check_output_shape
from shardfuse.rank.setup import forward_updates_buffers, state_digest
from tests.support.helpers import REPO

sys.path.insert(0, str(REPO / "tests/support/models"))
from tied_lm import TiedLM

DESCRIPTION = SimpleNamespace(vocab_size=11, block_size=6)


def tied(seed: int = 0, dtype=torch.float32) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(11, 6, 8).to(dtype)


def test_ties_are_found_from_the_module_on_any_device():
    assert ties_of(tied()) == {"head.weight": "embed.weight"}
    with torch.device("meta"):
        assert ties_of(TiedLM(11, 6, 8)) == {"head.weight": "embed.weight"}
    assert ties_of(nn.Linear(2, 2)) == {}


def test_a_tied_model_is_saved_once_and_loads_back_tied(tmp_path):
    source = tied(seed=1)
    tensors, ties = storable_state(source)
    assert "head.weight" not in tensors
    save_weights(tmp_path / "w.safetensors", tensors, {"ties": ties})  # safetensors refuses shared memory
    loaded, metadata = load_weights(tmp_path / "w.safetensors")
    target = tied(seed=2)
    load_state(target, loaded, "w", file_ties(metadata))
    assert target.head.weight is target.embed.weight
    assert torch.equal(target.embed.weight, source.embed.weight)
    assert state_digest(target) == state_digest(source)


def test_a_file_ties_an_untied_model_by_its_header():
    untied = nn.ModuleDict({"a": nn.Linear(3, 3, bias=False), "b": nn.Linear(3, 3, bias=False)})
    weight = torch.randn(3, 3)
    load_state(untied, {"a.weight": weight}, "f", {"b.weight": "a.weight"})
    assert torch.equal(untied["b"].weight, weight)


def test_differing_copies_of_a_tied_tensor_are_refused():
    state = dict(tied().state_dict())
    state["head.weight"] = state["head.weight"] + 1
    with pytest.raises(UserError, match=r"holds 'head\.weight' and 'embed\.weight' with different values"):
        expand_ties(state, {"head.weight": "embed.weight"}, "x.safetensors")


def test_dict_and_model_outputs_give_the_named_field():
    logits = torch.ones(2, 3)
    assert select_output({"logits": logits, "hidden": 0}, "logits", "m") is logits
    assert select_output(OrderedDict(scores=logits), "scores", "m") is logits
    assert select_output(logits, "logits", "m") is logits
    with pytest.raises(UserError, match=r"fields \['hidden'\] and no tensor 'logits'; set model_output"):
        select_output({"hidden": logits}, "logits", "m")


def test_a_tuple_output_names_the_fix():
    class Pair(nn.Module):
        def forward(self, x):
            return (x, x)

    spec = {
        "model": "m:build", "args": {}, "task": "classification", "code": None,
        "description": {"task": "classification", "num_features": 3, "num_outputs": 3, "feature_names": [],
                        "label_names": [], "num_classes": 3},
    }  # fmt: skip
    with pytest.raises(
        UserError, match=r"returns tuple, not a tensor; return the outputs tensor \(e\.g\. `\.logits`"
    ):
        check_output_shape(Pair(), spec, torch.device("cpu"))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_tensor_bytes_are_the_raw_bytes_of_any_dtype(dtype):
    tensor = torch.arange(6, dtype=torch.float32).reshape(2, 3).to(dtype)
    assert len(tensor_bytes(tensor)) == 6 * tensor.element_size()
    if dtype == torch.float32:
        assert tensor_bytes(tensor) == tensor.numpy().tobytes()
    assert tensor_bytes(torch.tensor(1.5)) == torch.tensor(1.5).numpy().tobytes()


def test_a_buffer_the_forward_updates_is_found_by_a_probe_that_changes_nothing():
    model = tied()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    rng = torch.get_rng_state()
    assert forward_updates_buffers(model, torch.zeros(2, 6, dtype=torch.long))
    assert torch.equal(torch.get_rng_state(), rng)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert not forward_updates_buffers(model)  # no probe: only normalisation layers count
    assert not forward_updates_buffers(nn.Linear(2, 2), torch.zeros(1, 2))
