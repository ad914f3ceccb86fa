"""Submission-side checks: the CPUs a train job asks for against the partition's largest node."""

from __future__ import annotations

import subprocess

from shardfuse.cluster.slurm import CpuRequest, cpus_per_node, oversized_cpu_requests, partition_cpus


def test_cpus_per_node_follows_the_plugin_rule():
    assert cpus_per_node(4, {}) == (4, "threads = nproc_per_node")
    assert cpus_per_node(4, {"cpus_per_task": 32}) == (32, "cpus_per_task")
    # A negative cpus_per_task sends no CPU flag; cpus_per_gpu on a GPU job is per GPU, not checked.
    assert cpus_per_node(4, {"cpus_per_task": -1}) is None
    assert cpus_per_node(8, {"gres": "gpu:8", "cpus_per_gpu": 4}) is None
    assert cpus_per_node(8, {"cpus_per_gpu": 4}) == (8, "threads = nproc_per_node")


def sinfo(stdout: str, returncode: int = 0):
    def run(cmd, **kwargs):
        assert cmd == ["sinfo", "-h", "-N", "-o", "%P %c"]
        return subprocess.CompletedProcess(cmd, returncode, stdout=stdout, stderr="")

    return run


def test_partition_cpus_takes_each_partitions_largest_node_and_the_default():
    out = "debug* 4\ngpu 64\ngpu 128\ndebug* 2\n"
    assert partition_cpus(sinfo(out)) == ({"debug": 4, "gpu": 128}, "debug")


def test_partition_cpus_gives_up_quietly_without_a_cluster():
    assert partition_cpus(sinfo("", returncode=1)) is None

    def missing(cmd, **kwargs):
        raise FileNotFoundError("sinfo")

    assert partition_cpus(missing) is None


def test_a_request_larger_than_every_node_is_one_line_naming_run_cpus_and_knob():
    requests = [
        CpuRequest("digits-w8-ddp-1", ("wide", "wide_ties"), 8, None, "threads = nproc_per_node"),
        CpuRequest("digits-w2-ddp-2", ("small",), 2, None, "threads = nproc_per_node"),
        CpuRequest("digits-w4-ddp-3", ("gpu_run",), 32, "gpu", "cpus_per_task"),
        CpuRequest("digits-w4-ddp-4", ("elsewhere",), 999, "not_listed", "cpus_per_task"),
    ]
    errors = oversized_cpu_requests(requests, {"debug": 4, "gpu": 16}, "debug")
    assert errors == [
        "run(s) wide, wide_ties (training digits-w8-ddp-1): the train job asks for 8 CPUs per node "
        "(threads = nproc_per_node) but the largest node of default partition 'debug' has 4; lower it "
        "in the SLURM profile (set-resources: train: cpus_per_task: 4) or pick a partition with larger "
        "nodes (slurm_partition)",
        "run(s) gpu_run (training digits-w4-ddp-3): the train job asks for 32 CPUs per node "
        "(cpus_per_task) but the largest node of partition 'gpu' has 16; lower it in the SLURM profile "
        "(set-resources: train: cpus_per_task: 16) or pick a partition with larger nodes (slurm_partition)",
    ]
    assert all("\n" not in error for error in errors)
