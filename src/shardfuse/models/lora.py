"""LoRA adapters in training: PEFT's LoRA layers injected into any model, the base frozen, and the
adapter tensors as the only state a rank stores.

A run with ``adapter: {type: lora, r, alpha, dropout, target_modules, init}`` trains, on every rank, a
low-rank update ΔW = (alpha / r)·B·A of each target module over frozen base weights (the model's own
initial weights: ``init_from``, a pretrained folder, or its seeded initialisation, the same on every
rank). :func:`inject` puts PEFT's layers in place (``peft.inject_adapter_in_model``: no wrapper, the
model's forward and output hook stay as they are) and freezes everything else; the optimiser, DDP and
the strategies then see the adapter parameters only (``requires_grad``), so DDP all-reduces their
gradients alone and ``bytes_all_reduced_per_rank`` counts them alone.

Names. PEFT keeps a target's frozen weight at ``<module>.base_layer.weight`` and its factors at
``<module>.lora_A.default.weight`` / ``lora_B``; shardfuse stores the factors as
``<module>.lora_A.weight`` / ``<module>.lora_B.weight`` (PEFT's file names without its wrapper prefix)
and the base under the model's own names (``<module>.weight``), so ``base.safetensors`` is the model a
non-adapter run would start from, and every later stage reads it as such.

Files. A rank's published file, its resume checkpoints and its kept best weights hold the adapter
tensors only (:func:`storable_state` of :mod:`shardfuse.models.adapter` asks :func:`adapter_state`);
the header's ``adapter`` entry records the config, the targets (shape and layout of each adapted
weight) and the sha256 of the training's ``base.safetensors``, which is stored once per training.
:func:`dense_weights` turns an adapter file back into a whole model (W0 + ΔW) for the stages that
score or export models; it refuses an adapter whose base is missing or is not the one it was trained
on.
"""

from __future__ import annotations

import functools
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from shardfuse.checkpoints.weights import load_weights
from shardfuse.io import UserError, sha256_file
from shardfuse.models.spec import ADAPTER_DEFAULTS

ADAPTER_NAME = "default"  # PEFT's name for the one adapter a model holds
FACTOR = re.compile(rf"^(?P<module>.+)\.lora_(?P<factor>[AB])\.{ADAPTER_NAME}\.weight$")
STORED_FACTOR = re.compile(r"^(?P<module>.+)\.lora_(?P<factor>[AB])\.weight$")
BASE_LAYER = ".base_layer."


def settings(adapter: Mapping[str, Any]) -> dict[str, Any]:
    """The adapter config with its defaults filled in (the schema's)."""
    return {**ADAPTER_DEFAULTS, **dict(adapter)}


def is_adapted(model: nn.Module) -> bool:
    return bool(getattr(model, "shardfuse_adapter", None))


ADAPTED_KINDS = ("Linear", "Conv1D")  # the layers whose update is one matrix B·A (GPT-2's Conv1D too)


def _linear_names(model: nn.Module) -> list[str]:
    """The modules an adapter can target here (Linear and GPT-2's Conv1D), by name."""
    return [name for name, module in model.named_modules() if name and type(module).__name__ in ADAPTED_KINDS]


def inject(model: nn.Module, adapter: Mapping[str, Any], seed: int) -> dict[str, dict[str, Any]]:
    """Put LoRA layers into ``model`` (A drawn from ``seed``, B zero: the model is unchanged), freeze
    every other parameter; returns the targets {module: {"shape": weight shape, "fan_in_fan_out"}}."""
    from peft import LoraConfig, inject_adapter_in_model  # deferred: peft imports transformers
    from peft.tuners.lora import LoraLayer

    cfg = settings(adapter)
    targets = cfg["target_modules"]
    try:
        config = LoraConfig(
            r=int(cfg["r"]),
            lora_alpha=float(cfg["alpha"]),
            lora_dropout=float(cfg["dropout"]),
            target_modules=targets,
            bias="none",
        )
        _check_ranks(model, config, cfg)
        torch.manual_seed(seed)
        inject_adapter_in_model(config, model, adapter_name=ADAPTER_NAME)
    except ValueError as exc:  # peft's NoMatchingPeftModuleError is a ValueError
        if "not found in the base model" not in str(exc) and "No modules were targeted" not in str(exc):
            raise
        names = _linear_names(model)
        shown = ", ".join(names[:12]) + (f", … ({len(names)} in all)" if len(names) > 12 else "")
        raise UserError(
            f"adapter.target_modules {targets!r} matches no module of the model; its adaptable modules "
            f"are {shown or 'none'}: name some of them (or all-linear)"
        ) from None
    found = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and type(module.get_base_layer()).__name__ not in ADAPTED_KINDS:
            kind = type(module.get_base_layer()).__name__
            raise UserError(
                f"adapter.target_modules {targets!r} matches module {name!r} ({kind}); adapters here "
                "train and fuse the updates of Linear and Conv1D layers only: leave it out of target_modules"
            )
        if isinstance(module, LoraLayer) and ADAPTER_NAME in getattr(module, "lora_A", {}):
            weight = module.get_base_layer().weight
            found[name] = {
                "shape": list(weight.shape),
                "fan_in_fan_out": bool(getattr(module, "fan_in_fan_out", False)),
            }
    if not found:
        raise UserError(
            f"adapter.target_modules {targets!r} matches no module PEFT's LoRA can adapt; name Linear "
            "or Conv1D modules of the model"
        )
    for name, param in model.named_parameters():
        param.requires_grad_(FACTOR.match(name) is not None)
    model.shardfuse_adapter = {"targets": found}
    return found


def _check_ranks(model: nn.Module, config: Any, cfg: Mapping[str, Any]) -> None:
    """r must not exceed a target's smaller dimension (the update would not be low-rank)."""
    from peft.tuners.tuners_utils import check_target_module_exists

    r = int(cfg["r"])
    for name, module in model.named_modules():
        weight = getattr(module, "weight", None)
        if not name or not isinstance(weight, torch.Tensor) or weight.dim() != 2:
            continue
        targeted = config.target_modules == "all-linear" or check_target_module_exists(config, name)
        if targeted and r > min(weight.shape):
            raise UserError(
                f"adapter.r {r} exceeds the smaller dimension of module {name!r} "
                f"({list(weight.shape)}); use r <= {min(weight.shape)} or leave {name} out of "
                "target_modules"
            )


def stored_name(name: str) -> str | None:
    """The stored name of a PEFT factor parameter (None for other names)."""
    match = FACTOR.match(name)
    return f"{match['module']}.lora_{match['factor']}.weight" if match else None


def adapter_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """The adapter factors under their stored names, in the model's order."""
    state = model.state_dict()
    return {stored: tensor for name, tensor in state.items() if (stored := stored_name(name)) is not None}


def base_name(name: str) -> str:
    """The model's own name of a tensor of an adapted model (``x.base_layer.weight`` -> ``x.weight``)."""
    return name.replace(BASE_LAYER, ".")


def base_state(model: nn.Module, ties: Mapping[str, str]) -> dict[str, torch.Tensor]:
    """The frozen base under the model's own names (no factors, tied aliases left out)."""
    state = {}
    for name, tensor in model.state_dict().items():
        if stored_name(name) is not None or name in ties:
            continue
        state[base_name(name)] = tensor
    return state


def load_adapter_state(model: nn.Module, tensors: Mapping[str, torch.Tensor], source: str) -> None:
    """Load stored factors into an adapted model: exactly its factors, each of its shape."""
    expected = adapter_state(model)
    if set(tensors) != set(expected):
        odd = sorted(set(tensors) ^ set(expected))[:3]
        raise UserError(
            f"{source} does not hold this model's adapter factors (e.g. {', '.join(odd)}); load the "
            "adapter of a training with the same model and target_modules"
        )
    with torch.no_grad():
        for name, target in expected.items():
            if tensors[name].shape != target.shape:
                raise UserError(
                    f"{source}: {name} is {list(tensors[name].shape)} but the adapter has "
                    f"{list(target.shape)}; load the adapter of a training with the same r"
                )
            target.copy_(tensors[name])


def factor_pairs(tensors: Mapping[str, Any]) -> dict[str, tuple[Any, Any]]:
    """{module: (A, B)} of stored factors; a module with one factor only is refused."""
    found: dict[str, dict[str, Any]] = {}
    for name, tensor in tensors.items():
        match = STORED_FACTOR.match(name)
        if match is None:
            raise UserError(f"adapter tensor {name!r} is not a LoRA factor (<module>.lora_A/B.weight)")
        found.setdefault(match["module"], {})[match["factor"]] = tensor
    for module, pair in found.items():
        if set(pair) != {"A", "B"}:
            missing = "B" if "A" in pair else "A"
            raise UserError(f"adapter of module {module!r} lacks its lora_{missing} factor")
    return {module: (pair["A"], pair["B"]) for module, pair in found.items()}


def _sha256(path: Path, stat: os.stat_result) -> str:
    """The file's sha256, computed once per (path, size, mtime) in this process: evaluate forms every
    rank's model over one base."""
    return _cached_sha256(str(path), stat.st_size, stat.st_mtime_ns)


@functools.lru_cache(maxsize=8)
def _cached_sha256(path: str, _size: int, _mtime_ns: int) -> str:
    return sha256_file(path)


def base_of(path: Path, metadata: Mapping[str, Any]) -> Path:
    """The base ``path``'s adapter was trained on (its sibling ``base.safetensors``), checked: present,
    and the very file the adapter's header names by sha256."""
    adapter = metadata["adapter"]
    base = path.parent / str(adapter.get("base", "base.safetensors"))
    if not base.is_file():
        raise UserError(
            f"adapter checkpoint {path} has no base beside it ({base.name}, the frozen weights it was "
            "trained on); keep the training's directory whole, or re-run training (snakemake -R train)"
        )
    if _sha256(base, base.stat()) != adapter.get("base_sha256"):
        raise UserError(
            f"the base {base} is not the one adapter checkpoint {path} was trained on (its sha256 "
            "differs from the header's base_sha256); re-run training (snakemake -R train)"
        )
    return base


def dense_weights(
    path: Path, tensors: Mapping[str, torch.Tensor], metadata: Mapping[str, Any]
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A whole model from an adapter file: (its base's tensors with each adapted weight
    W0 + (alpha/r)·B·A, summed in float64 and cast to W0's dtype as the merge stage adds merged
    updates; the file's metadata with the base's ``ties`` and no ``adapter``)."""
    base, base_meta = load_weights(base_of(path, metadata))
    adapter = metadata["adapter"]
    scaling = float(adapter["alpha"]) / int(adapter["r"])
    for module, (a, b) in factor_pairs(tensors).items():
        name = f"{module}.weight"
        if name not in base:
            raise UserError(f"adapter checkpoint {path} adapts {module!r}, which its base does not hold")
        update = scaling * (b.double() @ a.double())
        if adapter["targets"].get(module, {}).get("fan_in_fan_out"):
            update = update.T
        weight = base[name]
        if update.shape != weight.shape:
            raise UserError(
                f"adapter checkpoint {path}: the update of {module!r} is {list(update.shape)} but the base "
                f"weight is {list(weight.shape)}; fuse adapters over the base they were trained on"
            )
        base[name] = (weight.double() + update).to(weight.dtype)
    dense_meta = {key: value for key, value in metadata.items() if key not in ("adapter", "ties")}
    if "ties" in base_meta:
        dense_meta["ties"] = base_meta["ties"]
    return base, dense_meta


def load_model_weights(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """``load_weights``, but a whole model also from a LoRA rank file (its factors added to the base it
    was trained on, :func:`dense_weights`): what scoring or exporting a checkpoint reads."""
    tensors, metadata = load_weights(path)
    if not metadata.get("adapter"):
        return tensors, metadata
    return dense_weights(Path(path), tensors, metadata)
