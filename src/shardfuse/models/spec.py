"""Model specs: what a checkpoint's metadata says about its model, read without torch.

A spec is the small JSON-able record every checkpoint carries in its header: the model reference, its
args, the task, the dataset's :class:`DataDescription` and the fingerprint of the user code.
:mod:`shardfuse.models.registry` builds the network from it; the track stage reads the model's columns from it
without importing torch (a torch import took longer than the whole push), so this module must not
import torch either. A library module, e.g.::

    python -c "import json, shardfuse.models.spec as s
    info = json.load(open('results/datasets/digits/dataset.json'))
    print(s.description_of(s.model_spec('mlp', {}, [], info)))"

:func:`normalized_spec` is the one reader of specs: it also reads the specs written before the model
registry (``{"type": "mlp", num_features, num_classes, ...}``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

from shardfuse.io import UserError
from shardfuse.models.catalog import BuiltinModel, builtin
from shardfuse.models.tasks import IMPLICIT_TASK, named_task, task_for
from shardfuse.models.usercode import code_fingerprint, model_files_of

# A LoRA adapter's keys and their defaults (the schema's; shardfuse.models.lora applies them, the config
# check and the typed run config read them from here).
ADAPTER_DEFAULTS = {
    "type": "lora",
    "r": 8,
    "alpha": 16.0,
    "dropout": 0.0,
    "target_modules": "all-linear",
    "init": "shared",
}

# The field of a dict or ModelOutput holding a model's outputs unless the run's model_output says.
DEFAULT_OUTPUT = "logits"


@dataclass(frozen=True)
class DataDescription:
    """What a model factory learns about the data (from dataset.json)."""

    task: str
    num_features: int  # input values per row (tokens per block for causal_lm)
    num_outputs: int  # classes, regression targets, or the vocabulary size
    feature_names: tuple[str, ...]
    label_names: tuple[str, ...]  # class names (classification) or target names (regression)
    num_classes: int | None = None
    vocab_size: int | None = None
    block_size: int | None = None  # causal_lm: tokens a model sees per row
    # How a row's input is stored (shardfuse.data.shard_format): "numeric" columns x0..x{F-1}, a "tensor"
    # column (e.g. images [1, 8, 8]) or a "tokens" block of block_size + 1 token ids.
    input_kind: str = "numeric"
    feature_shape: tuple[int, ...] = ()  # one row's input: (F,), (C, H, W), (block_size + 1,)
    bytes_per_token: float = 1.0  # causal_lm: the corpus's bytes per token (1 for byte-level tokens)
    # Categorical feature columns' vocabularies ({column: [category, ...]}, dataset.json's categories):
    # their one-hot blocks are among feature_names as column=category. None (and left out of the spec)
    # for data without them, so the specs of other data read as before.
    categories: dict[str, list[str]] | None = field(default=None, hash=False)
    # Sequence classification (token rows with a class label): the id the rows are padded with after their
    # last token (dataset.json's pad_id). None (and left out of the spec) for every other data.
    pad_id: int | None = None

    @property
    def input_shape(self) -> tuple[int, ...]:
        """One row's input as a model sees it (tokens: block_size, the last one being a target)."""
        if self.input_kind == "tokens":
            return (int(self.block_size or 0),)
        return tuple(self.feature_shape) or (self.num_features,)

    @classmethod
    def from_info(cls, info: dict[str, Any]) -> DataDescription:
        task = task_for(named_task(info))
        return cls(
            task=task.name,
            num_features=int(info["num_features"]),
            feature_names=tuple(info.get("feature_names", [])),
            bytes_per_token=float(info.get("bytes_per_token", 1.0)),
            input_kind=str(info.get("input", {}).get("kind", task.default_input)),
            categories=info.get("categories") or None,
            pad_id=int(info["pad_id"]) if info.get("pad_id") is not None else None,
            feature_shape=tuple(int(n) for n in info.get("input", {}).get("shape", [info["num_features"]])),
            **task.outputs_of(info),
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            key: list(value) if isinstance(value, tuple) else value
            for key, value in asdict(self).items()
            if not (key in ("categories", "pad_id") and value is None)
        }


def model_spec(
    ref: str,
    model_args: dict[str, Any],
    code_paths: list[str],
    info: dict[str, Any],
    run_cfg: dict[str, Any] | None = None,
    output: str = DEFAULT_OUTPUT,
    model_files: list[str] | tuple[str, ...] = (),
) -> dict[str, Any]:
    """The spec of a run's model on a prepared dataset (``info`` is its dataset.json). ``output`` (the
    field a dict or ModelOutput holds the outputs in) is recorded only off its default, so specs of
    models that return tensors stay as they were."""
    args = dict(model_args)
    record = builtin(ref)
    if record is not None and run_cfg is not None:  # the built-in's run keys (the mlp's), then model_args
        args = {**{key: run_cfg[key] for key in record.run_keys if key in run_cfg}, **args}
    spec = {
        "model": ref,
        "args": args,
        "task": named_task(info),
        "description": DataDescription.from_info(info).to_dict(),
        "code": code_fingerprint(ref, code_paths, model_files_of(ref, args, model_files)),
    }
    if output != DEFAULT_OUTPUT:
        spec["output"] = output
    return spec


def _legacy_spec(spec: dict[str, Any], record: BuiltinModel) -> dict[str, Any]:
    """A checkpoint written before the registry: {"type": "mlp", num_features, num_classes, ...}."""
    return {
        "model": record.name,
        "args": {key: spec[key] for key in record.run_keys},
        "task": IMPLICIT_TASK,
        "description": DataDescription(
            task=IMPLICIT_TASK,
            num_features=int(spec["num_features"]),
            num_outputs=int(spec["num_classes"]),
            feature_names=(),
            label_names=(),
            num_classes=int(spec["num_classes"]),
        ).to_dict(),
        "code": None,
    }


def normalized_spec(spec: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(spec, dict):
        raise UserError("checkpoint metadata has no model spec; re-run the stage that wrote it")
    legacy = builtin(spec.get("type"))  # specs before the registry were the model with run keys
    if legacy is not None and legacy.run_keys:
        return _legacy_spec(spec, legacy)
    if "model" not in spec or "description" not in spec:
        raise UserError(
            f"unknown model spec {sorted(spec)} in checkpoint metadata; it was written by another "
            "version of shardfuse — re-train with this one"
        )
    return spec


def description_of(spec: dict[str, Any]) -> DataDescription:
    fields = normalized_spec(spec)["description"]
    return DataDescription(
        **{key: tuple(value) if isinstance(value, list) else value for key, value in fields.items()}
    )
