"""The built-in ``mlp`` and the wrapper that gives any other numeric model the framework's input
standardisation (``Standardized``): both keep the features' moments (and a regression's target scale)
as buffers, saved with the weights, so every consumer of a checkpoint sees the features the ranks
trained on. A library module (shardfuse.models.catalog names ``build_mlp`` as the mlp's factory and
``mlp_groups`` as its permutation groups for merge_align). By hand::

    python -c "import torch; from shardfuse.models.mlp import MLP; \
        print(MLP(4, 3, [8], 'relu', 0.0)(torch.zeros(2, 4)).shape)"
"""

from __future__ import annotations

import itertools
import re

import torch
from torch import nn

from shardfuse.io import UserError
from shardfuse.models.catalog import MLP_HIDDEN_SIZES, Groups
from shardfuse.models.spec import DataDescription
from shardfuse.models.tasks import task_for

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "gelu": nn.GELU, "tanh": nn.Tanh, "silu": nn.SiLU}


class MLP(nn.Module):
    """The built-in ``mlp``: Linear layers with an activation (and dropout) between them."""

    def __init__(
        self,
        num_features: int,
        num_classes: int,
        hidden_sizes: list[int],
        activation: str,
        dropout: float,
        scale_targets: bool = False,
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
        self.scale_targets = scale_targets
        if scale_targets:
            _register_target_buffers(self, num_classes)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        outputs = self.net((features - self.input_mean) * self.input_scale)
        return _unscale(self, outputs) if self.scale_targets else outputs


class Standardized(nn.Module):
    """A user model behind the framework's input standardisation (and regression target scale).

    Its state dict holds ``input_mean``, ``input_scale`` (and ``target_mean``, ``target_scale``) beside
    the user model's own tensors under ``model.``."""

    def __init__(
        self,
        model: nn.Module,
        num_features: int,
        num_outputs: int,
        scale_targets: bool,
        standardize_inputs: bool = True,
    ) -> None:
        super().__init__()
        self.model = model
        self.standardize_inputs = standardize_inputs  # numeric columns only, not images or tokens
        if standardize_inputs:
            self.register_buffer("input_mean", torch.zeros(num_features))
            self.register_buffer("input_scale", torch.ones(num_features))
        self.scale_targets = scale_targets
        if scale_targets:
            _register_target_buffers(self, num_outputs)

    def forward(self, features: torch.Tensor) -> torch.Tensor:
        if self.standardize_inputs:
            features = (features - self.input_mean) * self.input_scale
        outputs = self.model(features)
        return _unscale(self, outputs) if self.scale_targets else outputs


def _register_target_buffers(module: nn.Module, num_outputs: int) -> None:
    module.register_buffer("target_mean", torch.zeros(num_outputs))
    module.register_buffer("target_scale", torch.ones(num_outputs))


def _unscale(module: nn.Module, outputs: torch.Tensor) -> torch.Tensor:
    # The network predicts standardised targets; the model's outputs are in the targets' units.
    return outputs * module.target_scale + module.target_mean


def build_mlp(
    description: DataDescription,
    hidden_sizes: list[int] = MLP_HIDDEN_SIZES,
    activation: str = "relu",
    dropout: float = 0.0,
) -> nn.Module:
    if description.input_kind == "tokens":
        raise UserError(
            "the built-in mlp takes numeric features, not token blocks; name a model for causal_lm"
        )
    if activation not in ACTIVATIONS:
        raise UserError(f"unknown activation {activation!r}; use one of {', '.join(ACTIVATIONS)}")
    return MLP(
        description.num_features,
        description.num_outputs,
        [int(h) for h in hidden_sizes],
        activation,
        float(dropout),
        scale_targets=task_for(description.task).scales_targets,
    )


def mlp_groups(names: list[str]) -> Groups:
    """The built-in mlp: Linear layers ``net.<k>`` in order; hidden layer i's units index its weight
    rows and bias and the next layer's weight columns."""
    layers = sorted(int(m.group(1)) for n in names if (m := re.fullmatch(r"net\.(\d+)\.weight", n)))
    groups: Groups = {}
    for i, (k, following) in enumerate(itertools.pairwise(layers)):
        groups[f"hidden{i}"] = [(f"net.{k}.weight", 0), (f"net.{k}.bias", 0), (f"net.{following}.weight", 1)]
    return groups
