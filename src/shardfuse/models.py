"""The model family: a configurable MLP, rebuilt anywhere from a small JSON-able spec.

The spec travels inside every checkpoint's metadata, so gather, merge and evaluate rebuild the exact
architecture without importing training code or trusting pickles.
"""

from __future__ import annotations

from typing import Any

import torch
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
