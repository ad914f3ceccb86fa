"""The README's one-domain-per-rank example exactly as it shows it: a local "pretrained" GPT-2, instruction
pairs made from three standard-library packages (one JSON Lines file each), the GPT-2 fine-tuned on one
package per rank with the completion-only loss, fused by uniform averaging, task arithmetic and TIES,
against ddp on the union; every model scored on each package's test blocks, read back from eval.json,
summary.csv and the MLflow store."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from mlflow.tracking import MlflowClient

from tests.support.helpers import checkout_copy, planned_jobs, run_in, run_readme_examples, snakemake_failure
from tests.support.hf import require_transformers

pytestmark = pytest.mark.timeout(900)
PARTS = ("asyncio_docs", "logging_docs", "unittest_docs")
FUSED = ("domains_uniform", "domains_task_arithmetic", "domains_ties", "domains_ties_half")


@pytest.fixture(scope="module")
def example(tmp_path_factory) -> dict:
    require_transformers()
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    return {**run_readme_examples(checkout, "examples-domains"), "checkout": checkout}


def evaluation(checkout: Path, run: str) -> dict:
    return json.loads((checkout / "results" / "runs" / run / "eval.json").read_text())


def test_each_package_is_made_and_counted_on_its_completion_tokens_only(example):
    checkout = example["checkout"]
    infos = [
        json.loads((checkout / "results" / "datasets" / part / "dataset.json").read_text()) for part in PARTS
    ]
    for part, info in zip(PARTS, infos, strict=True):
        lines = (checkout / "data" / "instructions" / f"{part.split('_')[0]}.jsonl").read_text().splitlines()
        assert info["records"] == len(lines) > 100
        assert 0 < info["loss_tokens"] < info["num_tokens"]  # the prompts are context only
    union = json.loads((checkout / "results" / "datasets" / "stdlib_docs" / "dataset.json").read_text())
    assert union["loss_tokens"] == sum(info["loss_tokens"] for info in infos)


@pytest.mark.parametrize("run", FUSED)
def test_each_fine_tune_knows_its_own_package_best_and_the_fusion_is_scored_per_package(example, run):
    found = evaluation(example["checkout"], run)
    own = []
    for rank in range(3):
        scored = found["sets"][f"local_rank_{rank}"]
        losses = [model["loss"] for model in scored["ranks"]]
        assert min(losses) == losses[rank]  # fine-tuned on that package: the best there
        own.append(losses[rank])
        assert found[f"local_loss_merged_rank_{rank}"] == scored["merged"]["loss"]
    merged = [found[f"local_loss_merged_rank_{rank}"] for rank in range(3)]
    assert found["local_loss_merged_worst"] == max(merged)  # lower is better
    # lower is better: normalized is own / merged, 1.0 = as good as each fine-tune on its own package
    assert found["normalized_loss"] == pytest.approx(sum(o / m for o, m in zip(own, merged, strict=True)) / 3)
    assert 0.5 < found["normalized_loss"] < 1.0
    assert found["local_loss_merged_mean"] < found["base"]["loss"]  # fine-tuning helped every fusion


def test_summary_and_mlflow_carry_the_per_package_scores_and_ddp_leads(example):
    checkout, rows = example["checkout"], example["domains"]
    assert set(rows) == {*FUSED, "domains_ddp"}
    client = MlflowClient(f"sqlite:///{checkout}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse-domains")
    for run in FUSED:
        found = evaluation(checkout, run)
        assert float(rows[run]["normalized_loss"]) == pytest.approx(found["normalized_loss"])
        (parent,) = client.search_runs([experiment.experiment_id], f"tags.mlflow.runName = '{run}'")
        worst = found["local_loss_merged_worst"]
        assert parent.data.metrics["local_loss_merged_worst"] == pytest.approx(worst)
    ddp = evaluation(checkout, "domains_ddp")
    parts = [ddp[f"domain_loss_merged_{part}"] for part in PARTS]
    assert ddp["domain_loss_merged_worst"] == max(parts)
    assert float(rows["domains_ddp"]["domain_loss_merged_mean"]) == pytest.approx(sum(parts) / 3)
    (parent,) = client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 'domains_ddp'")
    assert parent.data.metrics["domain_loss_merged_asyncio_docs"] == pytest.approx(parts[0])
    # Training on the union (3x the batch) beats every one-shot fusion on every package's mean.
    assert ddp["domain_loss_merged_mean"] < min(float(rows[run]["local_loss_merged_mean"]) for run in FUSED)


def test_the_exported_folders_come_back_as_a_run_over_checkpoints_and_a_changed_file_re_merges_it(
    example,
):
    """What a user who already has fine-tuned folders does: the example's exported transformers folders,
    copied elsewhere, named as `checkpoints` of new runs (no training): each is scored as it was when
    trained, their task arithmetic too, and editing one folder's weights re-collects and re-merges only
    the runs that read it."""
    from safetensors.numpy import load_file, save_file

    checkout = example["checkout"]
    for run in ("domains_uniform", "domains_ties"):
        shutil.copytree(checkout / "results" / "runs" / run / "hf", checkout / "mine" / run)
    config = yaml.safe_load((checkout / "config" / "examples" / "domains.yaml").read_text())
    config["runs"] |= {  # the example's own runs stay (done), beside runs over their checkpoints
        "ties_rank_0": {"checkpoints": ["run:domains_ties/rank-0"], "merge_method": "uniform"},
        "folders_ta": {
            "checkpoints": ["mine/domains_uniform", "mine/domains_ties"],
            "merge_method": "task_arithmetic",
        },
        "ties_alone": {"checkpoints": ["mine/domains_ties"], "merge_method": "uniform"},
    }
    for run in ("folders_ta", "ties_alone"):
        config["runs"][run]["dataset"] = "asyncio_docs"
    (checkout / "folders.yaml").write_text(yaml.safe_dump(config))
    proc = run_in(checkout, ["snakemake", "--cores", "all", "--configfile", "folders.yaml"])
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    alone = evaluation(checkout, "ties_alone")
    trained = evaluation(checkout, "domains_ties")["sets"]["local_rank_0"]  # asyncio's test rows
    assert alone["merged"]["loss"] == pytest.approx(trained["merged"]["loss"], rel=1e-6)
    assert alone["ranks"][0]["loss"] == alone["merged"]["loss"]
    assert len(evaluation(checkout, "folders_ta")["ranks"]) == 2
    # run:NAME/rank-R: rank 0 of the ties run's training (the asyncio fine-tune), scored on the union.
    rank_0 = evaluation(checkout, "ties_rank_0")
    assert rank_0["merged"]["loss"] == pytest.approx(evaluation(checkout, "domains_ties")["ranks"][0]["loss"])
    dry = run_in(checkout, ["snakemake", "-n", "--configfile", "folders.yaml"])
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stderr[-2000:]
    weights = checkout / "mine" / "domains_uniform" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] + 1}, str(weights), metadata={"format": "pt"})
    dry = run_in(checkout, ["snakemake", "-n", "--configfile", "folders.yaml"])
    planned = planned_jobs(dry.stdout)
    assert planned.get("collect") == 1 and planned.get("merge") == 1 and "train" not in planned  # folders_ta
