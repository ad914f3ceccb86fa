"""The one layer between a user's module and the framework: what its forward returns, which of its
tensors are one tensor under two names, and the bytes of any dtype.

- **Outputs**: a model may return a tensor, a dict or a Hugging Face ``ModelOutput``; a forward hook
  (:func:`attach_output`) hands every stage the tensor under ``model_output`` (``logits`` by default),
  so train, DDP, evaluate and merge's greedy soup see one kind of output and the state dict keeps the
  model's own names.
- **Tied parameters** (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; most small causal LMs,
  T5 and BERT heads tie likewise): found from the module itself (one Parameter or buffer object under
  two names), stored once in every file the project writes (:func:`storable_state`; safetensors
  refuses tensors that share memory) and recorded in its header as ``ties`` {alias: source}; expanded
  again on load (:func:`load_state`), which refuses a file whose two copies of a tied tensor differ.
  The merge engine works on the stored tensors, so a tied tensor is merged once.
- **Dtypes**: :func:`tensor_bytes` hashes bf16 and fp16 tensors as well as fp32 (numpy has no bf16).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from shardfuse.io import UserError


def ties_of(model: nn.Module) -> dict[str, str]:
    """{alias: source} for every state-dict entry that is the same Parameter or buffer as an earlier
    one (the source: the first name in state-dict order). Works on the meta device too."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, tensor in model.state_dict(keep_vars=True).items():
        source = first.setdefault(id(tensor), name)
        if source != name:
            ties[name] = source
    return ties


def storable_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(the state dict without the aliases of tied tensors, the ties): what a weights file holds. For a
    model with a LoRA adapter, its factors alone (the frozen base is stored once per training:
    :mod:`shardfuse.models.lora`)."""
    if getattr(model, "shardfuse_adapter", None):
        from shardfuse.models.lora import adapter_state

        return adapter_state(model), {}
    ties = ties_of(model)
    state = {name: tensor for name, tensor in model.state_dict().items() if name not in ties}
    return state, ties


def expand_ties(
    tensors: Mapping[str, torch.Tensor], ties: Mapping[str, str], source: str
) -> dict[str, torch.Tensor]:
    """``tensors`` with every alias filled from its source; an alias stored beside its source must
    hold the same values (a file written by the same model untied)."""
    full = dict(tensors)
    for alias, origin in ties.items():
        if origin not in full:
            continue  # the strict load names the missing tensor
        if alias in full and not torch.equal(full[alias], full[origin]):
            raise UserError(
                f"{source} holds {alias!r} and {origin!r} with different values, but the model ties them; "
                "load it into the model it was trained as (untied: tie_word_embeddings false)"
            )
        full[alias] = full[origin]
    return full


def load_state(
    model: nn.Module, tensors: Mapping[str, torch.Tensor], source: str, file_ties: Mapping[str, str] = ()
) -> None:
    """Load a stored state (aliases of tied tensors left out) into ``model``, strictly; the ties are
    the model's own and those the file's header records. A model with a LoRA adapter loads its factors
    (what :func:`storable_state` stored)."""
    if getattr(model, "shardfuse_adapter", None):
        from shardfuse.models.lora import load_adapter_state

        load_adapter_state(model, tensors, source)
        return
    ties = {**dict(file_ties or {}), **ties_of(model)}
    model.load_state_dict(expand_ties(tensors, ties, source))


def file_ties(metadata: Mapping[str, Any]) -> dict[str, str]:
    """The ``ties`` a weights file's header records ({} for files without tied tensors)."""
    ties = metadata.get("ties") if isinstance(metadata, Mapping) else None
    return {str(k): str(v) for k, v in ties.items()} if isinstance(ties, Mapping) else {}


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The tensor's raw bytes (C order) whatever its dtype; numpy cannot hold bf16."""
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    return flat.view(torch.uint8).numpy().tobytes()


def select_output(outputs: Any, key: str, model_name: str) -> Any:
    """The tensor of a dict or ``ModelOutput`` (a Mapping) under ``key``; a tensor as it is."""
    if isinstance(outputs, torch.Tensor) or not isinstance(outputs, Mapping):
        return outputs
    if key in outputs and isinstance(outputs[key], torch.Tensor):
        return outputs[key]
    raise UserError(
        f"model {model_name!r} returns {type(outputs).__name__} with fields {sorted(outputs)} and no tensor "
        f"{key!r}; set model_output to the field holding the outputs"
    )


def attach_output(model: nn.Module, key: str, model_name: str) -> nn.Module:
    """Make ``model`` return the tensor ``select_output`` picks, through a forward hook (no wrapper
    module, so the state dict keeps its names)."""

    def pick(_module: nn.Module, _inputs: Any, outputs: Any) -> Any:
        return select_output(outputs, key, model_name)

    model.register_forward_hook(pick)
    return model
