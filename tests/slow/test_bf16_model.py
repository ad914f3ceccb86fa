"""bf16 parameters with real torchrun ranks: a tied language model (tests/support/models/tied_lm.py) in
bf16 trains per shard, checkpoints, merges in float64 (TIES) and comes back as bf16; its kill-and-resume
is tests/slow/test_resume_matrix.py's."""

from __future__ import annotations

import torch

from shardfuse.checkpoints.weights import load_weights, read_metadata
from tests.support.training import TIED_LM, merge_and_evaluate, merged_path, train_and_gather


def test_bf16_parameters_train_merge_in_float64_and_stay_bf16(tmp_path, stdlib_tokens_data):
    dataset, shards = stdlib_tokens_data
    gather = train_and_gather(
        tmp_path, dataset, shards, "bf16", 2, **{**TIED_LM, "model_args": {"dtype": "bfloat16"}}
    )
    ranks = [load_weights(gather.parent / "ranks" / f"rank-{r}.safetensors")[0] for r in (0, 1)]
    assert ranks[0]["embed.weight"].dtype == torch.bfloat16
    assert not torch.equal(ranks[0]["embed.weight"], ranks[1]["embed.weight"])  # independent ranks
    _, evaluation = merge_and_evaluate(tmp_path, dataset, gather, "none", "ties", density=0.5)
    merged = merged_path(tmp_path, gather, "none", "ties")
    tensors = load_weights(merged)[0]
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert read_metadata(merged)["ties"] == {"head.weight": "embed.weight"}
    assert evaluation["merged"]["loss"] < evaluation["base"]["loss"]
