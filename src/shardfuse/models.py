"""The model family: a configurable MLP, rebuilt anywhere from a small JSON-able spec.

The spec travels inside every checkpoint's metadata, so gather, merge and evaluate rebuild the exact
architecture without importing training code or trusting pickles. :func:`score_state_dict` scores such
a model on a split; evaluate and merge's greedy soup share it, so neither stage imports the other.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from shardfuse.io import UserError

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


def mlp_spec(num_features: int, num_classes: int, run_cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "mlp",
        "num_features": int(num_features),
        "num_classes": int(num_classes),
        "hidden_sizes": [int(h) for h in run_cfg["hidden_sizes"]],
        "activation": run_cfg["activation"],
        "dropout": float(run_cfg["dropout"]),
    }


class MLP(nn.Module):
    def __init__(
        self, num_features: int, num_classes: int, hidden_sizes: list[int], activation: str, dropout: float
    ) -> None:
        super().__init__()
        layers: list[nn.Module] = []
        width = num_features
        for hidden in hidden_sizes:
            layers += [nn.Linear(width, hidden), ACTIVATIONS[activation]()]
            if dropout > 0:
                layers.append(nn.Dropout(dropout))
            width = hidden
        layers.append(nn.Linear(width, num_classes))
        self.net = nn.Sequential(*layers)
        # Input standardisation lives in the model (as buffers, saved with the weights) so every
        # consumer of a checkpoint sees the same features the ranks trained on.
        self.register_buffer("input_mean", torch.zeros(num_features))
        self.register_buffer("input_scale", torch.ones(num_features))

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        return self.net((features - self.input_mean) * self.input_scale)

    @torch.no_grad()
    def set_input_stats(self, mean: torch.Tensor, std: torch.Tensor) -> None:
        self.input_mean.copy_(mean)
        # Constant features (std 0) are left unscaled rather than divided by zero.
        self.input_scale.copy_(torch.where(std > 1e-8, 1.0 / std.clamp_min(1e-8), torch.ones_like(std)))


def build_model(spec: dict[str, Any]) -> MLP:
    if spec.get("type") != "mlp":
        raise UserError(
            f"unknown model type {spec.get('type')!r} in checkpoint metadata; this version of "
            "shardfuse builds 'mlp' only — re-train with it"
        )
    if spec["activation"] not in ACTIVATIONS:
        raise UserError(f"unknown activation {spec['activation']!r}; use one of {', '.join(ACTIVATIONS)}")
    return MLP(
        spec["num_features"],
        spec["num_classes"],
        list(spec["hidden_sizes"]),
        spec["activation"],
        spec["dropout"],
    )


@torch.no_grad()
def score_state_dict(
    tensors: dict[str, torch.Tensor],
    spec: dict[str, Any],
    features: torch.Tensor,
    labels: torch.Tensor,
    batch_size: int = 4096,
) -> dict[str, float]:
    """Mean cross-entropy and accuracy of model ``spec`` with weights ``tensors`` on (features, labels)."""
    model = build_model(spec)
    if model.net[0].in_features != features.shape[1]:
        raise UserError(
            f"the model expects {model.net[0].in_features} features but the data has "
            f"{features.shape[1]}; evaluate with a split of the run's dataset"
        )
    model.load_state_dict(tensors)
    model.eval()
    loss_sum, correct = 0.0, 0
    for start in range(0, features.shape[0], batch_size):
        logits = model(features[start : start + batch_size])
        target = labels[start : start + batch_size]
        loss_sum += F.cross_entropy(logits, target, reduction="sum").item()
        correct += int((logits.argmax(dim=1) == target).sum())
    return {"loss": loss_sum / features.shape[0], "accuracy": correct / features.shape[0]}
