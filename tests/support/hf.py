"""Hugging Face helpers for tests: the optional extra must be there in CI (a missing one fails there,
and skips elsewhere), and "pretrained" folders are made locally, never downloaded."""

from __future__ import annotations

import importlib.util

from tests.support.tracking import service_unavailable


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
        service_unavailable("transformers and tokenizers are not installed (pip install 'shardfuse[hf]')")
