"""Torchrun's geometry and command lines for a training: one node (``torchrun --standalone``), or
several inside a SLURM allocation (``srun`` one task per node, each a ``launch --node-step`` that execs
``torchrun --nnodes=N --node-rank=R`` with a c10d rendezvous on the first host); the SLURM resources a
train job asks for; the environment of each rank. Used by the launch stage and the Snakefile.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass

from shardfuse.io import UserError

TRAIN_MODULE = "shardfuse.train"
# torchrun's command line and launcher, the ranks forked from its agent (shardfuse/cluster/agent.py).
AGENT_MODULE = "shardfuse.agent"


RDZV_PORT_ENV = "SHARDFUSE_RDZV_PORT"


# Thread-pool sizes Snakemake sets to the job's `threads` (= the CPUs of one node).
THREAD_ENV_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


@dataclass(frozen=True)
class Geometry:
    """Where the ranks run: ``nnodes`` machines with ``nproc_per_node`` ranks each."""

    nnodes: int = 1
    nproc_per_node: int = 1

    def __post_init__(self) -> None:
        if self.nnodes < 1 or self.nproc_per_node < 1:
            raise UserError(f"--nodes {self.nnodes} and --nproc-per-node {self.nproc_per_node} must be >= 1")

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def job_resources(geometry: Geometry, min_ranks: int | None = None) -> dict[str, int | str]:
    """Resources of the train job for snakemake-executor-plugin-slurm (ignored by the local executor).

    One SLURM task per node, each running one torchrun agent. ``mpi="srun"`` makes the plugin's job
    step run the rule's shell in the batch step, from where :func:`srun_command` fans out; a single
    node keeps the plugin's default single-task step. ``tasks_per_gpu=0`` stops the plugin adding
    ``--ntasks-per-gpu`` when the profile asks for GPUs (``gres=gpu:N`` is per node). A training on
    several nodes that may go on without one (``min_ranks`` below the world size) asks for
    ``--no-kill``: SLURM then takes a dead node out of the job instead of ending it
    (:mod:`shardfuse.cluster.node_loss`).
    """
    survives = geometry.nnodes > 1 and min_ranks is not None and min_ranks < geometry.world_size
    return {
        "nodes": geometry.nnodes,
        "tasks": geometry.nnodes,
        "tasks_per_gpu": 0,
        "mpi": "srun" if geometry.nnodes > 1 else "",
        "slurm_extra": "--no-kill" if survives else "",
    }


def standalone_command(
    geometry: Geometry, train_args: list[str], python: str = sys.executable, max_restarts: int = 0
) -> list[str]:
    """One node: torchrun with its own local rendezvous (:mod:`shardfuse.agent` is torchrun's
    launcher with the ranks forked from its agent)."""
    return [
        python,
        "-m",
        AGENT_MODULE,
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={geometry.nproc_per_node}",
        *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        "-m",
        TRAIN_MODULE,
        *train_args,
    ]


def srun_command(
    geometry: Geometry,
    train_args: list[str],
    python: str = sys.executable,
    max_restarts: int = 0,
    nodelist: list[str] | None = None,
) -> list[str]:
    """Several nodes: one srun task per node, each becoming that node's torchrun agent (on ``nodelist``
    of the job's nodes: the ones left after a node was lost; default: SLURM's choice)."""
    return [
        "srun",
        *([f"--nodelist={','.join(nodelist)}"] if nodelist else []),
        f"--nodes={geometry.nnodes}",
        f"--ntasks={geometry.nnodes}",
        "--ntasks-per-node=1",
        "--kill-on-bad-exit=1",
        python,
        "-m",
        "shardfuse.launch",
        "--node-step",
        f"--nodes={geometry.nnodes}",
        f"--nproc-per-node={geometry.nproc_per_node}",
        *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        "--",
        *train_args,
    ]


def node_command(
    geometry: Geometry,
    node_rank: int,
    rdzv_host: str,
    rdzv_port: int,
    rdzv_id: str,
    train_args: list[str],
    python: str = sys.executable,
    max_restarts: int = 0,
) -> list[str]:
    """This node's torchrun agent; all agents meet at the c10d store on ``rdzv_host``."""
    return [
        python,
        "-m",
        AGENT_MODULE,
        f"--nnodes={geometry.nnodes}",
        f"--node-rank={node_rank}",
        f"--nproc-per-node={geometry.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv_host}:{rdzv_port}",
        f"--rdzv-id={rdzv_id}",
        *([f"--max-restarts={max_restarts}"] if max_restarts else []),
        "-m",
        TRAIN_MODULE,
        *train_args,
    ]


def launch_command(
    geometry: Geometry,
    train_args: list[str],
    environ: Mapping[str, str],
    python: str = sys.executable,
    max_restarts: int = 0,
) -> list[str]:
    """The command the train rule's job runs, chosen from the geometry and where we are."""
    if geometry.nnodes == 1:
        return standalone_command(geometry, train_args, python, max_restarts)
    if "SLURM_JOB_ID" not in environ:
        raise UserError(
            f"nodes={geometry.nnodes} needs a SLURM allocation of {geometry.nnodes} nodes; run "
            "with --profile profiles/slurm or set the run's nodes to 1"
        )
    return srun_command(geometry, train_args, python, max_restarts)


def rendezvous_port(job_id: str, environ: Mapping[str, str]) -> int:
    """A port per job, so two multi-node jobs sharing a first host do not collide."""
    if environ.get(RDZV_PORT_ENV):
        return int(environ[RDZV_PORT_ENV])
    return 20000 + int(job_id) % 20000 if job_id.isdigit() else 29500


def hostnames(nodelist: str, run=subprocess.run) -> list[str]:
    """The hosts of a SLURM node list (``node[01-04],gpu7`` -> node01 .. node04, gpu7), via scontrol."""
    try:
        command = ["scontrol", "show", "hostnames", nodelist]
        return run(command, capture_output=True, text=True, check=True, timeout=60).stdout.split()
    except (OSError, subprocess.SubprocessError) as exc:
        raise UserError(
            f"cannot expand the SLURM node list {nodelist!r} with scontrol ({exc}); run inside "
            "a SLURM allocation with scontrol on PATH"
        ) from None


def first_host(nodelist: str) -> str:
    """First host of a SLURM node list (``node[01-04],gpu7`` -> ``node01``), via scontrol."""
    out = hostnames(nodelist)
    if not out:
        raise UserError(f"scontrol returned no hosts for node list {nodelist!r}")
    return out[0]


def node_step_command(
    geometry: Geometry,
    train_args: list[str],
    environ: Mapping[str, str],
    python: str = sys.executable,
    max_restarts: int = 0,
) -> list[str]:
    """Inside one srun task: read this step's SLURM variables and build the node's torchrun."""
    missing = [v for v in ("SLURM_NODEID", "SLURM_NNODES", "SLURM_JOB_ID") if v not in environ]
    step_nodes = environ.get("SLURM_STEP_NUM_NODES") or environ.get("SLURM_NNODES")
    nodelist = environ.get("SLURM_STEP_NODELIST") or environ.get("SLURM_JOB_NODELIST")
    if missing or not nodelist:
        raise UserError(
            f"--node-step runs inside an srun step; {', '.join(missing) or 'the node list'} "
            "is not set — launch without --node-step"
        )
    if int(step_nodes) != geometry.nnodes:
        raise UserError(
            f"the srun step spans {step_nodes} nodes but the run needs "
            f"{geometry.nnodes}; request nodes={geometry.nnodes} for the job"
        )
    job_id = environ["SLURM_JOB_ID"]
    return node_command(
        geometry,
        int(environ["SLURM_NODEID"]),
        first_host(nodelist),
        rendezvous_port(job_id, environ),
        job_id,
        train_args,
        python,
        max_restarts,
    )


def rank_environ(geometry: Geometry, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment of this node's ranks: the node's threads shared among its ranks.

    Snakemake sets OMP_NUM_THREADS to the job's threads, which torchrun passes on unchanged, so
    each of the node's ``nproc_per_node`` ranks would run as many threads as the node has CPUs:
    oversubscribed, and the threads per rank (which decide the order of float sums in a matmul)
    would depend on the geometry, so 2 nodes x 1 rank would not be bitwise equal to 1 x 2.
    """
    env = dict(environ)
    for var in THREAD_ENV_VARS:
        if env.get(var, "").isdigit():
            env[var] = str(max(1, int(env[var]) // geometry.nproc_per_node))
    return env
