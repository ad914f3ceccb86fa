"""The model adapter with real torchrun ranks: a language model with tied embeddings, a dict output and
a buffer its forward updates trains under ddp (ranks identical, the tied tensor stored once) and merges;
bf16 parameters are tests/slow/test_bf16_model.py's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from tests.support.training import TIED_LM, merge_and_evaluate, merged_path, train_and_gather


@pytest.fixture(scope="module")
def ddp_tied(tmp_path_factory, stdlib_tokens_data) -> Path:
    dataset, shards = stdlib_tokens_data
    root = tmp_path_factory.mktemp("tied")
    return train_and_gather(root, dataset, shards, "ddp", 2, **TIED_LM, strategy="ddp")


def test_tied_embeddings_are_stored_once_and_recorded(ddp_tied):
    ranks = ddp_tied.parent / "ranks"
    for name in ("base", "rank-0", "rank-1"):
        tensors, metadata = load_weights(ranks / f"{name}.safetensors")
        assert "embed.weight" in tensors and "head.weight" not in tensors
        assert metadata["ties"] == {"head.weight": "embed.weight"}


def test_ddp_broadcasts_a_buffer_the_forward_updates(ddp_tied):
    """The EMA is not a normalisation layer's: found by a probe forward, broadcast like BatchNorm's."""
    ranks = ddp_tied.parent / "ranks"
    rank0, rank1 = (load_weights(ranks / f"rank-{r}.safetensors")[0] for r in (0, 1))
    base = load_weights(ranks / "base.safetensors")[0]
    assert not torch.equal(rank0["hidden_ema"], base["hidden_ema"])  # the forward did update it
    assert all(torch.equal(rank0[name], rank1[name]) for name in rank0)


def test_a_tied_model_merges_once_and_evaluates(tmp_path, ddp_tied, stdlib_tokens_data):
    dataset, _ = stdlib_tokens_data
    _, evaluation = merge_and_evaluate(tmp_path, dataset, ddp_tied, "none", "consolidate")
    tensors, metadata = load_weights(merged_path(tmp_path, ddp_tied, "none", "consolidate"))
    assert "head.weight" not in tensors and metadata["ties"] == {"head.weight": "embed.weight"}
    assert evaluation["merged"]["loss"] == pytest.approx(evaluation["ranks"][0]["loss"])
