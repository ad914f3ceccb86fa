"""The run config the train stage reads, typed: frozen sections whose defaults are the one source of
each default (the schema's are held equal to them by tests/contracts/test_run_config.py).

On files and command lines the config stays flat (``--config-json '{"lr": 0.05, ...}'``, runs.tsv,
MLflow params, the training fingerprint): :meth:`TrainConfig.from_flat` reads that form, filling in what
a config leaves out (the keys added after the first release are left out at their defaults, so that
older trainings keep their names), and refuses a key it does not know. By hand::

    python -c "from shardfuse.experiment.run_config import TrainConfig; \\
        print(TrainConfig.from_flat({'strategy': 'diloco', 'sync_every': 10}).sync)"
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from shardfuse.cluster.membership import ORPHANS
from shardfuse.io import UserError
from shardfuse.models.catalog import MLP_HIDDEN_SIZES


@dataclass(frozen=True)
class SyncConfig:
    """How the ranks keep in touch (shardfuse.strategies)."""

    strategy: str = "ddp"  # a record of shardfuse.strategies.registry (ddp, localsgd, diloco)
    sync_every: int = 0  # local SGD / DiLoCo: optimiser steps between syncs (0: never, i.e. independent)
    outer_lr: float = 0.7  # DiLoCo's outer Nesterov SGD
    outer_momentum: float = 0.9
    find_unused_parameters: bool = False  # ddp: parameters a forward may leave without a gradient
    static_graph: bool = False  # ddp: the same parameters are used in every step
    fsdp: int = 1  # FSDP2 shards per replica (shardfuse.rank.fsdp); 1: every rank holds the whole model
    fsdp_precision: str = "fp32"  # fp32 | bf16 (GPU only: bf16 parameters, fp32 reduction)
    # the fewest ranks that go on after one is lost for good (shardfuse.rank.loss); None: world_size
    min_ranks: int | None = None
    orphans: str = ORPHANS[0]  # a lost rank's shard: drop (left unseen) | reshard (dealt to the others)


@dataclass(frozen=True)
class ModelConfig:
    """What is trained: the model, its initial weights and its loss."""

    model: str = "mlp"
    model_args: dict[str, Any] = field(default_factory=dict)
    code_paths: list[str] = field(default_factory=list)
    model_files: list[str] = field(default_factory=list)  # files the model is built from, hashed like code
    hidden_sizes: list[int] = field(default_factory=lambda: list(MLP_HIDDEN_SIZES))  # the built-in mlp's
    activation: str = "relu"
    dropout: float = 0.0
    loss: str = "mse"  # regression only: mse | huber
    init: str = "shared"  # shared | per_rank
    init_from: str | None = None
    # {file prefix: model prefix (null: leave those tensors out)} applied to init_from's tensor names
    init_from_prefix: dict[str, str | None] = field(default_factory=dict)
    # LoRA over the frozen model: {type, r, alpha, dropout, target_modules, init} (shardfuse.models.lora)
    adapter: dict[str, Any] | None = None
    model_output: str = (
        "logits"  # the field of a dict or ModelOutput a model returns (shardfuse.models.adapter)
    )
    code_digest: str | None = None  # derived: the sha256 of the user model's code files
    init_source: str | None = None  # derived: what init_from points at

    def mlp_keys(self) -> dict[str, Any]:
        """The flat keys the built-in mlp's spec reads (its run_keys in shardfuse.models.catalog)."""
        return {"hidden_sizes": self.hidden_sizes, "activation": self.activation, "dropout": self.dropout}


@dataclass(frozen=True)
class OptimConfig:
    """The optimiser and its learning-rate schedule (shardfuse.rank.optim)."""

    optimizer: str = "sgd"  # sgd | adamw
    lr: float = 0.05
    momentum: float = 0.9
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.999])
    eps: float = 1.0e-8
    lr_schedule: str = "constant"  # constant | linear | cosine
    warmup_steps: int = 0
    min_lr: float = 0.0
    grad_clip_norm: float | None = None
    decay_rule: str | None = None  # derived: "ndim>=2" for AdamW with weight decay


@dataclass(frozen=True)
class LoopConfig:
    """The loop: data, steps, validation, checkpoints, precision."""

    batch_size: int = 32  # rows of a step on every rank
    epochs: int = 10
    epoch_steps: str = "min"  # min | max | mean | own: how ranks with unequal shards line up an epoch
    seed: int = 0
    grad_accum_steps: int = 1
    eval_every: int = 0
    keep: str = "last"  # last | best
    patience: int | None = None
    checkpoint_every: int = 100
    keep_checkpoints: int = 2
    nonfinite_loss: str = "error"  # error | skip
    precision: str = "auto"  # auto | fp32 | bf16


SECTIONS = {"sync": SyncConfig, "model": ModelConfig, "optim": OptimConfig, "loop": LoopConfig}


@dataclass(frozen=True)
class TrainConfig:
    sync: SyncConfig = field(default_factory=SyncConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    loop: LoopConfig = field(default_factory=LoopConfig)

    @classmethod
    def from_flat(cls, flat: dict[str, Any]) -> TrainConfig:
        """The typed config of a flat one (``--config-json``); a key no section has is refused."""
        known = flat_defaults()
        unknown = sorted(set(flat) - set(known))
        if unknown:
            raise UserError(
                f"unknown train config key(s) {', '.join(map(repr, unknown))} in --config-json; "
                f"the train stage reads {', '.join(sorted(known))}"
            )
        return cls(
            **{
                name: section(**{f.name: flat[f.name] for f in fields(section) if f.name in flat})
                for name, section in SECTIONS.items()
            }
        )

    def flat(self) -> dict[str, Any]:
        """Every key, flat, as the config files spell them."""
        return {
            f.name: getattr(getattr(self, name), f.name)
            for name, section in SECTIONS.items()
            for f in fields(section)
        }


def flat_defaults() -> dict[str, Any]:
    """Every train key and its default."""
    return TrainConfig().flat()
