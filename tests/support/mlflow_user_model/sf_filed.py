"""A user model for tests/slow/test_mlflow_user_models.py built from a file beside its code (a run's
``model_files``), with a third-party import (PyYAML) the logged model's requirements must list."""

import yaml
from torch import nn


def build(description, settings="assets/shape.yaml"):
    with open(settings) as fh:
        width = int(yaml.safe_load(fh)["width"])
    return nn.Sequential(
        nn.Linear(description.num_features, width), nn.Tanh(), nn.Linear(width, description.num_outputs)
    )
