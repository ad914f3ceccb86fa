"""The optimiser, its learning-rate schedule and gradient clipping, as the train stage uses them.

A library module (no stage imports it but train). Every function here is a pure function of the
run config and the optimiser step number, so a resumed run recomputes exactly the values the
uninterrupted run used: the schedule has no state to checkpoint.

Schedule, for the optimiser step with index ``s`` (0-based) of ``total`` steps, peak ``lr``::

    warmup   s < warmup_steps:   lr * (s + 1) / warmup_steps
    constant                     lr
    cosine                       min_lr + (lr - min_lr) * 0.5 * (1 + cos(pi * p))
    linear                       min_lr + (lr - min_lr) * (1 - p)
    with p = (s - warmup_steps) / max(1, total - 1 - warmup_steps), so the last step runs at min_lr.

AdamW decay rule (nanoGPT's and most trainers'): parameters with two or more dimensions (Linear and
Conv weights, embeddings) decay; biases and normalisation weights (one dimension) do not. It applies
when the run config carries ``decay_rule: "ndim>=2"``, which the config loader sets for every AdamW
run with weight_decay > 0 (so those runs got a new training name when the rule arrived). SGD's
weight_decay is plain L2 on every parameter, as before.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch

from shardfuse.experiment.keys import DECAY_RULE
from shardfuse.experiment.run_config import OptimConfig
from shardfuse.io import UserError


def parameter_groups(model: torch.nn.Module, cfg: OptimConfig) -> list[dict[str, Any]]:
    """One group (every parameter decays) or, under the AdamW decay rule, decay and no-decay groups."""
    params = [p for p in model.parameters() if p.requires_grad]
    if cfg.decay_rule != DECAY_RULE:
        return [{"params": params}]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    return [
        {"params": decay, "weight_decay": cfg.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]


def make_optimizer(model: torch.nn.Module, cfg: OptimConfig) -> torch.optim.Optimizer:
    groups = parameter_groups(model, cfg)
    if cfg.optimizer == "adamw":
        betas = tuple(cfg.betas)
        return torch.optim.AdamW(
            groups,
            lr=cfg.lr,
            weight_decay=cfg.weight_decay,
            betas=(float(betas[0]), float(betas[1])),
            eps=float(cfg.eps),
        )
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, weight_decay=cfg.weight_decay)


def lr_at(step_index: int, total_steps: int, cfg: OptimConfig) -> float:
    """The learning rate of optimiser step ``step_index`` (0-based) of ``total_steps``."""
    peak = cfg.lr
    warmup = cfg.warmup_steps
    if step_index < warmup:
        return peak * (step_index + 1) / warmup
    schedule = cfg.lr_schedule
    if schedule == "constant":
        return peak
    floor = cfg.min_lr
    progress = min(1.0, (step_index - warmup) / max(1, total_steps - 1 - warmup))
    if schedule == "cosine":
        return floor + (peak - floor) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return floor + (peak - floor) * (1.0 - progress)
    raise UserError(f"unknown lr_schedule {schedule!r}; use constant, cosine or linear")


def check_schedule(cfg: OptimConfig, total_steps: int) -> None:
    """Warmup must fit in the run: only the train stage knows the step count (shard sizes)."""
    warmup = cfg.warmup_steps
    if warmup > total_steps:
        raise UserError(
            f"warmup_steps {warmup} is longer than the run's {total_steps} optimiser steps (epochs x "
            "steps per epoch / grad_accum_steps); lower warmup_steps or raise epochs"
        )


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_gradients(parameters: Iterable[torch.nn.Parameter], max_norm: float | None) -> float:
    """Clip the global L2 norm of the gradients to ``max_norm``; the norm before clipping (NaN: off)."""
    if max_norm is None:
        return math.nan
    norm = torch.nn.utils.clip_grad_norm_(list(parameters), max_norm)
    if hasattr(norm, "full_tensor"):  # sharded gradients (fsdp): the norm over every shard
        norm = norm.full_tensor()
    return float(norm)
