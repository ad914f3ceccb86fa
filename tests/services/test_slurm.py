"""The same DAG on a real SLURM cluster (scripts/slurm-up.sh): jobs, failures, cancellation, geometry.

Required in CI (the `slurm_cluster` fixture fails there when no cluster answers); skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import (
    MEASUREMENTS,
    REPO,
    SLURM_FAST_STATUS,
    checkout_copy,
    run_in,
    snakemake_command,
    snakemake_failure,
    subprocess_env,
)

pytestmark = pytest.mark.slurm

FAST_STATUS = SLURM_FAST_STATUS


def snakemake_cmd(workdir: Path, *args: str, profile: bool = True) -> list[str]:
    if profile:
        return snakemake_command(workdir, "--profile", REPO / "profiles" / "slurm", *FAST_STATUS, *args)
    return snakemake_command(workdir, *args)


def run_snakemake(workdir: Path, *args: str, profile: bool = True, timeout: float = 600):
    started = time.perf_counter()
    proc = subprocess.run(
        snakemake_cmd(workdir, *args, profile=profile),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=timeout,
    )
    return proc, time.perf_counter() - started


def default_experiment(path: Path) -> Path:
    """A working directory holding the repository's default experiment config."""
    path.mkdir(parents=True, exist_ok=True)
    shutil.copytree(REPO / "config", path / "config")
    return path


def tiny_experiment(path: Path, **run) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "runs": {"tiny": {"strategy": "ddp", "merge_method": "consolidate", **run}},
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "hidden_sizes": [16], "epochs": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db"},
    }
    (path / "config").mkdir()
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def job_records(state_dir: Path) -> dict[str, str]:
    """JobId -> JobState from the cluster's job-completion log."""
    log = state_dir / "jobcomp.log"
    text = log.read_text() if log.exists() else ""
    return dict(re.findall(r"JobId=(\d+) .*?JobState=(\S+)", text))


def slurm_job_dirs(workdir: Path, rule: str) -> list[Path]:
    """The plugin's log folders of the jobs that ran ``rule``: its own (rule_RULE) and the group jobs
    it was part of (group_GROUP_RULE1_RULE2..., the rules in lexical order)."""
    logs = workdir / ".snakemake" / "slurm_logs"
    groups = [path for path in logs.glob("group_*") if f"_{rule}_" in f"{path.name}_"]
    return [logs / f"rule_{rule}", *groups]


def slurm_job_ids(workdir: Path, rule: str) -> list[str]:
    return sorted(log.stem for folder in slurm_job_dirs(workdir, rule) for log in folder.rglob("*.log"))


def all_slurm_job_ids(workdir: Path) -> list[str]:
    return sorted(log.stem for log in (workdir / ".snakemake" / "slurm_logs").rglob("*.log"))


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


def cluster_profile(path: Path, **keys) -> Path:
    """profiles/slurm with some top-level keys replaced, as a user edits it."""
    profile = yaml.safe_load((REPO / "profiles" / "slurm" / "config.yaml").read_text())
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(yaml.safe_dump({**profile, **keys}))
    return path


def scontrol_job(job_id: str) -> dict[str, str]:
    out = subprocess.run(
        ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True
    ).stdout
    return dict(item.split("=", 1) for item in out.split() if "=" in item)


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


def corrupt_keeping_mtime(path: Path) -> None:
    """Flip bytes in the middle of ``path`` without changing its size or times (Snakemake sees nothing)."""
    stat = path.stat()
    data = bytearray(path.read_bytes())
    middle = len(data) // 2
    data[middle : middle + 8] = bytes(b ^ 0xFF for b in data[middle : middle + 8])
    path.write_bytes(bytes(data))
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))


def test_failed_train_job_reports_rule_job_id_and_log_paths(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work")
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    corrupt_keeping_mtime(workdir / "results/shards/digits/w2-seed0/shard-1.parquet")

    proc, _ = run_snakemake(workdir, "--until", "train")
    assert proc.returncode != 0
    (job_id,) = slurm_job_ids(workdir, "train")
    (training,) = [p.name for p in (workdir / ".snakemake" / "slurm_logs" / "rule_train").iterdir()]
    assert "Error in rule train" in proc.stderr
    assert f"SLURM-job '{job_id}' failed" in proc.stderr
    assert f"logs/train/{training}.log" in proc.stderr
    assert f".snakemake/slurm_logs/rule_train/{training}/{job_id}.log" in proc.stderr
    assert job_records(slurm_cluster)[job_id] == "FAILED"
    assert "shard of rank 1" in (workdir / f"logs/train/{training}.log").read_text()
    assert not (workdir / f"results/trainings/{training}/ranks").exists()


def test_cancelled_train_job_is_reported_as_cancelled_and_the_rerun_resumes(slurm_cluster, tmp_path):
    workdir = tiny_experiment(tmp_path / "work", epochs=80, checkpoint_every=40)
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    with subprocess.Popen(
        snakemake_cmd(workdir, "--until", "train"),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=subprocess_env(),
    ) as snakemake:
        job_id = wait_for_running_job(workdir, "train", timeout=120)
        wait_for(
            lambda: list(workdir.glob("results/trainings/*/.ranks.partial/checkpoints/step-*/COMPLETE")),
            "a complete checkpoint",
            timeout=180,
        )
        subprocess.run(["scancel", job_id], check=True)
        output, _ = snakemake.communicate(timeout=180)
    assert snakemake.returncode != 0
    assert f"SLURM-job '{job_id}' failed, SLURM status is: 'CANCELLED'" in output
    assert not list(workdir.glob("results/trainings/*/ranks"))

    (cancelled,) = (workdir / "logs" / "train").glob("*.attempt-1.log")
    cancelled_text = cancelled.read_text()
    assert "launch: " in cancelled_text  # the command it ran, and the ranks' output up to the kill

    rerun, _ = run_snakemake(workdir, "--until", "train")
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    # Snakemake deleted the declared log before the re-run; the cancelled attempt's log is kept.
    assert cancelled.read_text() == cancelled_text
    log = cancelled.with_name(cancelled.name.replace(".attempt-1.log", ".log"))
    log_text = log.read_text()
    assert "resuming from checkpoint step" in log_text
    assert f"attempt 2; earlier attempts' logs: {cancelled.name}" in log_text
    assert list(workdir.glob("results/trainings/*/ranks/train.json"))


def wait_for(condition, what: str, timeout: float):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout} s")


def wait_for_running_job(workdir: Path, rule: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for job_id in slurm_job_ids(workdir, rule):
            state = subprocess.run(
                ["squeue", "-h", "-j", job_id, "-o", "%T"], capture_output=True, text=True
            ).stdout.strip()
            if state == "RUNNING":
                return job_id
        time.sleep(1)
    raise AssertionError(f"no {rule} job reached RUNNING within {timeout} s")


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
    jobs_before = set(job_records(slurm_cluster))
    queued_before = subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout
    proc, _ = run_snakemake(workdir)
    assert proc.returncode != 0
    assert message in proc.stderr
    assert not (workdir / ".snakemake" / "slurm_logs").exists()
    assert not (workdir / "results").exists()
    assert set(job_records(slurm_cluster)) == jobs_before
    assert (
        subprocess.run(["squeue", "-h", "-o", "%i"], capture_output=True, text=True).stdout == queued_before
    )


def test_kill_9_of_snakemake_with_the_job_running_then_an_immediate_rerun_takes_over_its_result(
    slurm_cluster, tmp_path
):
    # The race of issue 18 on SLURM: the train job outlives the killed snakemake by design; the rerun's
    # job must neither train beside it on the same checkpoints nor throw its result away.
    workdir = tiny_experiment(tmp_path / "work", epochs=500, checkpoint_every=40)
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "partition", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    with subprocess.Popen(
        snakemake_cmd(workdir, "--until", "train"),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=subprocess_env(),
    ) as snakemake:
        first_job = wait_for_running_job(workdir, "train", timeout=120)
        wait_for(
            lambda: list(workdir.glob("results/trainings/*/.ranks.partial/checkpoints/step-*/COMPLETE")),
            "a complete checkpoint",
            timeout=180,
        )
        os.kill(snakemake.pid, signal.SIGKILL)  # snakemake only: the job runs on
        snakemake.wait(timeout=60)
    still_running = subprocess.run(
        ["squeue", "-h", "-j", first_job, "-o", "%T"], capture_output=True, text=True
    )
    assert still_running.stdout.strip() == "RUNNING"
    subprocess.run(snakemake_cmd(workdir, "--unlock"), check=True, capture_output=True, env=subprocess_env())
    rerun = subprocess.run(
        snakemake_cmd(workdir, "--until", "train"),
        capture_output=True,
        text=True,
        env={**subprocess_env(), "SHARDFUSE_OWNER_WAIT": "600"},
        timeout=900,
    )
    assert rerun.returncode == 0, snakemake_failure(workdir, rerun)
    (log,) = [p for p in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in p.name]
    text = log.read_text()
    assert "waiting up to 600 s for the current owner of" in text and f"SLURM job {first_job}" in text
    assert "was published by its previous owner; nothing to train" in text
    assert job_records(slurm_cluster).get(first_job) == "COMPLETED"
    (ranks,) = workdir.glob("results/trainings/*/ranks")
    info = json.loads((ranks / "train.json").read_text())
    assert info["slurm_job_id"] == first_job and info["num_steps"] == 500 * info["steps_per_epoch"]


def readme_group_example() -> tuple[str, str]:
    """(runs table, sbatch line) of the README's `<!-- sbatch group example: fuse -->` section."""
    text = (REPO / "README.md").read_text()
    body = text.split("<!-- sbatch group example: fuse -->", 1)[1]
    blocks = [code.strip() for code in re.findall(r"```\n(.*?)```", body, flags=re.DOTALL)[:2]]
    table, line = blocks
    assert table.startswith("run\t") and line.startswith("sbatch "), blocks
    return table, line


def test_readme_group_sbatch_line_is_what_the_plugin_submits(slurm_cluster, tmp_path):
    """The README's fuse job: a training fused two ways, trained locally, then gathered, merged and
    evaluated on the cluster in one SLURM job whose sbatch call (the plugin's --verbose log) is the
    README's line."""
    table, expected = readme_group_example()
    workdir = tmp_path / "work"
    (workdir / "config").mkdir(parents=True)
    (workdir / "config" / "runs.tsv").write_text(table + "\n")
    config = {
        "runs": "config/runs.tsv",
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "hidden_sizes": [16], "epochs": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{workdir}/mlflow.db"},
    }
    (workdir / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    proc, _ = run_snakemake(workdir, "--cores", "2", "--until", "train", profile=False)
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    proc, _ = run_snakemake(workdir, "--verbose", "--until", "evaluate")
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    calls = re.findall(r"^sbatch call: (sbatch .*)$", proc.stderr + proc.stdout, flags=re.MULTILINE)
    assert len(calls) == 1, calls  # gather, both merges and both evaluations: one job
    call = calls[0].split(" --wrap=")[0]
    call = re.sub(r"shardfuse_[0-9a-f-]{36}", "shardfuse_<uuid>", call).replace(str(workdir), "<workdir>")
    partition = subprocess.run(
        ["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, check=True
    ).stdout.split()
    default = next(name.rstrip("*") for name in partition if name.endswith("*"))
    assert " ".join(call.split()) == expected.replace("<partition>", default)
    assert sorted(p.parent.name for p in workdir.glob("results/runs/*/eval.json")) == ["ties", "uniform"]


LONG_TRAINING = {"strategy": "ddp", "merge_method": "consolidate", "hidden_sizes": [512, 512], "epochs": 400}
STOP_BEFORE_LIMIT = 46  # of a 60 s limit: each attempt trains for about 10 s after its start-up


def release_requeued_jobs(pending_since: dict[str, float], settle: float = 5.0) -> None:
    """A requeued job waits about two minutes before it may start again (SLURM's BeginTime); on the test
    cluster let it start after ``settle`` seconds instead. Not at once: slurmd is still cleaning up the
    job's last attempt, and an attempt started then fails with "Job credential revoked"."""
    listing = subprocess.run(
        ["squeue", "-h", "-t", "PD", "-o", "%i %r"], capture_output=True, text=True, check=False
    ).stdout
    for job_id, reason in (line.split(maxsplit=1) for line in listing.splitlines() if line.strip()):
        if reason.strip() != "BeginTime":
            pending_since.pop(job_id, None)
            continue
        since = pending_since.setdefault(job_id, time.monotonic())
        if time.monotonic() - since >= settle:
            subprocess.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
            pending_since.pop(job_id, None)


def test_a_training_longer_than_its_time_limit_is_requeued_and_loses_no_step(slurm_cluster, tmp_path):
    """runtime: 1 (minute) for a training of 25-50 s, the ranks stopping 46 s before the limit: each
    attempt trains about 10 s, stops at a step with its checkpoint and requeues its job;
    the next attempt resumes from that very step; the result equals an uninterrupted local run bitwise."""
    reference = tiny_experiment(tmp_path / "local", **LONG_TRAINING, checkpoint_every=0)
    proc, _ = run_snakemake(reference, "--cores", "2", "--until", "train", profile=False)
    assert proc.returncode == 0, snakemake_failure(reference, proc)

    workdir = tiny_experiment(tmp_path / "work", **LONG_TRAINING, checkpoint_every=0)
    profile = cluster_profile(tmp_path / "profile", **{"set-resources": {"train": {"runtime": 1}}})
    command = snakemake_command(workdir, "--profile", profile, *FAST_STATUS, "--until", "train")
    env = {**subprocess_env(), "SHARDFUSE_STOP_BEFORE_LIMIT": str(STOP_BEFORE_LIMIT)}
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env
    ) as run:
        deadline, pending_since = time.monotonic() + 900, {}
        while run.poll() is None and time.monotonic() < deadline:
            release_requeued_jobs(pending_since)
            time.sleep(1)
        run.kill()
        console, _ = run.communicate()
    assert run.returncode == 0, console[-4000:]
    (job_id,) = slurm_job_ids(workdir, "train")  # one job, requeued: Snakemake saw no failure
    (training,) = [p.name for p in (workdir / "results" / "trainings").iterdir()]
    attempts = sorted(  # by number: attempt-10 comes after attempt-9
        (workdir / "logs" / "train").glob(f"{training}.attempt-*.log"),
        key=lambda path: int(path.name.rsplit("-", 1)[1].split(".")[0]),
    )
    assert len(attempts) >= 3, [a.name for a in attempts]
    stops = []
    for attempt in attempts[:-1]:
        text = attempt.read_text()
        (step,) = re.findall(r"\] stopped after step (\d+) \(the SLURM job.s time limit is \d+ s away", text)
        assert f"launch: requeueing SLURM job {job_id}: it resumes from step {step}" in text
        stops.append(step)
    for attempt, step in zip(attempts[1:], stops, strict=True):
        assert f"resuming from checkpoint step {step} " in attempt.read_text(), attempt.name
    MEASUREMENTS.append(
        f"time-limit requeue: {len(attempts)} attempts of one SLURM job, stopped at steps {stops}"
    )
    ours = workdir / "results" / "trainings" / training / "ranks"
    theirs = reference / "results" / "trainings" / training / "ranks"
    for rank in (0, 1):
        mine, _ = load_weights(ours / f"rank-{rank}.safetensors")
        local, _ = load_weights(theirs / f"rank-{rank}.safetensors")
        assert mine.keys() == local.keys() and all(torch.equal(mine[k], local[k]) for k in mine), rank
