"""A residual MLP, as a researcher would bring their own network to shardfuse.

A run uses it with::

    model: "resmlp:build"
    code_paths: [config/examples/models]
    model_args: {width: 64, blocks: 2}

``build`` receives the dataset's description (``num_features``, ``num_outputs``, ``task``, names, ...)
and the run's ``model_args`` as keyword arguments, and returns a plain ``torch.nn.Module``. shardfuse
standardises the inputs before they reach it (and maps regression outputs back to the targets' units),
so nothing here knows about shards, ranks or checkpoints.
"""

from torch import nn


class ResidualBlock(nn.Module):
    """Pre-LayerNorm feed-forward block with a skip connection."""

    def __init__(self, width: int, expansion: int = 2) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.feed_forward = nn.Sequential(
            nn.Linear(width, expansion * width), nn.GELU(), nn.Linear(expansion * width, width)
        )

    def forward(self, hidden):
        return hidden + self.feed_forward(self.norm(hidden))


class ResMLP(nn.Module):
    def __init__(self, num_features: int, num_outputs: int, width: int, blocks: int) -> None:
        super().__init__()
        self.embed = nn.Linear(num_features, width)
        self.blocks = nn.Sequential(*(ResidualBlock(width) for _ in range(blocks)))
        self.head = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, num_outputs))

    def forward(self, features):
        return self.head(self.blocks(self.embed(features)))


def build(description, width: int = 64, blocks: int = 2) -> nn.Module:
    return ResMLP(description.num_features, description.num_outputs, int(width), int(blocks))
