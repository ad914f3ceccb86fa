"""The README's one-domain-per-rank example exactly as it shows it: a local "pretrained" GPT-2, instruction
pairs made from three standard-library packages (one JSON Lines file each), the GPT-2 fine-tuned on one
package per rank with the completion-only loss, fused by uniform averaging, task arithmetic and TIES,
against ddp on the union; every model scored on each package's test blocks, read back from eval.json,
summary.csv and the MLflow store."""

from __future__ import annotations

import json
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


def test_the_mergekit_example_merges_its_yamls_scores_each_input_and_re_merges_only_what_changed(example):
    """The README's mergekit example, in the domains example's checkout (its pretrained folder): three
    fine-tunes made by make-pretrained.py --from, two mergekit YAMLs as runs over them and one folder
    evaluated alone (merge_method: none). Each fine-tune is best on its own package; the run's merge is
    the by-hand --mergekit merge bit for bit; MLflow holds the YAML; run:NAME/rank-R names one input of a
    collection; editing one folder re-collects and re-merges only the runs that read it, editing one YAML
    re-merges only its run."""
    from safetensors.numpy import load_file, save_file

    checkout = example["checkout"]
    rows = run_readme_examples(checkout, "examples-mergekit")["mergekit"]
    assert set(rows) == {"yaml_ties", "yaml_task_arithmetic", "json_alone"}
    alone, ties = evaluation(checkout, "json_alone"), evaluation(checkout, "yaml_ties")
    assert alone["merged"]["loss"] == alone["ranks"][0]["loss"]  # none: the folder as it is
    assert alone["merged"]["loss"] == pytest.approx(ties["ranks"][0]["loss"], rel=1e-9)  # the same folder
    for rank, part in enumerate(("json_src", "email_src", "http_src")):
        losses = [entry["loss"] for entry in ties["sets"][f"domain_{part}"]["ranks"]]
        assert losses.index(min(losses)) == rank  # each fine-tune knows its own package best
    by_hand = checkout / "by-hand"
    proc = run_in(
        checkout, ["shardfuse.merge", "--mergekit", "config/examples/mergekit/ties.yml", "--out", by_hand]
    )
    assert proc.returncode == 0, proc.stderr
    exported = load_file(str(checkout / "results" / "runs" / "yaml_ties" / "hf" / "model.safetensors"))
    mine = load_file(str(by_hand / "model.safetensors"))
    assert set(exported) <= set(mine) and all((mine[k] == exported[k]).all() for k in exported)
    client = MlflowClient(f"sqlite:///{checkout}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse-mergekit")
    (parent,) = client.search_runs([experiment.experiment_id], "tags.mlflow.runName = 'yaml_ties'")
    assert parent.data.params["mergekit.parameters.lambda"] == "[0.8, 1.2]"
    assert [a.path for a in client.list_artifacts(parent.info.run_id, "mergekit")] == ["mergekit/ties.yml"]

    config = yaml.safe_load((checkout / "config" / "examples" / "mergekit.yaml").read_text())
    config["runs"]["email_of_ties"] = {"checkpoints": ["run:yaml_ties/rank-1"], "merge_method": "none"}
    (checkout / "folders.yaml").write_text(yaml.safe_dump(config))
    proc = run_in(checkout, ["snakemake", "--cores", "all", "--configfile", "folders.yaml"])
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    email = evaluation(checkout, "email_of_ties")  # rank 1 of the collection: the email fine-tune
    assert email["merged"]["loss"] == pytest.approx(ties["ranks"][1]["loss"], rel=1e-9)
    dry = run_in(checkout, ["snakemake", "-n", "--configfile", "folders.yaml"])
    assert dry.returncode == 0 and "Nothing to be done" in dry.stdout + dry.stderr, dry.stderr[-2000:]
    weights = checkout / "pretrained" / "ft-http" / "model.safetensors"
    tensors = load_file(str(weights))
    name = next(iter(tensors))
    save_file({**tensors, name: tensors[name] + 1}, str(weights), metadata={"format": "pt"})
    planned = planned_jobs(run_in(checkout, ["snakemake", "-n", "--configfile", "folders.yaml"]).stdout)
    # the YAML runs' one collection of the three folders, and email_of_ties's of its rank 1 after it;
    # json_alone reads no http: 3 of the 4 runs merge again
    assert planned.get("collect") == 2 and planned.get("merge") == 3 and "prepare" not in planned, planned
    text = (checkout / "config" / "examples" / "mergekit" / "task_arithmetic.yml").read_text()
    (checkout / "config" / "examples" / "mergekit" / "task_arithmetic.yml").write_text(
        text.replace("0.6]", "0.7]")
    )
    save_file(tensors, str(weights), metadata={"format": "pt"})  # the folder as it was (its digest too)
    planned = planned_jobs(run_in(checkout, ["snakemake", "-n", "--configfile", "folders.yaml"]).stdout)
    assert planned.get("merge") == 1 and "collect" not in planned, planned
