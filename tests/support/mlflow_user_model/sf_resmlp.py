"""A user model for tests/stages/test_mlflow_model.py: a residual MLP that imports a sibling module."""

from sf_blocks import Residual
from torch import nn


def build(description, width=16):
    return nn.Sequential(
        nn.Linear(description.num_features, width),
        Residual(width),
        nn.Linear(width, description.num_outputs),
    )
