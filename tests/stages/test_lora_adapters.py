"""LoRA adapters through the stages as a user runs them: per-rank adapters trained with torchrun over one
frozen base, checkpoints of the factors only, fused in update space exactly as the dense fine-tuned
models would be, and exported as a PEFT adapter that PEFT itself loads with the merged model's logits.
The training is a real torchrun launch; gather, merge, export and evaluate are called in this process
(call_stage: their command lines without the import cost; the process boundary is tests/contracts/
test_stage_boundary.py). The ranks' own refusal of an adapter that fits no module: tests/slow/
test_stage_edges.py; DDP over one shared adapter: tests/slow/test_adapter_ddp.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors import safe_open

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.io import sha256_file
from tests.support.helpers import built_once, call_stage, run_stage
from tests.support.training import LORA_CFG


def launch(out: Path, dataset: Path, shards: Path, cfg: dict, name: str = "lora"):
    return run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", out, "--", "--run-name", name, "--shard-dir", shards,
        "--dataset-dir", dataset, "--config-json", json.dumps(cfg),
    )  # fmt: skip


def gather(train_dir: Path, out: Path):
    proc = call_stage("gather", "--train-dir", train_dir, "--world-size", 2, "--out", out)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return out


def densify(adapter_dir: Path, out: Path) -> Path:
    """The same training as whole models: each rank's W0 + (alpha/r)·B·A written as a plain rank
    checkpoint (what full fine-tuning to the same weights would have published), base and records kept."""
    from shardfuse.models.lora import load_model_weights

    out.mkdir(parents=True)
    shutil.copy2(adapter_dir / "base.safetensors", out / "base.safetensors")
    shutil.copy2(adapter_dir / "base.json", out / "base.json")
    train = json.loads((adapter_dir / "train.json").read_text())
    train.pop("adapter")
    (out / "train.json").write_text(json.dumps(train))
    for rank in (0, 1):
        tensors, meta = load_model_weights(adapter_dir / f"rank-{rank}.safetensors")
        save_weights(out / f"rank-{rank}.safetensors", tensors, meta)
    return out


def merge_then_export(tmp_path: Path, gather_path: Path, method: str, params: dict, mode: str):
    """The run's merge (into tmp_path/merged.safetensors and merge.json), then export_adapter of it
    (into tmp_path/adapter): the merge must pass; the export's process is returned."""
    proc = call_stage(
        "merge", "--gather", gather_path, "--method", method, "--params-json", json.dumps(params),
        "--out-weights", tmp_path / "merged.safetensors", "--out-json", tmp_path / "merge.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return call_stage(
        "export_adapter", "--gather", gather_path, "--merge-json", tmp_path / "merge.json", "--mode", mode,
        "--out", tmp_path / "adapter",
    )  # fmt: skip


@pytest.fixture(scope="module")
def lora_training(tmp_path_factory, digits_dataset, digits_shards) -> Path:
    """results/{lora,dense}/: the adapter training with its gather.json, and its dense twin's."""

    def build(root: Path) -> None:
        ranks = root / "lora" / "ranks"
        proc = launch(ranks, digits_dataset, digits_shards, LORA_CFG)
        assert proc.returncode == 0, proc.stderr[-3000:]
        gather(ranks, root / "lora" / "gather.json")
        gather(densify(ranks, root / "dense" / "ranks"), root / "dense" / "gather.json")

    return built_once(tmp_path_factory, "lora-training", build)


def test_rank_checkpoints_hold_the_factors_only_and_name_their_base(lora_training):
    ranks = lora_training / "lora" / "ranks"
    base_bytes = (ranks / "base.safetensors").stat().st_size
    train = json.loads((ranks / "train.json").read_text())
    adapter = train["adapter"]
    assert adapter["base_sha256"] == sha256_file(ranks / "base.safetensors")
    assert adapter["targets"] == {
        "net.0": {"shape": [64, 64], "fan_in_fan_out": False},
        "net.2": {"shape": [10, 64], "fan_in_fan_out": False},
    }
    factors = []
    for rank in (0, 1):
        tensors, meta = load_weights(ranks / f"rank-{rank}.safetensors")
        assert sorted(tensors) == [
            "net.0.lora_A.weight", "net.0.lora_B.weight", "net.2.lora_A.weight", "net.2.lora_B.weight",
        ]  # fmt: skip
        assert [list(tensors[k].shape) for k in sorted(tensors)] == [[4, 64], [64, 4], [4, 64], [10, 4]]
        assert (
            meta["adapter"] == adapter
            and (ranks / f"rank-{rank}.safetensors").stat().st_size < base_bytes / 3
        )
        factors.append(tensors)
    # per_rank: each rank drew its own A (the LoRA Soups setting), and both trained B away from zero
    assert not torch.equal(factors[0]["net.0.lora_A.weight"], factors[1]["net.0.lora_A.weight"])
    assert all(f["net.2.lora_B.weight"].abs().sum() > 0 for f in factors)
    base, _ = load_weights(ranks / "base.safetensors")
    assert sorted(base) == [
        "input_mean",
        "input_scale",
        "net.0.bias",
        "net.0.weight",
        "net.2.bias",
        "net.2.weight",
    ]
    info = json.loads((lora_training / "lora" / "gather.json").read_text())
    assert info["adapter"] == adapter and set(info["tensors"]) == set(factors[0])
    assert info["num_parameters"] == sum(t.numel() for t in base.values())


@pytest.mark.parametrize(
    ("method", "params"),
    [("uniform", {}), ("ties", {"density": 0.3}), ("dare", {"density": 0.5})],
)
def test_the_adapters_fuse_as_the_dense_fine_tuned_models_would(tmp_path, lora_training, method, params):
    """The merge of the adapters (in update space) against the same method on the dense models
    W0 + ΔW_r over the same base: equal to float32 rounding, DARE's masks drawn alike."""
    merged = {}
    for kind in ("lora", "dense"):
        out = tmp_path / f"{kind}.safetensors"
        proc = call_stage(
            "merge", "--gather", lora_training / kind / "gather.json", "--method", method,
            "--params-json", json.dumps(params), "--out-weights", out, "--out-json", out.with_suffix(".json"),
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-2000:]
        merged[kind] = load_weights(out)[0]
    assert merged["lora"].keys() == merged["dense"].keys()
    base, _ = load_weights(lora_training / "lora" / "ranks" / "base.safetensors")
    for name, ours in merged["lora"].items():
        theirs = merged["dense"][name]
        assert ours.dtype == theirs.dtype == base[name].dtype
        # W_r rounded to float32 before the dense path subtracts W0: a few ulps of W, and where a task
        # vector entry sits at the trim threshold the two can keep different neighbours (rare)
        close = torch.isclose(ours, theirs, rtol=0, atol=4e-6)
        assert close.float().mean() > 0.995, (name, (ours - theirs).abs().max())
    record = json.loads((tmp_path / "lora.json").read_text())
    assert record["adapter"] == {"type": "lora", "r": 4, "alpha": 8.0, "init": "per_rank"}
    assert record["base"]["sha256"] == sha256_file(lora_training / "lora" / "ranks" / "base.safetensors")
    assert set(record["tensor_stats"]) == {"net.0.weight", "net.2.weight"}  # the adapted modules only


def _logits(model, features: np.ndarray) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.as_tensor(features, dtype=torch.float32))


def test_the_cat_adapter_loads_in_peft_with_the_merged_models_logits(tmp_path, lora_training, digits_dataset):
    """uniform + merge_adapter cat: PeftModel.from_pretrained(base model, adapter folder) gives the logits
    of the merged model evaluate scores (to float rounding), hence its accuracy."""
    from peft import PeftModel

    from shardfuse.data.reader import load_table
    from shardfuse.models.adapter import load_state
    from shardfuse.models.registry import build_model

    gather_path = lora_training / "lora" / "gather.json"
    merged, folder = tmp_path / "merged.safetensors", tmp_path / "adapter"
    proc = merge_then_export(tmp_path, gather_path, "uniform", {}, "cat")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert sorted(p.name for p in folder.iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "fusion.json",
    ]
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (
        config["peft_type"] == "LORA" and config["r"] == 8 and config["lora_alpha"] == 16.0
    )  # N·r, same scale
    assert config["target_modules"] == ["net.0", "net.2"]
    evaluation = tmp_path / "eval.json"
    proc = call_stage(
        "evaluate", "--run", "r", "--test", digits_dataset / "test.parquet", "--gather", gather_path,
        "--merged", merged, "--out", evaluation,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]

    base_tensors, meta = load_weights(lora_training / "lora" / "ranks" / "base.safetensors")
    model = build_model(meta["model"])
    load_state(model, base_tensors, "base")
    peft_model = PeftModel.from_pretrained(model, str(folder)).eval()
    merged_model = build_model(meta["model"])
    load_state(merged_model, load_weights(merged)[0], "merged")
    merged_model.eval()
    features, labels = load_table(digits_dataset / "test.parquet")
    ours, theirs = _logits(merged_model, features.numpy()), _logits(peft_model, features.numpy())
    assert torch.allclose(ours, theirs, rtol=0, atol=1e-4), (ours - theirs).abs().max()
    accuracy = (theirs.argmax(1) == labels).float().mean().item()
    assert accuracy == pytest.approx(
        json.loads(evaluation.read_text())["merged"]["accuracy"], abs=1 / len(labels)
    )


def test_the_svd_adapter_records_each_modules_truncation_error(tmp_path, lora_training):
    """ties + svd: rank r again; the recorded error is ||ΔW - B'A'||/||ΔW|| of the merged update."""
    merged, folder = tmp_path / "merged.safetensors", tmp_path / "adapter"
    proc = merge_then_export(
        tmp_path, lora_training / "lora" / "gather.json", "ties", {"density": 0.3}, "svd"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    record = json.loads((folder / "fusion.json").read_text())
    assert record["r"] == 4 and record["method"] == "ties"
    base, _ = load_weights(lora_training / "lora" / "ranks" / "base.safetensors")
    merged_tensors = load_weights(merged)[0]
    with safe_open(str(folder / "adapter_model.safetensors"), "pt") as handle:
        for module in ("net.0", "net.2"):
            a = handle.get_tensor(f"base_model.model.{module}.lora_A.weight").double()
            b = handle.get_tensor(f"base_model.model.{module}.lora_B.weight").double()
            update = merged_tensors[f"{module}.weight"].double() - base[f"{module}.weight"].double()
            error = torch.linalg.norm(update - 2.0 * b @ a) / torch.linalg.norm(update)
            assert error.item() == pytest.approx(record["truncation_error"][f"{module}.weight"], abs=1e-4)
    assert 0 < record["max_truncation_error"] < 1


def test_cat_of_a_method_not_linear_in_the_updates_is_refused_in_one_line(tmp_path, lora_training):
    proc = merge_then_export(tmp_path, lora_training / "lora" / "gather.json", "ties", {}, "cat")
    assert proc.returncode == 2 and not (tmp_path / "adapter").exists()
    assert (
        proc.stderr.strip()
        .splitlines()[-1]
        .endswith(
            "cat is exact only for the methods linear in the updates (uniform, weighted, task_arithmetic), "
            "not ties; use merge_adapter svd"
        )
    )


@pytest.mark.parametrize("method", ["slerp", "greedy_soup"])
def test_a_method_on_whole_weights_is_refused_for_adapters(tmp_path, lora_training, method):
    proc = call_stage(
        "merge", "--gather", lora_training / "lora" / "gather.json", "--method", method,
        "--out-weights", tmp_path / "m.safetensors", "--out-json", tmp_path / "merge.json",
    )  # fmt: skip
    assert proc.returncode == 2 and not (tmp_path / "m.safetensors").exists()
    assert f"merge method {method} cannot fuse LoRA adapters" in proc.stderr


def test_a_swapped_base_or_an_adapter_without_its_base_is_refused(tmp_path, lora_training, digits_dataset):
    work = tmp_path / "ranks"
    shutil.copytree(lora_training / "lora" / "ranks", work)
    gathered = gather(work, tmp_path / "before.json")
    base, meta = load_weights(work / "base.safetensors")
    base["net.0.weight"] = base["net.0.weight"] + 0.01
    save_weights(work / "base.safetensors", base, meta)  # a consistent sidecar: only the digest tells
    proc = call_stage("gather", "--train-dir", work, "--world-size", 2, "--out", tmp_path / "gather.json")
    assert proc.returncode == 2 and not (tmp_path / "gather.json").exists()
    assert "is not the base the adapters were trained on" in proc.stderr
    # swapped after gather: merge refuses it before its output is in place
    out = tmp_path / "merged.safetensors"
    proc = call_stage(
        "merge", "--gather", gathered, "--method", "uniform", "--out-weights", out,
        "--out-json", tmp_path / "merge.json",
    )  # fmt: skip
    assert proc.returncode == 2 and not out.exists() and not (tmp_path / "merge.json").exists()
    assert "is not the base the adapters were trained on" in proc.stderr, proc.stderr[-2000:]
    (work / "base.safetensors").unlink()
    from shardfuse.io import UserError
    from shardfuse.models.lora import load_model_weights

    with pytest.raises(UserError, match="has no base beside it"):
        load_model_weights(work / "rank-0.safetensors")
