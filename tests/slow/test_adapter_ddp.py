"""DDP over LoRA adapters, as the train stage runs it: every rank starts from one shared adapter, only the
adapter's gradients are all-reduced (bytes_all_reduced_per_rank counts the factors alone), the ranks end
identical, and train.json names the frozen base by its digest. (The kill and resume of LoRA under DDP:
tests/slow/test_resume_matrix.py; per-rank adapters, their fusion and export: tests/stages/
test_lora_adapters.py.)"""

from __future__ import annotations

import hashlib
import json

import torch

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import run_stage
from tests.support.training import LORA, LORA_CFG, launch_args


def test_ddp_all_reduces_the_adapter_gradients_only(tmp_path, digits_dataset, digits_shards):
    cfg = {**LORA_CFG, "strategy": "ddp", "epochs": 1, "adapter": {**LORA, "init": "shared"}}
    proc = run_stage("launch", *launch_args(tmp_path / "ranks", digits_dataset, digits_shards, cfg))
    assert proc.returncode == 0, proc.stderr[-3000:]
    train = json.loads((tmp_path / "ranks" / "train.json").read_text())
    adapter_bytes = 4 * (4 * 64 + 64 * 4 + 4 * 64 + 10 * 4)  # float32 factors of net.0 and net.2
    assert train["bytes_all_reduced_per_rank"] == train["num_steps"] * adapter_bytes
    ranks = [load_weights(tmp_path / "ranks" / f"rank-{r}.safetensors")[0] for r in (0, 1)]
    assert all(torch.equal(ranks[0][k], ranks[1][k]) for k in ranks[0])  # ddp: one adapter
    digest = hashlib.sha256((tmp_path / "ranks" / "base.safetensors").read_bytes()).hexdigest()
    assert train["adapter"]["base_sha256"] == digest
