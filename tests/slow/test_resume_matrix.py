"""Kill-and-resume for every model, task and training-loop feature: a rank killed after a checkpoint is
restarted by torchrun and ends bitwise identical to an uninterrupted training (ddp on digits with its
system metrics: tests/slow/test_resume_killed_rank.py)."""

from __future__ import annotations

import pytest

from tests.support.helpers import REPO
from tests.support.hf import require_transformers
from tests.support.training import RESUME_CFG, assert_resumed_bitwise, kill_a_rank_and_resume, train_reference

# A user model (config/examples/models/resmlp.py, imported from its code path in every rank) and a
# regression task resume as bitwise as the built-in classifier.
USER_MODEL = {"model": "resmlp:build", "code_paths": [str(REPO / "config/examples/models")]}
# The built-in CNN (BatchNorm: running statistics and a counter in every checkpoint) on images and the
# built-in transformer on byte tokens resume as bitwise too: the transformer's whole parameters and
# AdamW's moments under fsdp-transformer, its forward under local SGD with per-rank LoRA adapters
# (lora-transformer), its tied embeddings under hf-gpt2 and tied-bf16 below.
CNN = {"model": "cnn", "model_args": {"channels": [8, 16]}, "epochs": 6, "dropout": 0.0}
TRANSFORMER = {"model": "transformer", "model_args": {"width": 32, "layers": 1, "heads": 2}, "epochs": 3}
# The training loop's state resumes bitwise too: the schedule (a function of the step), accumulation
# (checkpoints fall between optimiser steps), clipping, and DiLoCo's outer parameters and momentum with
# validation's best weights and patience (keep: best publishes a step before the end).
SCHEDULE_ACCUM = {
    "lr_schedule": "cosine",
    "warmup_steps": 15,
    "min_lr": 0.0003,
    "grad_accum_steps": 3,
    "grad_clip_norm": 0.5,
    "decay_rule": "ndim>=2",
    "checkpoint_every": 13,
}
DILOCO = {
    "sync_every": 5,
    "grad_accum_steps": 2,
    "eval_every": 12,
    "keep": "best",
    "patience": 40,
    "checkpoint_every": 20,
}
# LoRA adapters (factors only in every checkpoint, the base frozen): adapter dropout draws from the
# checkpointed generator; ddp all-reduces the factors' gradients; per-rank adapters on the transformer.
# The ddp case also carries the schedule, accumulation and clipping (one training for both).
LORA_DDP = {"adapter": {"type": "lora", "r": 4, "alpha": 8, "dropout": 0.1}, "dropout": 0.0}
LORA_DDP_SCHEDULE_ACCUM = {**SCHEDULE_ACCUM, **LORA_DDP}
LORA_TRANSFORMER = {
    **TRANSFORMER,
    "checkpoint_every": 10,
    "adapter": {"type": "lora", "r": 2, "target_modules": ["qkv", "proj"], "init": "per_rank"},
}
# FSDP2 (fsdp: 2, the two ranks one replica): each rank's checkpoint holds its shards of the model and
# of AdamW's moments; the built-in transformer (its blocks the units), with clipping over the sharded
# gradients (tests/slow/test_fsdp_replica.py follows DDP with the MLP, its Linear layers the
# units; the GPT-2 case below is FSDP with tied embeddings).
FSDP_TRANSFORMER = {**TRANSFORMER, "fsdp": 2, "grad_clip_norm": 1.0, "checkpoint_every": 10}
DATA_FIXTURES = {
    "digits": "digits_data",
    "diabetes": "diabetes_data",
    "digits_images": "digits_images_data",
    "stdlib": "stdlib_tokens_data",
}


@pytest.mark.parametrize(
    ("strategy", "data", "extra"),
    [
        # local SGD with the built-in MLP is the user model's case with another model (the fast tier
        # kills the MLP under ddp): one training covers both.
        ("localsgd", "digits", {**USER_MODEL, "model_args": {"width": 16, "blocks": 1}, "epochs": 6}),
        ("ddp", "diabetes", {"loss": "huber", "epochs": 16, "checkpoint_every": 20}),
        ("ddp", "digits_images", CNN),
        ("diloco", "digits", DILOCO),
        ("ddp", "digits", LORA_DDP_SCHEDULE_ACCUM),
        ("localsgd", "stdlib", LORA_TRANSFORMER),
        ("ddp", "stdlib", FSDP_TRANSFORMER),
    ],
    ids=[
        "localsgd-user-model",
        "regression",
        "cnn",
        "diloco",
        "lora-ddp-schedule-accum",
        "lora-transformer",
        "fsdp-transformer",
    ],
)
def test_killed_rank_is_restarted_by_torchrun_and_resumes_bitwise_identical(
    tmp_path, request, strategy, data, extra
):
    dataset, shards = request.getfixturevalue(DATA_FIXTURES[data])
    cfg = {**RESUME_CFG, "strategy": strategy, "sync_every": 7 if strategy == "localsgd" else 0, **extra}
    reference = train_reference(tmp_path / "reference", dataset, shards, cfg)
    killed = tmp_path / "killed"
    kill_a_rank_and_resume(killed, dataset, shards, cfg)
    assert_resumed_bitwise(reference, killed)


# The models people bring resume as bitwise: a Hugging Face GPT-2 with its default tied embeddings (one
# tensor under two names: stored once in every checkpoint, re-tied on load), and a tied user model whose
# parameters are bf16 (its optimiser state too).
HF_GPT2 = {
    "model": "hf",
    "model_args": {
        "config": {"model_type": "gpt2", "n_layer": 1, "n_embd": 32, "n_head": 2, "n_positions": 64}
    },
    "epochs": 3,
    "checkpoint_every": 10,
}
TIED_BF16 = {
    "model": "tied_lm:build",
    "code_paths": [str(REPO / "tests/support/models")],
    "model_args": {"width": 16, "dtype": "bfloat16"},
    "epochs": 3,
    "checkpoint_every": 10,
}


@pytest.mark.parametrize(
    ("strategy", "extra"),
    [("ddp", HF_GPT2), ("localsgd", TIED_BF16), ("ddp", {**HF_GPT2, "fsdp": 2})],
    ids=["hf-gpt2", "tied-bf16", "hf-gpt2-fsdp"],
)
def test_a_tied_or_bf16_model_resumes_bitwise_identical_after_a_kill(
    tmp_path, stdlib_tokens_data, strategy, extra
):
    if extra["model"] == "hf":
        require_transformers()
    dataset, shards = stdlib_tokens_data
    cfg = {**RESUME_CFG, "strategy": strategy, "sync_every": 0, "dropout": 0.0, **extra}
    reference = train_reference(tmp_path / "reference", dataset, shards, cfg)
    killed = tmp_path / "killed"
    kill_a_rank_and_resume(killed, dataset, shards, cfg)
    assert_resumed_bitwise(reference, killed)
