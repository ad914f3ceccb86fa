"""The built-in models, one torch-free record each: the name a run gives as ``model``, the factory that
builds it (imported only when a model is built), and what the rest of shardfuse may ask of it: its
whole state dict without torch (the trust checks), whether merge_align knows its permutation groups
(shardfuse.fusion.align holds them) and whether fsdp > 1 finds its wrap units (shardfuse.rank.fsdp).

The config loader (no torch), the model registry (shardfuse.models.registry.build_model), the trust
checks on a checkpoint's spec (shardfuse.models.bounds) and the user-code loader all read these records,
looked up when called (a test may extend ``RECORDS``). By hand::

    python -c "from shardfuse.models import catalog; print(catalog.names())"

Adding a built-in: its factory (``factory(description, **model_args) -> nn.Module``, standardising its
own inputs) in a module of this package and one record here.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardfuse.models.tasks import named_task, task_record

MLP_HIDDEN_SIZES = (64,)  # the built-in mlp's hidden layers when a run names none
Shapes = dict[str, tuple[int, ...]]


def mlp_state_shapes(spec: dict[str, Any]) -> Shapes:
    """The state dict of the built-in mlp that a normalized spec describes, laid out as
    ``shardfuse.models.mlp.MLP`` lays it out (tests/stages/test_trust.py holds the two together)."""
    args, description = spec["args"], spec["description"]
    features, outputs = int(description["num_features"]), int(description["num_outputs"])
    hidden = [int(size) for size in args.get("hidden_sizes", MLP_HIDDEN_SIZES)]
    if min([features, outputs, *hidden]) < 0:
        raise ValueError("a negative size")
    step = 3 if float(args.get("dropout", 0.0)) > 0 else 2  # Linear, activation (, Dropout)
    shapes: Shapes = {}
    width = features
    for index, size in enumerate(hidden):
        shapes[f"net.{step * index}.weight"] = (size, width)
        shapes[f"net.{step * index}.bias"] = (size,)
        width = size
    shapes[f"net.{step * len(hidden)}.weight"] = (outputs, width)
    shapes[f"net.{step * len(hidden)}.bias"] = (outputs,)
    shapes["input_mean"] = shapes["input_scale"] = (features,)
    if task_record(named_task(description)).scales_targets:
        shapes["target_mean"] = shapes["target_scale"] = (outputs,)
    return shapes


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    # ``module:function``, as a user model is named: imported when a model is built (torch only then;
    # and the factory's module may read this catalog without a loop).
    factory: str
    reference: str
    aligned: bool = False  # merge_align: weight_matching knows its permutation groups
    fsdp_units: bool = False  # fsdp > 1 finds its wrap units without building it
    # Its whole state dict from a normalized spec, without torch (the trust checks compare it with a
    # file's tensors exactly); None: only its size arguments are bounded by the file.
    state_shapes: Callable[[dict[str, Any]], Shapes] | None = None

    def build(self) -> Callable[..., Any]:
        """The factory, imported now."""
        module, _, function = self.factory.partition(":")
        return getattr(importlib.import_module(module), function)


RECORDS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        "mlp",
        "shardfuse.models.mlp:build_mlp",
        "Linear layers with an activation (and dropout) between them",
        aligned=True,
        fsdp_units=True,
        state_shapes=mlp_state_shapes,
    ),
    BuiltinModel(
        "cnn",
        "shardfuse.models.builtin:cnn",
        "Conv-BatchNorm-ReLU stages, max pooling, global average pooling, a linear read-out",
        aligned=True,
    ),
    BuiltinModel(
        "transformer",
        "shardfuse.models.builtin:transformer",
        "a GPT-2 style decoder (pre-norm blocks)",
        fsdp_units=True,
    ),
    BuiltinModel(
        "hf",
        "shardfuse.models.hf:hf",
        "a Hugging Face transformers model from config.json or a pretrained folder",
    ),
)


def builtin(name: Any) -> BuiltinModel | None:
    """The built-in called ``name``, read from ``RECORDS`` when called; None for a user model."""
    return next((record for record in RECORDS if record.name == name), None)


def names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS)


def aligned_names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS if record.aligned)


def fsdp_names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS if record.fsdp_units)


def spoken(items: tuple[str, ...]) -> str:
    """``("mlp", "cnn")`` -> "mlp and cnn" (the error messages name the built-ins that can)."""
    return " and ".join((", ".join(items[:-1]), items[-1])) if len(items) > 1 else "".join(items)
