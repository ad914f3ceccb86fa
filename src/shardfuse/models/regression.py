"""The regression task: MSE (or Huber) on one or many float targets, computed on targets divided by their
training-split standard deviation so that the loss (and the learning rate that suits it) does not depend
on the targets' units; metrics ``loss`` (that loss), ``mse``, ``mae`` (in the targets' units) and ``r2``
(per target, averaged, as scikit-learn's r2_score); ranked by mse, lower is better. An ensemble averages
the predictions (in the targets' units). The logged model returns one column per target, named after it.

A library module (its record is the class, in :data:`shardfuse.models.tasks.RECORDS`)::

    python -c "from shardfuse.models.regression import Regression as R; print(R.score)"   # mse
"""

from __future__ import annotations

import math
from types import MappingProxyType
from typing import TYPE_CHECKING, Any

from shardfuse.io import UserError
from shardfuse.models.task import VALUES, Description, Outputs, Task, Totals, functional, numbered

if TYPE_CHECKING:
    import torch


REGRESSION_LOSSES = ("mse", "huber")


class Regression(Task):
    name = "regression"
    score = "mse"
    lower_is_better = True
    metrics = ("loss", "mse", "mae", "r2")
    metric_ranges = MappingProxyType(
        {"loss": (0.0, math.inf), "mse": (0.0, math.inf), "mae": (0.0, math.inf), "r2": (-math.inf, 1.0)}
    )
    labels = VALUES
    losses = REGRESSION_LOSSES
    scales_targets = True

    def __init__(self, loss: str = "mse", target_scale: torch.Tensor | None = None) -> None:
        if loss not in self.losses:
            raise UserError(f"unknown regression loss {loss!r}; use one of {', '.join(self.losses)}")
        self.loss_name = loss
        self.target_scale = target_scale

    @classmethod
    def configured(
        cls, loss: str = "mse", target_scale: torch.Tensor | None = None, bytes_per_token: float = 1.0
    ) -> Task:
        return cls(loss, target_scale)

    def _scaled(self, outputs: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        if self.target_scale is None:
            return outputs, targets
        scale = self.target_scale.to(outputs.device, outputs.dtype)
        return outputs / scale, targets / scale

    def loss(self, outputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        outputs, targets = self._scaled(outputs.float(), targets)
        if self.loss_name == "huber":
            return functional().huber_loss(outputs, targets)
        return functional().mse_loss(outputs, targets)

    def accumulate(self, totals: Totals, outputs: torch.Tensor, targets: torch.Tensor) -> None:
        outputs, targets = outputs.double(), targets.double()
        error = outputs - targets
        totals.rows += int(targets.shape[0])
        totals.add("loss", self.loss(outputs, targets).item() * targets.shape[0])
        totals.add("squared", (error**2).sum(dim=0))
        totals.add("absolute", error.abs().sum(dim=0))
        totals.add("target", targets.sum(dim=0))
        totals.add("target_squared", (targets**2).sum(dim=0))

    def finish(self, totals: Totals) -> dict[str, float]:
        rows = totals.rows
        squared, absolute = totals.sums["squared"], totals.sums["absolute"]
        mean = totals.sums["target"] / rows
        total_variance = totals.sums["target_squared"] - rows * mean**2
        # A constant target has no variance to explain: scikit-learn scores it 1 if predicted exactly, else 0.
        import torch

        r2 = torch.where(
            total_variance > 0,
            1 - squared / total_variance.clamp_min(1e-300),
            (squared == 0).double(),
        )
        return {
            "loss": float(totals.sums["loss"] / rows),
            "mse": float(squared.sum() / (rows * squared.numel())),
            "mae": float(absolute.sum() / (rows * absolute.numel())),
            "r2": float(r2.mean()),
        }

    def _combine(self, outputs: list[torch.Tensor]) -> torch.Tensor:
        """The mean prediction, in the targets' units (as each model predicts), float64."""
        import torch

        return torch.stack([o.double() for o in outputs]).mean(dim=0)

    def outputs_of(self, info: dict[str, Any]) -> dict[str, Any]:
        return {"num_outputs": len(info["target_names"]), "label_names": tuple(info["target_names"])}

    def logged_outputs(self, description: Description) -> Outputs:
        count = int(description.num_outputs)
        return Outputs(numbered(description.label_names, count, "target_"), ("float",) * count)
