"""A node lost for good in a SLURM job of several nodes: which nodes a failed training step lost.

A train job that may go on without a node (``min_ranks`` below the world size, ``nodes`` > 1) is
submitted with ``sbatch --no-kill`` (:func:`shardfuse.cluster.torchrun.job_resources`): when SLURM
declares one of its nodes dead (the cluster's ``SlurmdTimeout``), the job is not killed but shrinks to
the other nodes, and the srun step that spanned the dead node ends ("Node failure on node2"). The
launcher then asks SLURM, here, which of the step's nodes are gone:

- a node SLURM removed from the job is lost for good at once (it cannot rejoin the allocation);
- a node SLURM reports as not responding (state ``mixed*``, ``down``...) but still in the job is
  waited for, up to the run's ``node_timeout`` seconds: back in time, nothing is lost (a transient
  fault: the launcher starts every rank again, as before); not back, it is lost for good;
- every node in the job and responding: no node was lost (a rank's own failure: reported as always).

The ranks that ran on a lost node (each rank's host, recorded as it started:
:func:`shardfuse.rank.failure.record_host`) are lost with it; the others go on on the nodes left.

Torch-free: the launcher imports it. ``run`` and ``sleep`` are parameters so the logic is tested
without a cluster (the two-node cluster test is the real one).
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable, Iterable

from shardfuse.cluster.torchrun import hostnames

NODE_TIMEOUT_DEFAULT = 300  # seconds a not-responding node may take to come back (the run key's default)
POLL_S = 5.0
# sinfo's %T of a node that does not answer the controller (suffix *) or that is out of service. Not a
# drain: an administrator's, and a draining node still runs its jobs.
GONE_STATES = ("down", "fail", "future", "unknown", "no_respond", "power_down", "powered_down")


def job_nodes(job_id: str, run=subprocess.run) -> list[str] | None:
    """The nodes job ``job_id`` holds now (fewer than it started with once SLURM removed a dead node
    from a ``--no-kill`` job); None if scontrol cannot say."""
    try:
        out = run(
            ["scontrol", "show", "job", "-o", job_id], capture_output=True, text=True, check=True, timeout=60
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for field in out.split():
        if field.startswith("NodeList="):
            value = field.split("=", 1)[1]
            return [] if value in ("", "(null)") else hostnames(value, run)
    return None


def not_responding(nodes: Iterable[str], run=subprocess.run) -> set[str]:
    """The ``nodes`` SLURM reports as not answering or out of service (sinfo's state)."""
    nodes = list(nodes)
    if not nodes:
        return set()
    try:
        out = run(
            ["sinfo", "-h", "-N", "-n", ",".join(nodes), "-o", "%N %T"],
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return set()  # cannot tell: treat as answering (no node is lost on a guess)
    gone = set()
    for line in out.splitlines():
        name, _, state = line.strip().partition(" ")
        state = state.strip().lower()
        if state.endswith("*") or state.rstrip("*~#!%$@^-+").startswith(GONE_STATES):
            gone.add(name)
    return gone


def lost_nodes(
    job_id: str,
    step_nodes: list[str],
    timeout_s: float,
    run=subprocess.run,
    sleep: Callable[[float], None] = time.sleep,
    clock: Callable[[], float] = time.monotonic,
    say: Callable[[str], None] = lambda line: None,
) -> list[str]:
    """The nodes of a failed step that are lost for good (in ``step_nodes``' order): removed from the
    job, or not responding for ``timeout_s`` seconds; [] when none is (every node answers again)."""
    deadline = clock() + timeout_s
    waited = False
    while True:
        held = job_nodes(job_id, run)
        removed = [node for node in step_nodes if held is not None and node not in held]
        silent = not_responding([node for node in step_nodes if node not in removed], run)
        if removed and not silent:
            return removed
        if not silent:
            return []
        if clock() >= deadline:
            return [node for node in step_nodes if node in removed or node in silent]
        if not waited:
            say(
                f"launch: node(s) {', '.join(sorted(silent))} of SLURM job {job_id} not responding; "
                f"waiting up to {timeout_s:g} s (node_timeout) for them to come back"
            )
            waited = True
        sleep(min(POLL_S, max(0.0, deadline - clock())))


def ranks_on(nodes: Iterable[str], hosts: dict[int, str]) -> list[int]:
    """The member ranks that ran on ``nodes`` (``hosts``: member rank -> host it started on)."""
    lost = set(nodes)
    return sorted(rank for rank, host in hosts.items() if host in lost)
