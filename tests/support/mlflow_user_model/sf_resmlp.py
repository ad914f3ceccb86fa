"""A user model for tests/slow/test_mlflow_user_models.py: a residual MLP that imports a sibling module."""

from sf_blocks import Residual
from torch import nn


def build(description, width=16):
    return nn.Sequential(
        nn.Linear(description.num_features, width),
        Residual(width),
        nn.Linear(width, description.num_outputs),
    )
