"""A rank lost for good: how the launcher tells one from a transient fault, and what the survivors carry.

torchrun restarts every rank after a failure (``max_restarts``) and they resume from the newest complete
checkpoint: right for a transient fault. A rank is **lost for good** when it was the rank that failed in
every one of those ``max_restarts + 1`` attempts and no checkpoint completed in between (it failed again
and again at the same step): a node that is gone, a GPU that keeps failing, a shard that kills its
reader. With ``min_ranks`` below the world size the launcher then starts the survivors again as a smaller
world (:class:`shardfuse.cluster.membership.Membership`), from the same checkpoint; with fewer than
``min_ranks`` left it stops with one line, as it does today when ``min_ranks`` is the world size.

What becomes of the lost rank's shard is the run key ``orphans``: ``drop`` (the default) leaves it unseen
from then on, its rows counting against the fused model's ``coverage``; ``reshard`` deals each of its
micro-batches from the step the survivors resume at to them (:mod:`shardfuse.rank.orphans`), so the
global batch and the step count stay as planned (ddp, elastic data parallel, needs it). Its optimiser
steps that no published model holds are ``steps_discarded``: none under ddp (every step's gradients
reached the others), all of them when the ranks never meet (independent training), otherwise those since
the last sync (localsgd's average, DiLoCo's outer step), when its work last reached the others.

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from shardfuse.cluster.agent import KILLED_RECORD
from shardfuse.cluster.membership import ORPHANS, Member, Membership
from shardfuse.cluster.node_loss import job_nodes, lost_nodes, ranks_on
from shardfuse.cluster.torchrun import (
    RDZV_PORT_ENV,
    Geometry,
    hostnames,
    launch_command,
    rendezvous_port,
    srun_command,
)
from shardfuse.console.stream import console_stream
from shardfuse.data.epoch_steps import DEFAULT as EPOCH_STEPS_DEFAULT
from shardfuse.data.epoch_steps import unaligned
from shardfuse.io import UserError, read_json, write_json
from shardfuse.rank.checkpoint_steps import complete_steps
from shardfuse.rank.failure import FAILURES_DIR, JOIN_FAILURE, read_failure, read_hosts, read_start
from shardfuse.strategies.registry import find_strategy, rank_loss_problem

MEMBERSHIP_FILE = "membership.json"  # in the staging folder, once a rank was lost: the survivors go on


def train_config(train_args: list[str]) -> dict[str, Any]:
    """The training's ``--config-json`` (the run's flat keys), with a strategy."""
    try:
        config = json.loads(train_args[train_args.index("--config-json") + 1])
    except (ValueError, IndexError):
        config = None
    if not isinstance(config, dict) or not isinstance(config.get("strategy"), str):
        raise UserError(
            "the train arguments have no --config-json with a strategy; pass the run's config as the "
            "train rule does"
        )
    return config


def strategy_of(train_args: list[str]) -> tuple[str, int]:
    """(strategy, sync_every) of the training's ``--config-json``."""
    config = train_config(train_args)
    return config["strategy"], int(config.get("sync_every") or 0)


def orphans_of(train_args: list[str]) -> str:
    """The training's orphans policy (drop, the default, or reshard)."""
    return str(train_config(train_args).get("orphans") or ORPHANS[0])


def min_ranks_problem(min_ranks: int, geometry: Geometry, train_args: list[str]) -> str | None:
    """Why the launcher's ``--min-ranks`` cannot be used with the training of ``train_args`` (its
    strategy, fsdp, orphans and epoch_steps) on ``geometry``; None when it can."""
    config = train_config(train_args)
    return rank_loss_problem(
        min_ranks, geometry.world_size, config["strategy"], int(config.get("fsdp") or 1), geometry.nnodes,
        orphans_of(train_args), unaligned(str(config.get("epoch_steps") or EPOCH_STEPS_DEFAULT)),
    )  # fmt: skip


def steps_discarded(strategy: str, sync_every: int, lost_at_step: int) -> int:
    """The lost rank's optimiser steps that reached no other rank: none when every step's gradients are
    reduced over the ranks (ddp), all of them when the ranks never meet (sync_every 0), else those since
    its last sync."""
    record = find_strategy(strategy)
    if record.reduces_gradients:
        return 0
    if not record.survives_rank_loss or sync_every <= 0:
        return lost_at_step
    return lost_at_step % sync_every


def killed_ranks(staging: Path) -> list[int]:
    """The ranks the agent saw killed by a signal in this torchrun's attempts, in order (its record:
    :data:`shardfuse.cluster.agent.KILLED_RECORD`), but for SIGTERM: the agent's own, sent to a failed
    attempt's other ranks."""
    try:
        lines = (staging / KILLED_RECORD).read_text().splitlines()
    except OSError:
        return []
    ranks = []
    for line in lines:
        try:
            killed = json.loads(line)
            if int(killed["signal"]) != signal.SIGTERM:
                ranks.append(int(killed["rank"]))
        except (ValueError, KeyError, TypeError):
            continue  # a line cut by a kill of the agent itself
    return ranks


def attempt_culprits(staging: Path, max_restarts: int, killed: list[int]) -> list[int | None]:
    """Per torchrun attempt, the rank that failed (its member rank: torch's while no rank was lost): the
    rank that recorded its own exception first, else (a rank killed by a signal records nothing) the
    next rank the agent saw killed."""
    culprits: list[int | None] = []
    kills = iter(killed)
    for attempt in range(max_restarts + 1):
        failure = read_failure(staging, attempt)
        # A rank that waited in vain for another to join names the one waiting, not the one that hung.
        if failure is not None and not failure.peer_lost and failure.exception != JOIN_FAILURE:
            culprits.append(failure.rank)
        else:
            # No kill seen either: unknown (a peer's lost connection names the peer, not the cause).
            culprits.append(next(kills, None))
    return culprits


def lost_member(
    membership: Membership, culprits: list[int | None], starts: list[int | None], step: int
) -> Member | None:
    """The member lost for good: the same alive rank failed every attempt, and every restart resumed
    from ``step`` (the newest complete checkpoint now; ``starts``: what attempts 1.. resumed from, None
    for one that failed before it agreed where) so none got past it. None otherwise: the failure is
    reported as it always was."""
    if not culprits or None in culprits or len(set(culprits)) != 1:
        return None
    if any(start not in (None, step) for start in starts):
        return None  # a restart got further: not one step that fails for good
    rank = culprits[0]
    if not 0 <= rank < membership.world_size or not membership.member(rank).alive:
        return None
    return membership.member(rank)


def read_membership(staging: Path) -> Membership | None:
    """The survivors an earlier launch of this training went on with (None: every rank alive)."""
    path = staging / MEMBERSHIP_FILE
    if not path.is_file():
        return None
    return Membership.from_json(
        read_json(path, "membership file"),
        str(path),
        "delete the training's .ranks.partial folder to train afresh",
    )


def write_membership(staging: Path, membership: Membership) -> Path:
    path = staging / MEMBERSHIP_FILE
    write_json(path, membership.to_json())
    return path


def loss_line(member: Member, attempts: int, step: int, alive: int, world_size: int, min_ranks: int) -> str:
    """The launcher's line when a rank is lost and the survivors go on (``member``: as lost)."""
    fate = (
        f"is dealt to them, each of its micro-batches split {alive} ways"
        if member.dealt
        else "is left unseen"
    )
    return (
        f"launch: rank {member.rank} was lost for good: it failed {attempts} time(s) in a row at step {step} "
        f"(max_restarts {attempts - 1}); the other {alive} of {world_size} ranks go on from step {step} "
        f"without it (min_ranks {min_ranks}); its shard {member.data_shard} {fate} "
        f"(orphans: {member.orphans})"
    )


def too_few_line(
    member: Member, attempts: int, step: int, alive: int, world_size: int, min_ranks: int
) -> str:
    return (
        f"rank {member.rank} was lost for good (it failed {attempts} time(s) in a row at step {step}) and "
        f"only {alive} of {world_size} ranks are left, fewer than min_ranks {min_ranks}; fix the cause and "
        f"re-run (the survivors resume from step {step}), or lower min_ranks"
    )


def announce(line: str) -> None:
    """The launcher's line on its log and on the workflow's console, where the trainings' progress goes."""
    print(line, file=sys.stderr, flush=True)
    console = console_stream()
    if console is not None:
        with contextlib.suppress(OSError), console:
            print(line, file=console)


def survivors_after_loss(
    membership: Membership,
    staging: Path,
    train_args: list[str],
    max_restarts: int,
    min_ranks: int | None,
) -> Membership | None:
    """After torchrun failed: the membership the survivors go on with (written to the staging folder,
    which a re-run reads too) when one rank was lost for good and at least ``min_ranks`` are left; None
    when no rank was (the failure is reported as always). Fewer than ``min_ranks`` left: one line."""
    if min_ranks is None or min_ranks >= membership.world_size:
        return None
    steps = complete_steps(staging / "checkpoints")
    step = steps[-1] if steps else 0
    culprits = attempt_culprits(staging, max_restarts, killed_ranks(staging))
    starts = [read_start(staging, attempt) for attempt in range(1, max_restarts + 1)]
    lost = lost_member(membership, culprits, starts, step)
    if lost is None:
        return None
    strategy, sync_every = strategy_of(train_args)
    survivors = membership.lose(
        lost.rank, step, steps_discarded(strategy, sync_every, step), orphans_of(train_args)
    )
    alive, attempts = len(survivors.alive_members), max_restarts + 1
    if alive < min_ranks:
        raise UserError(too_few_line(lost, attempts, step, alive, membership.world_size, min_ranks))
    write_membership(staging, survivors)
    announce(loss_line(survivors.member(lost.rank), attempts, step, alive, membership.world_size, min_ranks))
    shutil.rmtree(staging / FAILURES_DIR, ignore_errors=True)  # the next torchrun counts its attempts anew
    return survivors


def survivors_command(
    membership: Membership,
    staging: Path,
    train_args: list[str],
    environ: Mapping[str, str],
    max_restarts: int,
    planned: Geometry | None = None,
    nodes: list[str] | None = None,
) -> tuple[Geometry, list[str]]:
    """torchrun for the alive ranks, each told which member it is (``--membership``): on one node, or,
    for a training ``planned`` on several, ``planned.nproc_per_node`` ranks on each of the first nodes
    of ``nodes`` (the job's nodes left) it needs, one srun task each."""
    args = [*train_args, "--out-dir", str(staging), "--membership", str(staging / MEMBERSHIP_FILE)]
    alive = len(membership.alive_members)
    if planned is None or planned.nnodes == 1 or alive <= planned.nproc_per_node or not nodes:
        geometry = Geometry(1, alive)  # one node left: this one (the batch host; were it lost, so were we)
        return geometry, launch_command(geometry, args, environ, max_restarts=max_restarts)
    geometry = Geometry(alive // planned.nproc_per_node, planned.nproc_per_node)
    if geometry.world_size != alive or len(nodes) < geometry.nnodes:
        raise UserError(
            f"{alive} ranks are alive, not {planned.nproc_per_node} on each of {len(nodes)} node(s) left; "
            "delete the training's .ranks.partial folder to train afresh"
        )
    # A rendezvous port of its own: the failed step's store may still hold the job's usual one.
    job = environ.get("SLURM_JOB_ID", "")
    port = 20000 + (rendezvous_port(job, environ) - 20000 + len(membership.lost_ranks)) % 20000
    cmd = srun_command(geometry, args, max_restarts=max_restarts, nodelist=nodes[: geometry.nnodes])
    return geometry, [*cmd[:1], f"--export=ALL,{RDZV_PORT_ENV}={port}", *cmd[1:]]


def job_node_names(job: str, environ: Mapping[str, str]) -> list[str] | None:
    """The nodes SLURM job ``job`` holds now (a re-run's job: every node it asked for)."""
    held = job_nodes(job)
    if held:
        return held
    nodelist = environ.get("SLURM_JOB_NODELIST")
    return hostnames(nodelist) if nodelist else None


def node_loss_line(
    lost: list[str], ranks: list[int], step: int, survivors: Membership, min_ranks: int
) -> str:
    alive = len(survivors.alive_members)
    member = survivors.member(ranks[0])
    fate = "are dealt to them" if member.dealt else "are left unseen"
    return (
        f"launch: node(s) {', '.join(lost)} lost for good (SLURM removed them from the job or they did not "
        f"come back within node_timeout) with rank(s) {', '.join(map(str, ranks))}; the other {alive} of "
        f"{survivors.world_size} ranks go on from step {step} without them (min_ranks {min_ranks}); their "
        f"shards {fate} (orphans: {member.orphans})"
    )


def survivors_after_node_loss(
    membership: Membership,
    staging: Path,
    train_args: list[str],
    min_ranks: int | None,
    job: str | None,
    nodes: list[str],
    node_timeout: float,
    nproc_per_node: int,
) -> tuple[Membership, list[str]] | None:
    """After the srun step of a training on several nodes failed: (the membership the survivors go on
    with, the nodes left) when SLURM lost one or more of ``nodes`` for good
    (:func:`shardfuse.cluster.node_loss.lost_nodes`) and at least ``min_ranks`` ranks are left on the
    others; None when no node was lost (the failure is reported as always). Fewer left: one line."""
    if min_ranks is None or min_ranks >= membership.world_size or not job or not nodes:
        return None
    lost = lost_nodes(job, nodes, node_timeout, say=lambda line: print(line, file=sys.stderr, flush=True))
    ranks = [rank for rank in ranks_on(lost, read_hosts(staging)) if membership.member(rank).alive]
    if not lost or not ranks:
        return None
    steps = complete_steps(staging / "checkpoints")
    step = steps[-1] if steps else 0
    strategy, sync_every = strategy_of(train_args)
    discarded, orphans = steps_discarded(strategy, sync_every, step), orphans_of(train_args)
    survivors = membership
    for rank in ranks:
        survivors = survivors.lose(rank, step, discarded, orphans)
    left = [node for node in nodes if node not in lost]
    alive = len(survivors.alive_members)
    if alive < min_ranks:
        raise UserError(
            f"node(s) {', '.join(lost)} were lost for good with rank(s) {', '.join(map(str, ranks))} and "
            f"only {alive} of {membership.world_size} ranks are left, fewer than min_ranks {min_ranks}; "
            f"bring the nodes back and re-run (the survivors resume from step {step}), or lower min_ranks"
        )
    if alive != len(left) * nproc_per_node:
        return None  # not whole nodes lost (a rank's host unknown): reported as always
    write_membership(staging, survivors)
    announce(node_loss_line(lost, ranks, step, survivors, min_ranks))
    shutil.rmtree(staging / FAILURES_DIR, ignore_errors=True)
    return survivors, left
