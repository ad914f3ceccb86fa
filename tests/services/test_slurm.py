"""The same DAG on a real SLURM cluster (scripts/slurm-up.sh): the default experiment as the README runs
it, the user's model, the profile's resources and the geometry checks before any sbatch.

Required in CI (the `slurm_cluster` fixture fails there when no cluster answers); skipped elsewhere.
The single jobs' failures, cancellation, a killed snakemake and the time limit are in
tests/services/test_slurm_jobs.py, which the other test worker runs meanwhile on the same cluster.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import (
    MEASUREMENTS,
    checkout_copy,
    run_in,
    snakemake_command,
    snakemake_failure,
    subprocess_env,
)
from tests.support.slurm import (
    FAST_STATUS,
    all_slurm_job_ids,
    cluster_profile,
    default_experiment,
    job_records,
    jobs_of,
    run_snakemake,
    scontrol_job,
    slurm_job_ids,
    tiny_experiment,
)

pytestmark = pytest.mark.slurm


@pytest.fixture(scope="module")
def slurm_and_local_runs(slurm_cluster, tmp_path_factory):
    """The default experiment exactly as the README runs it on a cluster — the profile linked into
    ~/.config/snakemake/slurm and a bare `snakemake --profile slurm` in the checkout, nothing else on
    the command line — and locally only the ddp run the bitwise comparison reads."""
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    home = tmp_path_factory.mktemp("home")
    (home / ".config" / "snakemake").mkdir(parents=True)
    (home / ".config" / "snakemake" / "slurm").symlink_to(checkout / "profiles" / "slurm")
    started = time.perf_counter()
    proc = subprocess.run(
        [str(Path(sys.executable).parent / "snakemake"), "--profile", "slurm"],
        cwd=checkout,
        capture_output=True,
        text=True,
        env={**subprocess_env(), "HOME": str(home)},
        timeout=1500,
    )
    slurm_seconds = time.perf_counter() - started
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    local_dir = default_experiment(tmp_path_factory.mktemp("local") / "work")
    local_proc, local_seconds = run_snakemake(
        local_dir, "--cores", "all", "results/runs/ddp/merged.safetensors", profile=False
    )
    assert local_proc.returncode == 0, snakemake_failure(local_dir, local_proc)
    timing = {"slurm_seconds": round(slurm_seconds, 1), "local_ddp_merge_seconds": round(local_seconds, 1)}
    MEASUREMENTS.append(f"default experiment, bare `snakemake --profile slurm`: {json.dumps(timing)}")
    return {"slurm": checkout, "local": local_dir, "slurm_log": proc.stderr}


def test_user_model_from_a_code_path_trains_inside_slurm_jobs(slurm_cluster, tmp_path):
    """The README's user-model example on the cluster: the factory is imported from its code path by
    the ranks inside the SLURM job, and the checkpoint records that file's digest."""
    checkout = checkout_copy(tmp_path / "checkout")
    (checkout / "one_epoch.yaml").write_text("run_defaults: {epochs: 1}\n")
    target = "results/runs/resmlp_soup/eval.json"
    # As the README runs an example: in the checkout, config files relative to it.
    configs = ["--configfile", "config/examples/user_model.yaml", "one_epoch.yaml"]
    proc = run_in(checkout, ["snakemake", "--profile", "profiles/slurm", *FAST_STATUS, target, *configs])
    assert proc.returncode == 0, snakemake_failure(checkout, proc)
    assert slurm_job_ids(checkout, "train"), "the training did not run as a SLURM job"
    evaluation = json.loads((checkout / target).read_text())
    gather = json.loads((checkout / "results/trainings" / evaluation["training"] / "gather.json").read_text())
    assert gather["model"]["model"] == "resmlp:build"
    assert list(gather["model"]["code"]["files"]) == ["config/examples/models/resmlp.py"]
    assert evaluation["merged"]["accuracy"] > 0.5


def test_default_experiment_submits_one_job_per_training_and_per_fusion_group(
    slurm_and_local_runs, slurm_cluster
):
    """Job groups (profiles/slurm `groups:`): one SLURM job prepares the dataset and writes both shard
    sets, one per training trains it, one per training gathers it and merges and evaluates every run
    that fuses it — 11 jobs for 18 runs, where one job per rule and wildcard would be 49."""
    workdir = slurm_and_local_runs["slurm"]
    records = job_records(slurm_cluster)
    num_runs = len((workdir / "results" / "summary.csv").read_text().splitlines()) - 1
    num_trainings = len(list((workdir / "results" / "trainings").glob("*/ranks")))
    assert num_runs == 18 and num_trainings == 5  # config/runs.tsv
    jobs = all_slurm_job_ids(workdir)
    MEASUREMENTS.append(
        f"default experiment on SLURM: {len(jobs)} SLURM jobs (one per rule and wildcard: 49)"
    )
    assert len(jobs) == 1 + 2 * num_trainings <= 13, jobs
    assert all(records.get(job_id) == "COMPLETED" for job_id in jobs), {j: records.get(j) for j in jobs}
    (data_job,) = slurm_job_ids(workdir, "partition")
    assert slurm_job_ids(workdir, "prepare_dataset") == [data_job]
    assert len(slurm_job_ids(workdir, "train")) == num_trainings
    fusion_jobs = slurm_job_ids(workdir, "gather")
    assert len(fusion_jobs) == num_trainings
    assert slurm_job_ids(workdir, "merge") == fusion_jobs == slurm_job_ids(workdir, "evaluate")
    # Each fusion job ran its training's gather, then merge and evaluate of each run that fuses it.
    for job_id in fusion_jobs:
        (log,) = (workdir / ".snakemake" / "slurm_logs").rglob(f"{job_id}.log")
        text = log.read_text()
        (training,) = set(re.findall(r"wildcards: training=(\S+)", text))
        runs = set(re.findall(r"wildcards: run=(\S+)", text))
        expected = {
            path.parent.name
            for path in (workdir / "results" / "runs").glob("*/eval.json")
            if json.loads(path.read_text())["training"] == training
        }
        assert runs == expected and runs, (job_id, training)
    # track, summary and the plots are local rules: they never went to the cluster.
    assert slurm_job_ids(workdir, "track") == [] and slurm_job_ids(workdir, "summary") == []

    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    experiment = client.get_experiment_by_name("shardfuse")
    runs = client.search_runs([experiment.experiment_id])
    parents = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    assert len(parents) == num_runs
    world_sizes = sum(int(r.data.params["world_size"]) for r in parents)
    assert len(runs) == num_runs + world_sizes


def test_ddp_merged_model_under_slurm_is_bitwise_identical_to_local(slurm_and_local_runs):
    slurm, _ = load_weights(slurm_and_local_runs["slurm"] / "results/runs/ddp/merged.safetensors")
    local, _ = load_weights(slurm_and_local_runs["local"] / "results/runs/ddp/merged.safetensors")
    assert slurm.keys() == local.keys()
    assert all(torch.equal(slurm[name], local[name]) for name in slurm)


def test_jobs_say_their_rule_and_wildcards_in_squeue(slurm_and_local_runs):
    """The README's squeue command: every job carries the profile's name prefix and, in its comment,
    its rule and wildcards (the plugin keeps the job name for its own status checks)."""
    workdir = slurm_and_local_runs["slurm"]
    train_ids = slurm_job_ids(workdir, "train")
    listing = subprocess.run(
        ["squeue", "--states=all", "-h", "-j", ",".join(train_ids), "-O", "JobID:10,Name:60,Comment:120"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split("\n")
    rows = [line.split() for line in listing if line.strip()]
    trainings = {path.name for path in (workdir / "results" / "trainings").iterdir()}
    assert sorted(row[0] for row in rows) == sorted(train_ids)
    assert all(row[1].startswith("shardfuse_") for row in rows)
    assert {row[2].removeprefix("rule_train_wildcards_") for row in rows} == trainings


def test_partition_account_and_gpus_from_the_cluster_profile_reach_sbatch(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work")
    profile = cluster_profile(
        tmp_path / "profile",
        **{
            "default-resources": {
                "slurm_partition": "debug",
                "slurm_account": "shardfuse_test",
                "mem_mb": 1500,
                "runtime": 20,
            },
            "set-resources": {"train": {"slurm_partition": "gpu", "gres": "gpu:2"}},
        },
    )
    proc = subprocess.run(
        snakemake_command(workdir, "--profile", profile, *FAST_STATUS, "--until", "train"),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=600,
    )
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    (partition_job,) = slurm_job_ids(workdir, "partition")
    (train_job,) = slurm_job_ids(workdir, "train")
    partition, train = scontrol_job(partition_job), scontrol_job(train_job)
    assert (partition["Partition"], partition["Account"]) == ("debug", "shardfuse_test")
    # prepare and partition share a job (profiles/slurm `groups:`): the memory of either, both runtimes.
    assert (partition["MinMemoryNode"], partition["TimeLimit"]) == ("1500M", "00:40:00")
    # The second partition and per-node GPUs for train only; the rule's own memory and time stay.
    assert (train["Partition"], train["Account"]) == ("gpu", "shardfuse_test")
    assert train["TresPerNode"] == "gres:gpu:2"
    assert (train["MinMemoryNode"], train["TimeLimit"]) == ("4000M", "02:00:00")


def test_set_resources_on_the_command_line_keeps_the_rules_memory_and_runtime(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work")
    proc, _ = run_snakemake(workdir, "--until", "train", "--set-resources", "train:gres=gpu:1")
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    (train_job,) = slurm_job_ids(workdir, "train")
    (partition_job,) = slurm_job_ids(workdir, "partition")
    train = scontrol_job(train_job)
    assert train["TresPerNode"] == "gres:gpu:1"
    assert (train["MinMemoryNode"], train["TimeLimit"]) == ("4000M", "02:00:00")
    assert train["NumCPUs"] == "2"  # one CPU per rank
    partition = scontrol_job(partition_job)
    assert (partition["MinMemoryNode"], partition["TimeLimit"]) == ("2000M", "01:00:00")


@pytest.mark.parametrize(
    ("run", "message"),
    [
        (
            {"nodes": 2, "nproc_per_node": 2},
            "nodes x nproc_per_node = 2 x 2 = 4 but world_size (the number of shards) is 2",
        ),
        ({"nodes": 2, "world_size": 3}, "world_size 3 (the number of shards) cannot be split evenly over 2"),
        # 8 ranks on one node of a cluster whose nodes have 4 CPUs: stopped before the first sbatch.
        (
            {"world_size": 8},
            "the train job asks for 8 CPUs per node (threads = nproc_per_node) but the largest node of "
            "default partition 'debug' has 4; lower it in the SLURM profile (set-resources: train: "
            "cpus_per_task: 4) or pick a partition with larger nodes (slurm_partition)",
        ),
    ],
)
def test_geometry_errors_fail_before_any_sbatch(slurm_cluster, tmp_path, run, message):
    workdir = tiny_experiment(tmp_path / "work", **run)
    proc, _ = run_snakemake(workdir)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (workdir / ".snakemake" / "slurm_logs").exists()
    assert not (workdir / "results").exists()
    # The cluster saw no job from this working directory: none queued or running, none ended (the other
    # SLURM test module submits its own jobs meanwhile).
    assert jobs_of(workdir, slurm_cluster) == set()
