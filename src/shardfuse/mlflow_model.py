"""The loader named by MLflow models logged before the package layout (their MLmodel says
``loader_module: shardfuse.mlflow_model``); the logged model itself is :mod:`shardfuse.track.model`.

Such a model ships its own copy of shardfuse in ``code/``, which MLflow puts first on sys.path, so in a
fresh process it loads with that copy. In a process that has already imported this version of
shardfuse, that name resolves here instead, and the model loads with today's loader (its files,
``data/merged.safetensors`` with the model spec in its header, are read the same way)."""

from shardfuse.track.model import _load_pyfunc

__all__ = ["_load_pyfunc"]
