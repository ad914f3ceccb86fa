"""What the SLURM cluster can grant, checked on the submit host before any train job is submitted.

A train job asks for ``--cpus-per-task`` = its threads (``nproc_per_node``, one CPU per rank) unless
the profile sets ``cpus_per_task``. A request larger than every node of its partition is rejected by
``sbatch`` only once Snakemake reaches it, after the jobs before it ran, with a message that names
neither the run nor the knob; the workflow's ``onstart`` asks this module first and stops with one line.

Library module (no stage): ``common.smk`` calls :func:`oversized_cpu_requests` with the train jobs of
the DAG and what :func:`partition_cpus` reads from ``sinfo``.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable, Mapping
from typing import NamedTuple


class CpuRequest(NamedTuple):
    """One train job's CPU request per node, as the SLURM executor plugin will send it."""

    training: str
    runs: tuple[str, ...]
    cpus_per_node: int
    partition: str | None  # None: the cluster's default partition
    source: str  # how the number came about, for the message


def cpus_per_node(threads: int, resources: Mapping[str, object]) -> tuple[int, str] | None:
    """The CPUs per node the plugin asks for (one task per node), or None when it sends no CPU count.

    Mirrors snakemake-executor-plugin-slurm's rule: ``cpus_per_task`` if set (negative: no CPU flag),
    else ``cpus_per_gpu`` on GPU jobs (a per-GPU count: not checked here), else the job's threads.
    """
    cpus_per_task = resources.get("cpus_per_task")
    if isinstance(cpus_per_task, int) and cpus_per_task != 0:
        return (cpus_per_task, "cpus_per_task") if cpus_per_task > 0 else None
    gpu_job = bool(resources.get("gpu")) or "gpu" in str(resources.get("gres") or "")
    if gpu_job and resources.get("cpus_per_gpu"):
        return None
    return threads, "threads = nproc_per_node"


def partition_cpus(run=subprocess.run) -> tuple[dict[str, int], str | None] | None:
    """Largest node (CPUs) of each partition and the default partition, from ``sinfo``; None if
    ``sinfo`` is missing or fails (then ``sbatch`` has the last word, as without this check)."""
    try:
        proc = run(["sinfo", "-h", "-N", "-o", "%P %c"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if proc.returncode != 0:
        return None
    largest: dict[str, int] = {}
    default = None
    for line in proc.stdout.splitlines():
        fields = line.split()
        if len(fields) != 2 or not fields[1].isdigit():
            continue
        name = fields[0]
        if name.endswith("*"):
            name = name[:-1]
            default = name
        largest[name] = max(largest.get(name, 0), int(fields[1]))
    return largest, default


def oversized_cpu_requests(
    requests: Iterable[CpuRequest], largest: Mapping[str, int], default_partition: str | None
) -> list[str]:
    """One line per train job whose CPUs per node exceed every node of its partition.

    Partitions ``sinfo`` does not list (another cluster, a typo) are left to ``sbatch``.
    """
    errors = []
    for request in requests:
        partition = request.partition or default_partition
        if partition is None or partition not in largest or request.cpus_per_node <= largest[partition]:
            continue
        which = "partition" if request.partition else "default partition"
        errors.append(
            f"run(s) {', '.join(request.runs)} (training {request.training}): the train job asks for "
            f"{request.cpus_per_node} CPUs per node ({request.source}) but the largest node of "
            f"{which} '{partition}' has {largest[partition]}; lower it in the SLURM profile "
            f"(set-resources: train: cpus_per_task: {largest[partition]}) or pick a partition with larger "
            "nodes (slurm_partition)"
        )
    return errors
