"""The README's Hugging Face example exactly as it shows it (make the "pretrained" GPT-2 folder, then
the workflow), then what a user does with it: load the export with transformers (logits equal to the
model evaluate scored; it generates), load the MLflow model in another directory after the pretrained
folder is gone, and see that the folder is an input of the DAG."""

from __future__ import annotations

import json
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from shardfuse.checkpoints.weights import load_weights
from shardfuse.models.adapter import file_ties, load_state
from shardfuse.models.registry import build_model
from tests.support.helpers import (
    checkout_copy,
    planned_jobs,
    readme_block,
    run_in,
    run_readme_examples,
    snakemake_failure,
    subprocess_env,
    summary,
)
from tests.support.hf import require_transformers

pytestmark = pytest.mark.timeout(1200)
RUNS = ("hf_ddp", "hf_uniform", "hf_task_arithmetic", "hf_ties")


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> Path:
    require_transformers()
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    run_readme_examples(checkout, "examples-hf")
    return checkout


def test_the_hf_example_trains_fuses_and_exports_every_run(example):
    rows = summary(example, "config/examples/hf_finetune.yaml")
    assert set(rows) == set(RUNS)
    base = float(rows["hf_ddp"]["test_loss_base"])
    assert all(float(rows[run]["test_loss_merged"]) < base for run in RUNS)  # fine-tuning helped
    # consolidate of ddp ranks is the ranks' model itself
    assert float(rows["hf_ddp"]["test_loss_merged"]) == float(rows["hf_ddp"]["test_loss_best_rank"])
    # bits per byte uses the corpus's bytes per token (BPE tokens are several bytes)
    info = json.loads((example / "results/datasets/stdlib_email/dataset.json").read_text())
    assert info["bytes_per_token"] > 1.5
    ddp = rows["hf_ddp"]
    assert float(ddp["test_bits_per_byte_merged"]) == pytest.approx(
        float(ddp["test_bits_per_token_merged"]) / info["bytes_per_token"]
    )
    for run in RUNS:
        tensors, metadata = load_weights(example / "results/runs" / run / "merged.safetensors")
        assert "lm_head.weight" not in tensors and metadata["ties"] == {
            "lm_head.weight": "transformer.wte.weight"
        }
        assert (example / "results/runs" / run / "hf" / "model.safetensors").is_file()


def test_the_export_loads_in_transformers_with_the_logits_evaluate_scored_and_generates(example, monkeypatch):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    monkeypatch.chdir(example)  # the spec names the pretrained folder relative to the workflow
    run_dir = Path("results/runs/hf_ties")
    tensors, metadata = load_weights(run_dir / "merged.safetensors")
    ours = build_model(metadata["model"])
    load_state(ours, tensors, "merged", file_ties(metadata))
    exported = AutoModelForCausalLM.from_pretrained(run_dir / "hf")
    ours.eval(), exported.eval()
    tokens = torch.randint(0, exported.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        assert torch.equal(ours(tokens), exported(tokens).logits)
    assert exported.lm_head.weight is exported.transformer.wte.weight  # re-tied by transformers
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf")
    ids = tokenizer("def parse(", return_tensors="pt").input_ids
    generated = exported.generate(ids, max_new_tokens=8, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 8
    assert tokenizer.decode(generated[0]).startswith("def parse(")


def test_the_logged_model_loads_elsewhere_after_the_pretrained_folder_is_gone(example, tmp_path):
    record = json.loads((example / "results/runs/hf_uniform/mlflow.json").read_text())
    moved = example.parent / "pretrained-moved-away"
    shutil.move(example / "pretrained", moved)
    try:
        script = (
            "import mlflow, pandas as pd\n"
            f"mlflow.set_tracking_uri('sqlite:///{example}/mlflow.db')\n"
            f"model = mlflow.pyfunc.load_model('runs:/{record['parent_run_id']}/hf_uniform')\n"
            "out = model.predict(pd.DataFrame({'tokens': [[1, 2, 3, 4], [5, 6]]}))\n"
            "print(out.shape, round(float(out.sum(axis=1).iloc[0]), 4))\n"
        )
        proc = subprocess.run(
            [sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True,
            env=subprocess_env(), timeout=300,
        )  # fmt: skip
    finally:
        shutil.move(moved, example / "pretrained")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["(2,", "512)", "1.0"]  # a next-token distribution per row
    requirements = next((example / "mlruns").rglob("requirements.txt")).read_text()
    assert "transformers==" in requirements and "tokenizers==" in requirements


def test_the_pretrained_folder_is_an_input_of_the_dag(example):
    dry = run_in(example, ["snakemake", "-n", "--configfile", "config/examples/hf_finetune.yaml"])
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stderr[-2000:]
    weights = example / "pretrained/gpt2-stdlib/model.safetensors"
    saved = weights.read_bytes()
    changed = load_file(weights)
    changed["transformer.wpe.weight"] = changed["transformer.wpe.weight"] + 0.01
    save_file(changed, weights, metadata={"format": "pt"})
    try:
        dry = run_in(example, ["snakemake", "-n", "--configfile", "config/examples/hf_finetune.yaml"])
    finally:
        weights.write_bytes(saved)
    assert dry.returncode == 0, dry.stderr[-2000:]
    assert planned_jobs(dry.stdout)["train"] == 2  # both trainings, under new names


# ---------------------------------------------------------------- LoRA (the README's next example)

LORA_RUNS = ("lora_ddp", "lora_uniform", "lora_ties", "full_ddp", "full_uniform")


@pytest.fixture(scope="module")
def lora_example(example) -> Path:
    """The README's LoRA example in the same checkout, after the Hugging Face one (its pretrained folder
    and its full fine-tuning trainings are reused, as the README says)."""
    trainings_before = set((example / "results/trainings").iterdir())
    for line in readme_block("examples-hf-lora").splitlines():
        command = shlex.split(line.split("#")[0])
        if command:
            assert command[0] == "snakemake", command
            proc = run_in(example, command)
            assert proc.returncode == 0, snakemake_failure(example, proc)
    new = set((example / "results/trainings").iterdir()) - trainings_before
    assert len(new) == 2, sorted(p.name for p in new)  # the two LoRA trainings; full fine-tuning reused
    return example


def test_the_lora_example_fuses_per_shard_adapters_and_stores_factors_only(lora_example):
    rows = summary(lora_example, "config/examples/hf_lora.yaml")
    assert set(rows) == set(LORA_RUNS)
    before = float(rows["lora_ddp"]["test_loss_base"])
    assert all(float(rows[run]["test_loss_merged"]) < before for run in LORA_RUNS)  # every one learned
    sizes = {}
    for run in ("lora_uniform", "full_uniform"):
        train = json.loads((lora_example / "results/runs" / run / "merge.json").read_text())["training"]
        ranks = lora_example / "results/trainings" / train / "ranks"
        sizes[run] = (ranks / "rank-0.safetensors").stat().st_size
        tensors, _ = load_weights(ranks / "rank-0.safetensors")
        assert all(".lora_" in name for name in tensors) == (run == "lora_uniform")
    assert sizes["lora_uniform"] < sizes["full_uniform"] / 5
    record = json.loads((lora_example / "results/runs/lora_ties/adapter/fusion.json").read_text())
    assert record["mode"] == "svd" and record["r"] == 8 and 0 < record["mean_truncation_error"] < 1
    # the fused model exports to transformers like any run (base + merged update, tied embeddings kept)
    assert (lora_example / "results/runs/lora_ties/hf/model.safetensors").is_file()


def test_the_fused_adapter_loads_in_peft_with_the_logits_of_the_fused_model(lora_example, monkeypatch):
    """AutoPeftModel (its base from base_model_name_or_path, the training's base exported) with the cat
    adapter of the uniform fusion gives the logits of the fused model's transformers export."""
    from peft import AutoPeftModelForCausalLM, PeftModel
    from transformers import AutoModelForCausalLM

    monkeypatch.chdir(lora_example)  # base_model_name_or_path is relative to the workflow, as results/ are
    adapter = Path("results/runs/lora_uniform/adapter")
    config = json.loads((adapter / "adapter_config.json").read_text())
    assert config["r"] == 16 and config["fan_in_fan_out"] is True  # GPT-2's Conv1D, two ranks of r 8
    peft_model = AutoPeftModelForCausalLM.from_pretrained(adapter).eval()
    fused = AutoModelForCausalLM.from_pretrained("results/runs/lora_uniform/hf").eval()
    tokens = torch.randint(0, fused.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ours, theirs = fused(tokens).logits, peft_model(tokens).logits
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4), (ours - theirs).abs().max()
    # the svd adapter loads onto the base by hand too
    base = AutoModelForCausalLM.from_pretrained(config["base_model_name_or_path"])
    svd = PeftModel.from_pretrained(base, "results/runs/lora_ties/adapter").eval()
    with torch.no_grad():
        assert svd(tokens).logits.shape == theirs.shape


def test_mlflow_logs_the_adapter_and_names_its_base(lora_example):
    script = (
        "import json, mlflow\n"
        f"mlflow.set_tracking_uri('sqlite:///{lora_example}/mlflow.db')\n"
        "client = mlflow.MlflowClient()\n"
        f"record = json.load(open('{lora_example}/results/runs/lora_ties/mlflow.json'))\n"
        "run = client.get_run(record['parent_run_id'])\n"
        "files = sorted(f.path for f in client.list_artifacts(run.info.run_id, 'adapter'))\n"
        "print(json.dumps({'files': files, 'metrics': run.data.metrics, 'tags': run.data.tags}))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, env=subprocess_env(), timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    logged = json.loads(proc.stdout.strip().splitlines()[-1])
    assert logged["files"] == [
        "adapter/adapter_config.json",
        "adapter/adapter_model.safetensors",
        "adapter/fusion.json",
    ]
    assert logged["metrics"]["adapter_r"] == 8 and 0 < logged["metrics"]["adapter_max_truncation_error"] < 1
    train = json.loads((lora_example / "results/runs/lora_ties/merge.json").read_text())["training"]
    train_json = json.loads((lora_example / "results/trainings" / train / "ranks/train.json").read_text())
    assert logged["tags"]["shardfuse.adapter_base_sha256"] == train_json["adapter"]["base_sha256"]
    assert logged["tags"]["shardfuse.adapter"] == "lora r=8 alpha=16.0"
