"""init_from a Hugging Face save_pretrained folder (made here: random initialisation + save_pretrained,
nothing downloaded): a real 2-rank training starts every rank from the folder's weights (its
base.safetensors holds them, the tied embedding once); a folder of another architecture fails when the
config loads, before any job, naming the tensor and the folder; a fitting folder's check is paid once."""

from __future__ import annotations

import json
import os
import re
import subprocess
import time

import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from shardfuse.checkpoints.weights import load_weights, read_metadata
from shardfuse.experiment.init_check import CACHE_DIR
from tests.support.helpers import MEASUREMENTS, run_stage, snakemake_command, subprocess_env
from tests.support.hf import TINY_GPT2, save_tiny_gpt2

# As the stdlib_tokens_data fixture prepares it (byte tokens: vocabulary 256, blocks of 32).
STDLIB = {"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 32, "max_tokens": 40000}
HF_RUN = {"model": "hf", "model_args": {"config": TINY_GPT2}}


def write_config(workdir, folder_name: str):
    (workdir / "config").mkdir(exist_ok=True)
    path = workdir / "config" / "config.yaml"
    config = {
        "datasets": {"stdlib": STDLIB},
        "runs": {"r": {"init_from": folder_name}},
        "run_defaults": {"dataset": "stdlib", "world_size": 2, **HF_RUN},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def test_every_rank_starts_from_the_folders_weights(tmp_path, stdlib_tokens_data):
    dataset, shards = stdlib_tokens_data
    folder = save_tiny_gpt2(tmp_path / "gpt2", seed=5)  # not the run's seed: a fresh init would differ
    out = tmp_path / "ranks"
    cfg = {
        **HF_RUN, "init_from": str(folder), "strategy": "localsgd", "sync_every": 0, "optimizer": "adamw",
        "lr": 0.001, "batch_size": 32, "epochs": 1, "seed": 0, "checkpoint_every": 0,
    }  # fmt: skip
    proc = run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", out, "--", "--run-name", "t", "--shard-dir", shards,
        "--dataset-dir", dataset, "--config-json", json.dumps(cfg), "--init-from", folder, timeout=600,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    with safe_open(str(folder / "model.safetensors"), framework="pt") as fh:
        pretrained = {name: fh.get_tensor(name) for name in fh.keys()}
    base, metadata = load_weights(out / "base.safetensors")
    assert "lm_head.weight" not in pretrained and base.keys() == pretrained.keys()  # the tie stored once
    assert all(torch.equal(base[name], pretrained[name]) for name in base)
    assert metadata["ties"] == {"lm_head.weight": "transformer.wte.weight"}
    assert metadata["init_from"] == str(folder)
    for rank in (0, 1):  # each rank's weights at step 0 were the base's
        assert read_metadata(out / f"rank-{rank}.safetensors")["init_sha256"] == metadata["init_sha256"]


def test_a_folder_of_another_architecture_fails_when_the_config_loads(tmp_path):
    save_tiny_gpt2(tmp_path / "narrow", n_embd=16)
    config = write_config(tmp_path, "narrow")
    proc = run_stage("config", "--configfile", config, cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.strip() == (
        "shardfuse.config: error: config error at runs[r].init_from: init_from narrow: tensor "
        "'transformer.wte.weight' is torch.float32 [256, 16] but the model needs torch.float32 [256, 32]; "
        "start from weights of this architecture (model, model_args), or map the file's names onto the "
        "model's with init_from_prefix"
    )
    assert not (tmp_path / CACHE_DIR).exists()  # a failure is checked again next time


def test_a_sharded_folder_is_checked_once_and_wired_into_the_train_job(tmp_path):
    save_tiny_gpt2(tmp_path / "gpt2", max_shard_size="20KB")
    config = write_config(tmp_path, "gpt2")
    seconds = []
    for _ in range(2):
        start = time.monotonic()
        proc = run_stage("config", "--configfile", config, cwd=tmp_path)
        seconds.append(time.monotonic() - start)
        assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout)["runs"]["r"]["init_source"] == {"folder": "gpt2"}
    assert len(list((tmp_path / CACHE_DIR).glob("*.json"))) == 1
    MEASUREMENTS.append(
        f"init_from check of a GPT-2 folder (python -m shardfuse.config): {seconds[0]:.1f} s the first "
        f"time, {seconds[1]:.1f} s cached"
    )
    assert seconds[1] < seconds[0]
    dry_run = subprocess.run(
        snakemake_command(tmp_path, "-n", "-p", "--cores", 1, "--until", "train"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert dry_run.returncode == 0, dry_run.stderr[-3000:]
    assert "gpt2/model.safetensors.index.json, gpt2/model-00001-of-" in dry_run.stdout  # the train inputs
    assert "--init-from gpt2 --init-sha256 " in dry_run.stdout
    # The weights replaced under their old mtime (cp -p, a restored backup): the train job's params change,
    # so Snakemake's params trigger re-trains it, where the mtime alone would say nothing changed.
    shard = next((tmp_path / "gpt2").glob("model-00001-of-*.safetensors"))
    tensors, stat = load_file(str(shard)), shard.stat()
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] + 1}, str(shard), metadata={"format": "pt"})
    os.utime(shard, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    again = subprocess.run(
        snakemake_command(tmp_path, "-n", "-p", "--cores", 1, "--until", "train"),
        capture_output=True, text=True, env=subprocess_env(), timeout=300,
    )  # fmt: skip
    digests = [
        re.search(r"--init-sha256 ([0-9a-f]{64})", out).group(1) for out in (dry_run.stdout, again.stdout)
    ]
    assert digests[0] != digests[1], digests
