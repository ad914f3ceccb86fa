"""The built-in models, one torch-free record each: the name a run gives as ``model``, the factory that
builds it (imported only when a model is built), and what the rest of shardfuse may ask of it: its
whole state dict without torch (the trust checks), its permutation groups for merge_align (a function
beside its factory, named like it), whether fsdp > 1 finds its wrap units (shardfuse.rank.fsdp), the
config check of its model_args, the pretrained folder it is built from, the run keys that are its args,
and whether it is a transformers model (exported as a save_pretrained folder). Nothing outside these
records decides by a built-in's name (tests/contracts/test_name_decisions.py).

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
Groups = dict[str, list[tuple[str, int]]]  # permutation groups: {group: [(tensor name, axis), ...]}


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


def _imported(path: str) -> Callable[..., Any]:
    """The function ``module:function`` names, imported now."""
    module, _, function = path.partition(":")
    return getattr(importlib.import_module(module), function)


@dataclass(frozen=True)
class BuiltinModel:
    name: str
    # ``module:function``, as a user model is named: imported when a model is built (torch only then;
    # and the factory's module may read this catalog without a loop).
    factory: str
    reference: str
    fsdp_units: bool = False  # fsdp > 1 finds its wrap units without building it
    # Its whole state dict from a normalized spec, without torch (the trust checks compare it with a
    # file's tensors exactly); None: only its size arguments are bounded by the file.
    state_shapes: Callable[[dict[str, Any]], Shapes] | None = None
    # ``module:function`` giving its permutation groups from its state dict's tensor names (merge_align:
    # weight_matching, shardfuse.fusion.align), imported when aligning. None: it declares none.
    groups: str | None = None
    # ``module:function`` checking its model_args at config time (torch-free; a one-line UserError).
    check_args: str | None = None
    # The model_args key naming a folder it is built from (hashed with the run's model_files).
    pretrained_arg: str | None = None
    # The run's top-level keys that are its model_args (model_args overrides them): the mlp's, from
    # before model_args. A spec written before the model registry ({"type": NAME, num_features,
    # num_classes, *run_keys}) is of the built-in with run keys.
    run_keys: tuple[str, ...] = ()
    # A Hugging Face transformers model: shardfuse.export writes it as a save_pretrained folder (the
    # workflow's results/runs/RUN/hf and a training's base-hf), its LoRA adapter is a PEFT adapter with
    # the task's task_type, and its logged MLflow model requires transformers.
    exports_hf: bool = False

    @property
    def aligned(self) -> bool:
        """merge_align: weight_matching knows its permutation groups."""
        return self.groups is not None

    def build(self) -> Callable[..., Any]:
        """The factory, imported now."""
        return _imported(self.factory)

    def permutation_groups(self, names: list[str]) -> Groups:
        """Its permutation groups over the tensors ``names`` (only for a record with ``groups``)."""
        if self.groups is None:
            raise ValueError(f"the built-in {self.name} declares no permutation groups")
        return _imported(self.groups)(names)

    def check_model_args(self, model_args: Any) -> None:
        if self.check_args is not None:
            _imported(self.check_args)(model_args)


RECORDS: tuple[BuiltinModel, ...] = (
    BuiltinModel(
        "mlp",
        "shardfuse.models.mlp:build_mlp",
        "Linear layers with an activation (and dropout) between them",
        fsdp_units=True,
        state_shapes=mlp_state_shapes,
        groups="shardfuse.models.mlp:mlp_groups",
        run_keys=("hidden_sizes", "activation", "dropout"),
    ),
    BuiltinModel(
        "cnn",
        "shardfuse.models.builtin:cnn",
        "Conv-BatchNorm-ReLU stages, max pooling, global average pooling, a linear read-out",
        groups="shardfuse.models.builtin:cnn_groups",
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
        check_args="shardfuse.models.hf:check_hf_args",
        pretrained_arg="pretrained",
        exports_hf=True,
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


def hf_export_names() -> tuple[str, ...]:
    return tuple(record.name for record in RECORDS if record.exports_hf)


def exports_hf(name: Any) -> bool:
    """Model ``name`` is a built-in transformers model (see ``BuiltinModel.exports_hf``)."""
    record = builtin(name)
    return record is not None and record.exports_hf


def spoken(items: tuple[str, ...]) -> str:
    """``("mlp", "cnn")`` -> "mlp and cnn" (the error messages name the built-ins that can)."""
    return " and ".join((", ".join(items[:-1]), items[-1])) if len(items) > 1 else "".join(items)
