"""The model registry: a run names its model, every stage rebuilds it from a small JSON-able spec.

A run's ``model`` is a built-in name (a record of :mod:`shardfuse.models.catalog`: ``mlp``, ``cnn``,
``transformer``, ``hf``) or an import path ``package.module:function`` (the function is
called as ``function(description, **model_args)`` with the dataset's :class:`DataDescription` and must
return an ``nn.Module`` mapping a batch of inputs ``[N, *input_shape]`` to ``[N, num_outputs]``, or
for causal_lm a token batch ``[N, T]`` to logits ``[N, T, vocab_size]``).
User code lives in the run's ``code_paths`` (directories put on ``sys.path`` in every job) or in an
installed package. By hand::

    python -c "import json, shardfuse.models.registry as m, shardfuse.models.spec as s
    info = json.load(open('results/datasets/digits/dataset.json'))
    print(m.build_model(s.model_spec('mlp', {}, [], info)))"

The spec travels inside every checkpoint's metadata: the reference, its args, the task, the dataset
description and the sha256 of every user code file, so gather, merge, evaluate and MLflow rebuild the
exact architecture without trusting pickles, and a code change between training and a later stage is
an error naming the file rather than weights silently loaded into another network. The spec itself
(:func:`model_spec`, :class:`DataDescription`) lives in the torch-free :mod:`shardfuse.models.spec`.

The framework owns input standardisation (the features' training-split mean and std, as buffers saved
with the weights) and, for regression, the targets' scale: a user model sees standardised features
and its outputs are mapped back to the targets' units, so a user's ``build`` stays plain PyTorch.
Scoring a model on a split is shardfuse.scoring's (evaluate, greedy soup and recalibration share it).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from shardfuse.io import UserError
from shardfuse.models.adapter import attach_output, ties_of
from shardfuse.models.bounds import check_spec_bounds, shape_mismatch, spec_error
from shardfuse.models.catalog import Shapes, builtin
from shardfuse.models.mlp import Standardized
from shardfuse.models.spec import DEFAULT_OUTPUT, description_of, normalized_spec
from shardfuse.models.tasks import Task, task_for
from shardfuse.models.usercode import load_factory


def build_model(spec: dict[str, Any]) -> nn.Module:
    """The model a spec describes, freshly initialised (with torch's current RNG). Stages that rebuild
    a trained model check its code first (shardfuse.models.usercode.check_code_unchanged)."""
    spec = normalized_spec(spec)
    description = description_of(spec)
    code_paths = spec["code"]["paths"] if spec.get("code") else []
    record = builtin(spec["model"])
    factory = record.build() if record is not None else load_factory(spec["model"], code_paths)
    try:
        model = factory(description, **spec["args"])
    except TypeError as exc:
        raise UserError(
            f"model {spec['model']!r} rejected its arguments ({exc}); fix `model_args` in the run"
        ) from None
    if not isinstance(model, nn.Module):
        raise UserError(
            f"model {spec['model']!r} returned {type(model).__name__}, not a torch.nn.Module; make the "
            "factory return the network"
        )
    attach_output(model, spec.get("output", DEFAULT_OUTPUT), spec["model"])  # tensors pass unchanged
    scale_targets = task_for(description.task).scales_targets
    numeric = description.input_kind == "numeric"  # not images, not token ids: standardised columns
    if record is not None or not (numeric or scale_targets):
        return model
    return Standardized(
        model, description.num_features, description.num_outputs, scale_targets, standardize_inputs=numeric
    )


def meta_model(spec: dict[str, Any]) -> nn.Module | None:
    """The spec's model on the meta device (names, shapes, dtypes and ties; no memory for tensors), or
    None for a user factory that cannot build without data (``.item()`` on a tensor, say; the
    built-ins can): left to the real build, whose strict load refuses a mismatch, but only once the
    model is allocated."""
    try:
        with torch.device("meta"):
            return build_model(spec)
    except (RuntimeError, NotImplementedError):
        return None


def check_model_fits(source: str, spec: dict[str, Any], held: Shapes, rerun: str) -> None:
    """Refuse a spec whose model is not exactly the tensors ``held`` (a checkpoint's), before building
    it for real: the torch-free bounds of shardfuse.checkpoints.trust first, then a build on the meta device
    (no memory for tensors) whose state dict must have these names and shapes. The header's tensors cover
    its file, so a model that passes is no larger than the file. ``source`` names where the spec was
    read, ``rerun`` the stage that writes it."""
    spec = check_spec_bounds(source, spec, held, rerun)
    model = meta_model(spec)
    if model is None:
        return
    ties = ties_of(model)  # a tied tensor is stored once, under its first name
    expected = {name: tuple(tensor.shape) for name, tensor in model.state_dict().items() if name not in ties}
    if detail := shape_mismatch(expected, held):
        raise spec_error(source, spec["model"], held, detail, rerun, expected)


@torch.no_grad()
def set_data_stats(
    model: nn.Module,
    inputs: tuple[torch.Tensor, torch.Tensor] | None,
    targets: tuple[torch.Tensor, torch.Tensor] | None,
) -> None:
    """Store the training split's (mean, std) of the inputs and (regression) the targets in the model.

    Constant columns (std 0) are left unscaled rather than divided by zero."""
    if inputs is not None and hasattr(model, "input_mean"):
        mean, std = inputs
        model.input_mean.copy_(mean)
        model.input_scale.copy_(torch.where(std > 1e-8, 1.0 / std.clamp_min(1e-8), torch.ones_like(std)))
    if targets is not None and hasattr(model, "target_mean"):
        mean, std = targets
        model.target_mean.copy_(mean)
        model.target_scale.copy_(torch.where(std > 1e-8, std, torch.ones_like(std)))


def task_of(spec: dict[str, Any], tensors: dict[str, torch.Tensor] | None = None, loss: str = "mse") -> Task:
    """The spec's task; for regression the loss is measured in units of the targets' std (from the
    model's ``target_scale``)."""
    spec = normalized_spec(spec)
    scale = None if tensors is None else tensors.get("target_scale")
    bytes_per_token = description_of(spec).bytes_per_token
    return task_for(spec["task"], loss=loss, target_scale=scale, bytes_per_token=bytes_per_token)


def probe_batch(spec: dict[str, Any], device: torch.device, rows: int = 2) -> torch.Tensor:
    """A batch of zeros shaped like the dataset's inputs (token ids for causal_lm)."""
    description = description_of(spec)
    if description.input_kind == "tokens":
        return torch.zeros(rows, *description.input_shape, dtype=torch.long, device=device)
    return torch.zeros(rows, *description.input_shape, device=device)


def check_output_shape(model: nn.Module, spec: dict[str, Any], device: torch.device) -> None:
    """One forward pass on a dummy batch: a model whose outputs do not fit the task fails here, before
    training starts, with the shapes named. Runs in eval mode without gradients, so it changes no
    state and draws no random numbers."""
    description = description_of(spec)
    task = task_for(description.task)
    rows = 2
    dummy = probe_batch(spec, device, rows)
    expected = task.expected_output_shape(rows, description.num_outputs, description.block_size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            outputs = model(dummy)
    except UserError:
        raise
    except Exception as exc:
        raise UserError(
            f"model {spec['model']!r} fails on a batch shaped {list(dummy.shape)} "
            f"({type(exc).__name__}: {exc}); make it accept the dataset's inputs"
        ) from None
    finally:
        model.train(was_training)
    if not isinstance(outputs, torch.Tensor):
        raise UserError(
            f"model {spec['model']!r} returns {type(outputs).__name__}, not a tensor; return the outputs "
            "tensor (e.g. `.logits` of a ModelOutput, or `[0]` of a tuple), or a dict or ModelOutput with "
            f"it under model_output ({spec.get('output', DEFAULT_OUTPUT)!r})"
        )
    if tuple(outputs.shape) != expected:
        raise UserError(
            f"model {spec['model']!r} returns shape {list(outputs.shape)} for {rows} rows but task "
            f"{description.task} needs {list(expected)} "
            f"({description.num_outputs} outputs); make its last layer produce num_outputs values"
        )
