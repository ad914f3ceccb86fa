"""FSDP2 inside replica groups (run key ``fsdp: S``): the mesh, the wrap units, the local shards.

``world_size = replicas x S``; replica ``r`` is ranks ``r*S ... r*S + S - 1`` (a 2-D device mesh
``(replicate, shard)``, always built on the ranks' own device type: on CPU the explicit CPU mesh with
gloo). Inside a replica every wrap unit, then the root, is ``fully_shard``-ed over the ``shard``
dimension: each rank holds 1/S of the parameters, their gradients and the optimiser state. The wrap
units are the built-in transformer's blocks, the built-in mlp's Linear layers, an HF model's decoder
layers (the classes its ``_no_split_modules`` names) or what a user model's ``fsdp_units()`` returns.

Across replicas the strategies act as without FSDP: one that reduces gradients (``ddp``, its record's
``reduces_gradients``) shards over the whole 2-D mesh (HSDP: gradients reduce-scattered inside the
replica and all-reduced across replicas), ``localsgd`` and ``diloco`` average each rank's *local*
shards over the ``replicate`` dimension (identical sharding in every replica makes shard ``s`` of every
replica the same slice), ``sync_every: 0`` never.

Checkpoints hold each rank's local shards (safetensors + JSON, :mod:`shardfuse.rank.resume`, atomic as
every checkpoint): a rank resumes its own slices bitwise. Not torch.distributed.checkpoint: its
FileSystemWriter stores the checkpoint's metadata as a pickle that a resume would unpickle, and its
safetensors writer (HuggingFaceStorageWriter) holds tensors only, not the optimiser's param groups. The
price: a checkpoint resumes only with the same fsdp (no resharding on load), which a different fsdp
never asks for, since fsdp is part of the training's name. The published weights are one full file per
replica, gathered parameter by parameter (``full_tensor``) and written by the replica's first rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.io import UserError
from shardfuse.strategies.sync import is_dtensor, local


@dataclass(frozen=True)
class Layout:
    """Where a rank sits: ``shards`` ranks per replica (1: no FSDP, every rank its own replica)."""

    shards: int
    replicas: int
    replica: int  # this rank's replica (its checkpoint's number)
    shard: int  # this rank's place inside its replica (0: the replica's first rank, which publishes)

    @property
    def sharded(self) -> bool:
        return self.shards > 1

    @property
    def leader(self) -> bool:
        return self.shard == 0

    def ranks_of(self, replica: int) -> list[int]:
        return list(range(replica * self.shards, (replica + 1) * self.shards))


def layout_of(rank: int, world_size: int, shards: int) -> Layout:
    if shards < 1 or world_size % shards:
        raise UserError(
            f"fsdp {shards} does not divide world_size {world_size} (world_size = replicas x fsdp); "
            "set fsdp to a divisor of world_size"
        )
    return Layout(shards, world_size // shards, rank // shards, rank % shards)


def wrap_units(model: torch.nn.Module, model_name: str) -> list[torch.nn.Module]:
    """The modules each ``fully_shard``-ed on their own (sharded and gathered as one), outermost last
    excluded (the root is sharded after them). A model without any is a one-line error saying how to
    give them."""
    found = _declared_units(model)
    if not found:
        raise UserError(
            f"fsdp > 1 needs wrap units but model {model_name!r} has none: the built-in mlp and "
            "transformer, and Hugging Face models (their _no_split_modules) have them; a user model "
            "returns its blocks from a method fsdp_units(); or set fsdp: 1"
        )
    return found


def _declared_units(model: torch.nn.Module) -> list[torch.nn.Module]:
    from shardfuse.models.builtin import Transformer
    from shardfuse.models.mlp import MLP

    for module in model.modules():  # the user's model may sit inside the framework's wrappers
        if hasattr(module, "fsdp_units") and callable(module.fsdp_units):
            units = list(module.fsdp_units())
            if not units or not all(isinstance(unit, torch.nn.Module) for unit in units):
                raise UserError(
                    f"{type(module).__name__}.fsdp_units() must return a non-empty list of its "
                    "submodules (its blocks), got "
                    f"{[type(unit).__name__ for unit in units] if units else 'nothing'}"
                )
            return units
        if isinstance(module, Transformer):
            return list(module.blocks)
        if isinstance(module, MLP):
            return [layer for layer in module.net if isinstance(layer, torch.nn.Linear)]
        names = getattr(module, "_no_split_modules", None)
        if names:
            units = [sub for sub in module.modules() if type(sub).__name__ in set(names)]
            if units:
                return units
    return []


def make_mesh(device: torch.device, layout: Layout) -> Any:
    """The (replicate, shard) mesh, on the ranks' device type (the CPU mesh on CPU, explicitly)."""
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh(
        device.type, (layout.replicas, layout.shards), mesh_dim_names=("replicate", "shard")
    )


def shard_model(
    model: torch.nn.Module,
    mesh: Any,
    units: list[torch.nn.Module],
    hsdp: bool,
    precision: str,
    device: torch.device,
) -> None:
    """``fully_shard`` every unit, then the root: over the whole mesh for HSDP (strategy ddp), over
    the replica's ``shard`` dimension otherwise. ``precision`` bf16: bf16 parameters in compute, fp32
    gradient reduction (a GPU only)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs: dict[str, Any] = {"mesh": mesh if hsdp else mesh["shard"]}
    if precision == "bf16":
        if device.type != "cuda":
            raise UserError(
                f"fsdp_precision bf16 needs GPUs, this rank runs on {device.type}; set fsdp_precision: fp32"
            )
        kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for unit in units:
        fully_shard(unit, **kwargs)
    fully_shard(model, **kwargs)


def replicate_group(mesh: Any) -> Any:
    return mesh["replicate"].get_group()


def shard_group(mesh: Any) -> Any:
    return mesh["shard"].get_group()


@torch.no_grad()
def full_tensors(tensors: dict[str, torch.Tensor], keep: bool) -> dict[str, torch.Tensor]:
    """Every tensor whole, gathered one at a time (a collective every rank of the mesh joins); on the
    CPU, and kept only where ``keep`` (the replica's first rank, which writes them)."""
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        whole = tensor.full_tensor() if is_dtensor(tensor) else tensor
        if keep:
            out[name] = whole.detach().cpu().contiguous()
        del whole
    return out


def local_bytes(model: torch.nn.Module) -> dict[str, int]:
    """This rank's bytes of trainable parameters (its shards) — with their gradients and optimiser
    state, the memory FSDP divides by S."""
    return {
        "parameters": sum(
            local(p).numel() * local(p).element_size() for p in model.parameters() if p.requires_grad
        )
    }


def all_reduce_mean(value: float, group: Any, size: int, device: torch.device) -> float:
    """The mean of ``value`` over ``group`` (the replica's loss, of its ranks' micro-batches)."""
    tensor = torch.tensor([value], dtype=torch.float64, device=device)
    torch_dist.all_reduce(tensor, group=group)
    return float(tensor.item()) / size
