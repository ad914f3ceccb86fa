"""Validation while training: each rank scores the validation split, keeps its best weights and
decides when to stop. A library module for the train stage.

``eval_every: N`` scores the whole validation split (``val.parquet`` of the prepared dataset) every N
optimiser steps and at each epoch's end, with the task's score (accuracy, mse, loss, ...; its own
direction). ``keep: best`` publishes the weights of the best score instead of the last. For DDP all
ranks hold the same weights; rank 0's score is broadcast so every rank makes the same decision.
Otherwise (independent, localsgd, diloco) each rank decides for its own weights. ``patience: P``
stops the run once every rank has gone P validations without improving (all ranks stop together:
the step counts of the collectives must match).

The tracker's state (best score, its step, validations since, the best weights) is part of every
checkpoint, so a resumed run keeps the same best and stops at the same step.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import torch
import torch.distributed as torch_dist

from shardfuse.data.reader import load_table
from shardfuse.data.verify import check_split
from shardfuse.io import UserError
from shardfuse.models.adapter import storable_state
from shardfuse.models.tasks import Task, Totals


class Validator:
    """Scores a model on the validation split with the task's score (lower or higher is better)."""

    def __init__(self, dataset_dir: Path, task: Task, batch_size: int, device: torch.device) -> None:
        path = dataset_dir / "val.parquet"
        check_split(path, "val")
        features, targets = load_table(path)
        if features.shape[0] == 0:
            raise UserError(
                f"validation split {path} has no rows but the run validates while training (eval_every); "
                "set the dataset's val_fraction > 0 (e.g. 0.1) or eval_every: 0"
            )
        self.features, self.targets = features, targets
        self.task, self.batch_size, self.device = task, batch_size, device

    @torch.no_grad()
    def score(self, model: torch.nn.Module) -> float:
        was_training = model.training
        model.eval()
        totals = Totals()
        try:
            for start in range(0, self.features.shape[0], self.batch_size):
                inputs, targets = self.task.batch(
                    self.features[start : start + self.batch_size],
                    self.targets[start : start + self.batch_size],
                )
                outputs = model(inputs.to(self.device))
                self.task.accumulate(totals, outputs.float(), targets.to(self.device))
        finally:
            model.train(was_training)
        return float(self.task.finish(totals)[self.task.score])


class BestTracker:
    """The best validation score so far, its step and weights, and the patience used up."""

    def __init__(self, task: Task, keep_best: bool, patience: int | None) -> None:
        self.task, self.keep_best, self.patience = task, keep_best, patience
        self.best_score = math.nan
        self.best_step = 0
        self.since_best = 0
        self.best_weights: dict[str, torch.Tensor] | None = None

    def update(self, score: float, step: int, model: torch.nn.Module) -> None:
        # Strictly better: a tie keeps the earlier weights and uses up patience.
        if math.isnan(self.best_score) or (
            score != self.best_score and self.task.better(score, self.best_score)
        ):
            self.best_score, self.best_step, self.since_best = score, step, 0
            if self.keep_best:
                weights = storable_state(model)[0]  # a tied tensor once, as published
                self.best_weights = {k: v.detach().clone() for k, v in weights.items()}
        else:
            self.since_best += 1

    def out_of_patience(self) -> bool:
        return self.patience is not None and self.since_best >= self.patience

    # Checkpointed with the rank's state.
    def state(self) -> dict[str, Any]:
        return {
            "best_score": None if math.isnan(self.best_score) else self.best_score,
            "best_step": self.best_step,
            "since_best": self.since_best,
        }

    def state_tensors(self) -> dict[str, torch.Tensor]:
        if self.best_weights is None:
            return {}
        return {f"best.{name}": tensor for name, tensor in self.best_weights.items()}

    def load(self, state: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        score = state.get("best_score")
        self.best_score = math.nan if score is None else float(score)
        self.best_step, self.since_best = int(state.get("best_step", 0)), int(state.get("since_best", 0))
        best = {name[len("best.") :]: t for name, t in tensors.items() if name.startswith("best.")}
        self.best_weights = best or None


def shared_score(score: float, same_weights: bool, device: torch.device) -> float:
    """Rank 0's score on every rank when all ranks hold the same weights (DDP), else the rank's own."""
    if not same_weights:
        return score
    value = torch.tensor([score], dtype=torch.float64, device=device)
    torch_dist.broadcast(value, src=0)
    return float(value.item())


def all_out_of_patience(tracker: BestTracker, device: torch.device) -> bool:
    """True on every rank once every rank is out of patience (a collective: call it on all ranks)."""
    flag = torch.tensor([int(tracker.out_of_patience())], dtype=torch.int32, device=device)
    torch_dist.all_reduce(flag, op=torch_dist.ReduceOp.MIN)
    return bool(flag.item())
