"""init_from's reader in-process: a plain safetensors file, a save_pretrained folder (one file, or shards
and their index), a prefix map, tied tensors under either name, and the one-line misfits (the first
missing or unexpected tensor named, with the file)."""

from __future__ import annotations

import json
import sys

import pytest
import torch
from safetensors.torch import save_file

from shardfuse.checkpoints.init_weights import (
    INDEX_FILE,
    header_digest,
    match_names,
    read_init_weights,
    renamed,
    weight_files,
)
from shardfuse.checkpoints.weights import save_weights
from shardfuse.io import UserError
from shardfuse.models.adapter import storable_state
from shardfuse.rank.setup import load_init_weights, state_digest
from tests.support.helpers import REPO

sys.path.insert(0, str(REPO / "tests/support/models"))
from tied_lm import TiedLM


def tied(seed: int = 0, dtype=torch.float32) -> TiedLM:
    torch.manual_seed(seed)
    return TiedLM(11, 6, 8).to(dtype)


def stored(model: torch.nn.Module, prefix: str = "") -> dict[str, torch.Tensor]:
    """The model's tensors as a foreign file would hold them: the tie once, contiguous copies."""
    return {prefix + name: tensor.clone() for name, tensor in storable_state(model)[0].items()}


def assert_loaded(path, source: TiedLM, **prefix) -> TiedLM:
    target = tied(seed=9)
    load_init_weights(target, path, prefix.get("prefix_map"))
    assert target.head.weight is target.embed.weight  # still tied
    assert state_digest(target) == state_digest(source)
    return target


def test_a_plain_safetensors_file_without_a_shardfuse_header_loads(tmp_path):
    source = tied(seed=1)
    save_file(stored(source), tmp_path / "model.safetensors")
    assert read_init_weights(tmp_path / "model.safetensors").foreign
    assert_loaded(tmp_path / "model.safetensors", source)


def test_a_save_pretrained_folder_with_one_file_loads(tmp_path):
    source = tied(seed=1)
    save_file(stored(source), tmp_path / "model.safetensors", metadata={"format": "pt"})
    (tmp_path / "config.json").write_text("{}")
    assert weight_files(tmp_path).shards == (tmp_path / "model.safetensors",)
    assert_loaded(tmp_path, source)


def test_a_sharded_folder_loads_through_its_index(tmp_path):
    source = tied(seed=1)
    tensors = stored(source)
    names = list(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    for shard, shard_names in shards.items():
        save_file({name: tensors[name] for name in shard_names}, tmp_path / shard)
    weight_map = {name: shard for shard, shard_names in shards.items() for name in shard_names}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    files = weight_files(tmp_path)
    assert [path.name for path in files.paths] == [INDEX_FILE, *shards]
    assert_loaded(tmp_path, source)


def test_an_index_naming_a_shard_that_lacks_the_tensor_is_refused(tmp_path):
    tensors = stored(tied())
    save_file(tensors, tmp_path / "a.safetensors")
    save_file({"other": torch.zeros(1)}, tmp_path / "b.safetensors")
    weight_map = {name: "a.safetensors" for name in tensors} | {"mix.bias": "b.safetensors"}
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": weight_map}))
    with pytest.raises(UserError, match=r"puts tensor 'mix.bias' in b.safetensors, which does not hold it"):
        read_init_weights(tmp_path)
    (tmp_path / INDEX_FILE).write_text(json.dumps({"weight_map": {"x": "../a.safetensors"}}))
    with pytest.raises(UserError, match=r"puts tensor 'x' in '../a.safetensors', not a file of the folder"):
        weight_files(tmp_path)


def test_a_folder_without_safetensors_is_refused_and_a_pickle_never_read(tmp_path):
    with pytest.raises(UserError, match=r"is a folder without model.safetensors or model.safetensors.index"):
        weight_files(tmp_path)
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(UserError, match=r"holds pytorch_model.bin but no model.safetensors: shardfuse reads"):
        load_init_weights(tied(), tmp_path)


def test_a_prefix_map_renames_the_files_tensors_and_null_leaves_some_out(tmp_path):
    source = tied(seed=1)
    tensors = {**stored(source, prefix="model."), "cls.weight": torch.zeros(2)}
    save_file(tensors, tmp_path / "w.safetensors")
    assert_loaded(tmp_path / "w.safetensors", source, prefix_map={"model.": "", "cls.": None})
    with pytest.raises(UserError, match=r"has no tensor 'position' that the model needs \(after init_from"):
        load_init_weights(tied(), tmp_path / "w.safetensors", {"cls.": None})
    assert renamed("h.0.w", {"": "transformer.", "h.0.": "layer0."}) == "layer0.w"  # the longest prefix
    assert renamed("h.0.w", {"x.": ""}) == "h.0.w"


def test_two_tensors_renamed_onto_one_name_are_refused(tmp_path):
    save_file({"a.mix.bias": torch.zeros(8), "b.mix.bias": torch.zeros(8)}, tmp_path / "w.safetensors")
    weights = read_init_weights(tmp_path / "w.safetensors")
    with pytest.raises(UserError, match=r"tensors 'a.mix.bias' and 'b.mix.bias' both become 'mix.bias'"):
        match_names(weights, {}, {}, {"a.": "", "b.": ""})


@pytest.mark.parametrize("stored_as", ["source", "alias", "both"])
def test_a_tied_tensor_may_be_stored_under_either_name_or_both(tmp_path, stored_as):
    source = tied(seed=1)
    tensors = stored(source)
    if stored_as != "source":
        tensors["head.weight"] = tensors["embed.weight"].clone()
    if stored_as == "alias":
        del tensors["embed.weight"]
    save_file(tensors, tmp_path / "w.safetensors")
    assert_loaded(tmp_path / "w.safetensors", source)


def test_two_different_copies_of_a_tied_tensor_are_refused(tmp_path):
    tensors = stored(tied(seed=1))
    tensors["head.weight"] = tensors["embed.weight"] + 1
    save_file(tensors, tmp_path / "w.safetensors")
    with pytest.raises(UserError, match=r"holds 'head.weight' and 'embed.weight' with different values"):
        load_init_weights(tied(), tmp_path / "w.safetensors")


def test_the_first_missing_and_the_first_unexpected_tensor_are_named_with_the_file(tmp_path):
    tensors = stored(tied())
    path = tmp_path / "w.safetensors"
    save_file({name: t for name, t in tensors.items() if name != "mix.weight"}, path)
    with pytest.raises(UserError) as missing:
        load_init_weights(tied(), path)
    assert str(missing.value) == (
        f"init_from {path} has no tensor 'mix.weight' that the model needs; start from weights of this "
        "architecture (model, model_args), or map the file's names onto the model's with init_from_prefix"
    )
    save_file({**tensors, "z.bias": torch.zeros(1), "extra.bias": torch.zeros(1)}, path)
    with pytest.raises(UserError, match=rf"init_from {path} has tensor 'extra.bias' the model does not have"):
        load_init_weights(tied(), path)
    save_file({**tensors, "mix.weight": torch.zeros(8, 3)}, path)
    with pytest.raises(
        UserError, match=r"'mix.weight' is torch.float32 \[8, 3\] but the model needs torch.float32 \[8, 8\]"
    ):
        load_init_weights(tied(), path)


def test_a_foreign_files_floats_are_cast_but_a_shardfuse_checkpoints_dtype_must_match(tmp_path):
    source = tied(seed=1)
    save_file(stored(source), tmp_path / "fp32.safetensors")
    target = tied(seed=9, dtype=torch.bfloat16)
    load_init_weights(target, tmp_path / "fp32.safetensors")
    assert target.embed.weight.dtype == torch.bfloat16
    assert torch.equal(target.embed.weight, source.embed.weight.to(torch.bfloat16))
    tensors, ties = storable_state(source)
    save_weights(tmp_path / "ours.safetensors", tensors, {"ties": ties})
    assert not read_init_weights(tmp_path / "ours.safetensors").foreign
    with pytest.raises(
        UserError, match=r"tensor 'position' is torch.float32 \[6, 8\] but the model needs torch.bfloat16"
    ):
        load_init_weights(tied(dtype=torch.bfloat16), tmp_path / "ours.safetensors")


def test_the_header_digest_follows_names_and_shapes_not_values(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"a": torch.zeros(2, 3)}, path)
    first = header_digest(path)
    save_file({"a": torch.ones(2, 3)}, path)
    assert header_digest(path) == first
    save_file({"a": torch.ones(3, 2)}, path)
    assert header_digest(path) != first
    path.write_bytes(b"\x00" * 4)
    with pytest.raises(UserError, match="is not a readable safetensors file"):
        header_digest(path)


def test_a_foreign_file_with_a_nan_weight_is_refused_before_training_starts(tmp_path):
    """Not "loss is nan" at step 1: the file and the tensor are named when the ranks load it."""
    tensors = stored(tied(seed=1))
    name = next(iter(tensors))
    tensors[name].view(-1)[3] = float("nan")
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(UserError) as refused:
        load_init_weights(tied(), tmp_path / "model.safetensors")
    assert str(refused.value) == (
        f"init_from {tmp_path / 'model.safetensors'} holds 1 inf or NaN value(s) in tensor {name!r}; "
        "training cannot start from it: fix or replace the file"
    )
