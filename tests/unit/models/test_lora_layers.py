"""PEFT's LoRA layers in a model, as the train stage puts them there (shardfuse.models.lora): what is
trained, what is stored, and what is refused."""

from __future__ import annotations

import pytest
import torch

from shardfuse.io import UserError
from shardfuse.models.adapter import load_state, storable_state
from shardfuse.models.lora import adapter_state, base_state, factor_pairs, inject


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Embedding(10, 8), torch.nn.Linear(8, 6), torch.nn.Linear(6, 4))


def test_only_the_factors_train_and_are_stored_and_the_base_keeps_its_own_names():
    net = model()
    before = {name: tensor.clone() for name, tensor in net.state_dict().items()}
    targets = inject(net, {"type": "lora", "r": 2, "target_modules": ["1", "2"]}, seed=0)
    assert targets == {
        "1": {"shape": [6, 8], "fan_in_fan_out": False},
        "2": {"shape": [4, 6], "fan_in_fan_out": False},
    }
    trained = sorted(name for name, p in net.named_parameters() if p.requires_grad)
    assert trained == [f"{m}.lora_{f}.default.weight" for m in ("1", "2") for f in "AB"]
    stored, ties = storable_state(net)
    assert sorted(stored) == [f"{m}.lora_{f}.weight" for m in ("1", "2") for f in "AB"] and ties == {}
    base = base_state(net, {})
    assert base.keys() == before.keys() and all(torch.equal(base[k], before[k]) for k in base)
    tokens = torch.tensor([[1, 2, 3]])
    with torch.no_grad():  # B starts at zero: the adapted model is the base model
        plain = model()
        assert torch.equal(net(tokens), plain(tokens))


def test_stored_factors_load_back_and_a_foreign_set_is_refused():
    net = model()
    inject(net, {"type": "lora", "r": 2, "target_modules": ["1"]}, seed=0)
    stored = {name: torch.randn_like(t) for name, t in adapter_state(net).items()}
    load_state(net, stored, "file")
    assert all(torch.equal(adapter_state(net)[k], stored[k]) for k in stored)
    with pytest.raises(UserError, match="does not hold this model's adapter factors"):
        load_state(net, {"2.lora_A.weight": torch.zeros(2, 6)}, "file")
    with pytest.raises(UserError, match="lacks its lora_B factor"):
        factor_pairs({"1.lora_A.weight": torch.zeros(2, 8)})


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        (["0", "1"], "matches module '0' (Embedding); adapters here train and fuse the updates of Linear"),
        (["attn"], "matches no module of the model; its adaptable modules are 1, 2: name some of them"),
    ],
)
def test_an_embedding_target_or_no_match_is_refused_in_one_line(targets, message):
    with pytest.raises(UserError) as caught:
        inject(model(), {"type": "lora", "r": 2, "target_modules": targets}, seed=0)
    assert message in str(caught.value) and "\n" not in str(caught.value)
