"""Launch geometry: the exact commands and SLURM job resources for local, one node and many nodes."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest

from shardfuse.cluster import torchrun
from shardfuse.cluster.torchrun import (
    Geometry,
    job_resources,
    launch_command,
    node_step_command,
    rendezvous_port,
)
from shardfuse.io import UserError
from shardfuse.launch import attempt_log

TRAIN = ["--run-name", "t", "--out-dir", "results/trainings/t/.ranks.partial"]


def test_local_run_is_standalone_torchrun():
    cmd = launch_command(Geometry(1, 2), TRAIN, environ={}, python="py")
    assert cmd == [
        "py",
        "-m",
        "shardfuse.agent",
        "--standalone",
        "--nnodes=1",
        "--nproc-per-node=2",
        "-m",
        "shardfuse.train",
        *TRAIN,
    ]


def test_one_slurm_node_runs_standalone_torchrun_inside_the_job():
    cmd = launch_command(Geometry(1, 8), TRAIN, environ={"SLURM_JOB_ID": "77"}, python="py")
    assert cmd[:4] == ["py", "-m", "shardfuse.agent", "--standalone"]
    assert "--nproc-per-node=8" in cmd and not any(arg.startswith("--rdzv") for arg in cmd)


def test_four_nodes_of_eight_gpus_start_one_srun_task_per_node():
    cmd = launch_command(Geometry(4, 8), TRAIN, environ={"SLURM_JOB_ID": "77"}, python="py")
    assert cmd == [
        "srun",
        "--nodes=4",
        "--ntasks=4",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        "py",
        "-m",
        "shardfuse.launch",
        "--node-step",
        "--nodes=4",
        "--nproc-per-node=8",
        "--",
        *TRAIN,
    ]


def test_each_node_step_runs_torchrun_with_its_node_rank_and_the_first_host_rendezvous(monkeypatch):
    expanded = []
    monkeypatch.setattr(torchrun, "first_host", lambda nodelist: expanded.append(nodelist) or "gpu001")
    environ = {
        "SLURM_JOB_ID": "4242",
        "SLURM_NNODES": "4",
        "SLURM_NODEID": "2",
        "SLURM_STEP_NODELIST": "gpu[001-004]",
    }
    cmd = node_step_command(Geometry(4, 8), TRAIN, environ, python="py")
    assert cmd == [
        "py",
        "-m",
        "shardfuse.agent",
        "--nnodes=4",
        "--node-rank=2",
        "--nproc-per-node=8",
        "--rdzv-backend=c10d",
        "--rdzv-endpoint=gpu001:24242",
        "--rdzv-id=4242",
        "-m",
        "shardfuse.train",
        *TRAIN,
    ]
    assert expanded == ["gpu[001-004]"]


def test_node_step_refuses_a_step_of_the_wrong_size(monkeypatch):
    monkeypatch.setattr(torchrun, "first_host", lambda nodelist: "n1")
    environ = {"SLURM_JOB_ID": "1", "SLURM_NNODES": "2", "SLURM_NODEID": "0", "SLURM_JOB_NODELIST": "n[1-2]"}
    with pytest.raises(UserError, match="spans 2 nodes but the run needs 4"):
        node_step_command(Geometry(4, 8), TRAIN, environ)


def test_node_step_outside_srun_says_so():
    with pytest.raises(UserError, match="runs inside an srun step; SLURM_NODEID, SLURM_NNODES"):
        node_step_command(Geometry(2, 1), TRAIN, {"SLURM_JOB_ID": "1"})


def test_several_nodes_without_a_slurm_allocation_is_a_clear_error():
    with pytest.raises(UserError, match=r"nodes=4 needs a SLURM allocation of 4 nodes; run with --profile"):
        launch_command(Geometry(4, 8), TRAIN, environ={})


def test_rendezvous_port_follows_the_job_and_can_be_overridden():
    assert rendezvous_port("123", {}) == 20123
    assert rendezvous_port("40001", {}) == 20001
    assert rendezvous_port("123", {"SHARDFUSE_RDZV_PORT": "31000"}) == 31000


def test_job_resources_one_task_per_node():
    plain = {"tasks_per_gpu": 0, "slurm_extra": ""}
    assert job_resources(Geometry(1, 2)) == {"nodes": 1, "tasks": 1, "mpi": "", **plain}
    assert job_resources(Geometry(4, 8)) == {"nodes": 4, "tasks": 4, "mpi": "srun", **plain}
    assert job_resources(Geometry(4, 8), min_ranks=32) == {"nodes": 4, "tasks": 4, "mpi": "srun", **plain}
    # Several nodes that may lose one: SLURM takes a dead node out of the job instead of ending it.
    assert job_resources(Geometry(4, 8), min_ranks=24)["slurm_extra"] == "--no-kill"
    assert job_resources(Geometry(1, 8), min_ranks=4)["slurm_extra"] == ""


class _Resources(dict):
    __getattr__ = dict.__getitem__


def sbatch_line(geometry: Geometry, threads: int, min_ranks: int | None = None, **profile_resources) -> str:
    """The sbatch command snakemake-executor-plugin-slurm builds for our train job's resources."""
    from snakemake_executor_plugin_slurm.submit_string import get_submit_command
    from snakemake_executor_plugin_slurm.utils import set_gres_string

    resources = _Resources(
        {**job_resources(geometry, min_ranks), "mem_mb": 4000, "runtime": 120, **profile_resources}
    )
    job = SimpleNamespace(resources=resources, threads=threads)
    params = {
        "run_uuid": "u",
        "slurm_logfile": "log",
        "comment_str": "rule_train",
        "account": "",
        "partition": "",
        "workdir": "/w",
    }
    return get_submit_command(job, params) + set_gres_string(job)


def test_sbatch_for_four_nodes_of_eight_gpus_asks_gres_per_node_and_one_task_per_node():
    line = sbatch_line(Geometry(4, 8), threads=8, gres="gpu:8")
    assert "--nodes=4" in line and "--ntasks=4" in line and "--gres=gpu:8" in line
    assert "--ntasks-per-gpu" not in line and "--gpus=" not in line
    assert "--cpus-per-task=8" in line


def test_sbatch_of_a_training_that_may_lose_a_node_asks_slurm_not_to_kill_the_job():
    assert " --no-kill" in sbatch_line(Geometry(2, 1), threads=1, min_ranks=1)
    assert "--no-kill" not in sbatch_line(Geometry(2, 1), threads=1)


def test_sbatch_for_one_node_is_a_single_task_job():
    line = sbatch_line(Geometry(1, 2), threads=2)
    assert "--nodes=1" in line and "--ntasks=1" in line and "--cpus-per-task=2" in line


def test_each_rank_gets_its_share_of_the_job_threads():
    from shardfuse.cluster.torchrun import rank_environ

    assert rank_environ(Geometry(1, 4), {"OMP_NUM_THREADS": "8"})["OMP_NUM_THREADS"] == "2"
    assert rank_environ(Geometry(1, 4), {"OMP_NUM_THREADS": "2"})["OMP_NUM_THREADS"] == "1"
    assert "OMP_NUM_THREADS" not in rank_environ(Geometry(1, 4), {})


def test_each_attempt_writes_its_own_log_and_the_declared_log_names_the_latest(tmp_path):
    log = tmp_path / "logs" / "train" / "t.log"
    assert attempt_log(log) == (log.with_name("t.attempt-1.log"), 1)
    log.write_text("attempt 1: killed")
    log.unlink()  # what Snakemake does to a job's declared log before it runs the job again
    assert attempt_log(log) == (log.with_name("t.attempt-2.log"), 2)
    log.write_text("attempt 2: finished")
    assert log.with_name("t.attempt-1.log").read_text() == "attempt 1: killed"
    assert log.with_name("t.attempt-2.log").read_text() == "attempt 2: finished"


def test_a_cut_launch_json_in_the_staging_folder_starts_afresh_instead_of_a_traceback(tmp_path):
    import json

    from shardfuse.launch import prepare_staging

    staging = tmp_path / ".ranks.partial"
    (staging / "checkpoints" / "step-4").mkdir(parents=True)
    (staging / "launch.json").write_text('{"train_args": ["--run-na')  # cut short
    assert prepare_staging(staging, ["--run-name", "t"]) is False  # nothing to resume from
    assert json.loads((staging / "launch.json").read_text()) == {"train_args": ["--run-name", "t"]}
    assert not (staging / "checkpoints").exists()


def test_init_from_weights_changed_since_the_dag_was_built_are_refused_before_any_rank(tmp_path):
    from safetensors.numpy import save_file

    from shardfuse.data.provenance import init_files_digest
    from shardfuse.launch import check_init_digest, without_init_digest

    weights = tmp_path / "init.safetensors"
    save_file({"w": np.zeros(3, dtype=np.float32)}, str(weights))
    planned = init_files_digest(weights)
    args, digest = without_init_digest(
        ["--run-name", "t", "--init-from", str(weights), "--init-sha256", planned]
    )
    assert args == ["--run-name", "t", "--init-from", str(weights)] and digest == planned
    check_init_digest(args, digest)  # unchanged: nothing to say
    save_file({"w": np.ones(3, dtype=np.float32)}, str(weights))
    with pytest.raises(
        UserError, match=r"changed since the workflow planned this training .*run snakemake again"
    ):
        check_init_digest(args, digest)
