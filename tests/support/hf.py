"""Hugging Face models for tests, made locally (random initialisation + save_pretrained): nothing is
ever downloaded. transformers is the extra ``shardfuse[hf]``: CI must have it (a test needing it fails
there without it); elsewhere such a test is skipped."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from tests.support.helpers import missing_in_ci

# A GPT-2 small enough for a 2-rank CPU training on byte tokens (vocabulary 256, blocks of 32): the
# run's model_args.config (the vocabulary comes from the dataset).
TINY_GPT2 = {"model_type": "gpt2", "n_positions": 64, "n_embd": 32, "n_layer": 1, "n_head": 2}


def require_transformers() -> None:
    if importlib.util.find_spec("transformers") is None or importlib.util.find_spec("tokenizers") is None:
        missing_in_ci("transformers and tokenizers are not installed; pip install 'shardfuse[hf]'")


def transformers_module():
    try:
        import transformers
    except ImportError:
        missing_in_ci("transformers is not installed; pip install 'shardfuse[hf]'")
    transformers.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()
    return transformers


def save_tiny_gpt2(folder: Path, seed: int = 0, max_shard_size: str | None = None, **config) -> Path:
    """A randomly initialised TINY_GPT2 (``config`` overrides its keys) with tied embeddings, as
    GPT2LMHeadModel.save_pretrained writes it into ``folder`` (shards of ``max_shard_size`` if given)."""
    import torch

    transformers = transformers_module()
    settings = {key: value for key, value in {**TINY_GPT2, **config}.items() if key != "model_type"}
    torch.manual_seed(seed)
    model = transformers.GPT2LMHeadModel(
        transformers.GPT2Config(vocab_size=256, bos_token_id=0, eos_token_id=0, **settings)
    )
    model.save_pretrained(folder, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return folder
