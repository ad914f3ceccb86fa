"""Who trains what: which data shard each rank reads, which replica (model copy) it belongs to, and which
ranks are alive. Kept apart from torch's rank and world size (as torchtitan's ``ParallelDims`` /
``get_dp_info`` and Lightning's ``ClusterEnvironment`` keep the data-parallel view apart from the
process group): torch numbers the processes of one attempt, membership says what each contributes.

At the start every rank is alive and rank ``r`` reads shard ``r`` in replica ``r // ranks_per_replica``
(:meth:`Membership.full`); a member's ``rank`` is that first number for good. A rank lost for good
(:meth:`Membership.lose`: the step it was lost at, the steps of its that no published model holds) leaves
the survivors, which the launcher starts again as a smaller torch world: torch's process ``k`` is the
``k``-th alive member (:meth:`Membership.member_of_process`), which keeps its seed, shard, checkpoint
and metrics files. The object says which replicas still have all their ranks and which shards (what
share of the training rows) the surviving replicas cover: what a fused model is made of. The rank
set-up picks its member from it, train.json and gather.json record it.

Torch-free and import-light (the standard library and :mod:`shardfuse.io`): the ranks, gather and
merge read it alike. By hand::

    python -c "from shardfuse.cluster.membership import Membership; \\
        print(Membership.full(4, 2).without(3).to_json())"
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from shardfuse.io import UserError

# What becomes of a rank's shard once the rank is lost for good (the run key orphans; the schema's enum,
# tests/contracts hold them equal): drop leaves its rows unseen, reshard deals them to the others.
ORPHANS = ("drop", "reshard")
RESHARD = "reshard"


@dataclass(frozen=True)
class Member:
    rank: int  # its rank in the training's first world (torch's, while no rank was lost)
    replica: int  # the model copy it trains: its checkpoint's number (rank-<replica>.safetensors)
    data_shard: int  # the shard it reads (the manifest's shards[data_shard], shard-<n>.parquet)
    alive: bool = True
    lost_at_step: int | None = None  # lost: the optimiser step it could not get past
    steps_discarded: int = 0  # lost: its optimiser steps that no published model holds
    # lost: what became of its shard from lost_at_step on: drop (left unseen) or reshard (its micro-batches
    # dealt to the alive members, shardfuse.rank.orphans)
    orphans: str = ORPHANS[0]

    @property
    def dealt(self) -> bool:
        """Lost, and its rows from ``lost_at_step`` on dealt to the others."""
        return not self.alive and self.orphans == RESHARD


@dataclass(frozen=True)
class Membership:
    num_shards: int  # shards in the shard set: full coverage
    members: tuple[Member, ...]  # one per rank, by rank

    def __post_init__(self) -> None:
        ranks = [member.rank for member in self.members]
        if ranks != list(range(len(ranks))) or not ranks:
            raise UserError(f"a membership lists ranks 0..n-1 once each, in order, not {ranks}")
        if any(not 0 <= member.data_shard < self.num_shards for member in self.members):
            raise UserError(f"a membership's data shards lie in 0..{self.num_shards - 1}")

    @classmethod
    def full(cls, world_size: int, ranks_per_replica: int = 1) -> Membership:
        """Every rank alive, rank r on shard r, replicas of ``ranks_per_replica`` consecutive ranks
        (fsdp's S; 1: every rank its own replica)."""
        if world_size < 1 or ranks_per_replica < 1 or world_size % ranks_per_replica:
            raise UserError(
                f"{world_size} ranks do not split into replicas of {ranks_per_replica}; set fsdp to a "
                "divisor of world_size"
            )
        return cls(world_size, tuple(Member(r, r // ranks_per_replica, r) for r in range(world_size)))

    @property
    def world_size(self) -> int:
        return len(self.members)

    @property
    def alive_members(self) -> tuple[Member, ...]:
        """The members torch starts, in rank order: process ``k`` of the world is the ``k``-th."""
        return tuple(member for member in self.members if member.alive)

    def member_of_process(self, process: int) -> Member:
        """The member torch's rank ``process`` is (the same rank while no rank was lost)."""
        alive = self.alive_members
        if not 0 <= process < len(alive):
            raise UserError(
                f"torch rank {process} is not a member: {len(alive)} of the training's {self.world_size} "
                "ranks are alive; start one process per alive rank"
            )
        return alive[process]

    def process_of(self, rank: int) -> int:
        """Torch's rank of the alive member ``rank``."""
        return [member.rank for member in self.alive_members].index(rank)

    @property
    def steps_discarded(self) -> int:
        return sum(member.steps_discarded for member in self.members)

    def row_coverage(self, shard_rows: list[int]) -> float:
        """The share of the training rows (``shard_rows``: each data shard's) on the alive replicas'
        shards."""
        covered = sum(shard_rows[shard] for shard in self.covered_shards)
        return covered / sum(shard_rows) if sum(shard_rows) else 1.0

    def epoch_coverage(self, shard_rows: list[int], steps_per_epoch: int, epochs: int) -> list[float]:
        """Per epoch, the share of the training rows the published models hold: an alive replica's
        shard all of it; a lost one's up to its last step that reached the survivors (``lost_at_step``
        less ``steps_discarded``: a sync, or none when the ranks never meet), pro rata of the epoch's
        steps, and with ``orphans: reshard`` also from ``lost_at_step`` on (dealt to the survivors)."""
        total = sum(shard_rows) or 1
        shares = []
        for epoch in range(epochs):
            start = epoch * steps_per_epoch
            covered = 0.0
            for member in self.members:
                rows = shard_rows[member.data_shard]
                if member.alive:
                    covered += rows
                else:
                    lost_at = member.lost_at_step or 0
                    covered += rows * _share(lost_at - member.steps_discarded - start, steps_per_epoch)
                    if member.dealt:  # the epoch's steps from the loss on took its rows too
                        covered += rows * _share(start + steps_per_epoch - lost_at, steps_per_epoch)
            shares.append(covered / total)
        return shares

    def row_shares(self, shard_rows: list[int]) -> dict[int, float]:
        """Each alive member's share of the rows the alive members hold, {rank: share} summing to 1: its
        own shard's rows, and with ``orphans: reshard`` an equal part of each dealt shard's (each of its
        micro-batches is split among them, within a row of equal). After a loss the survivors' averages
        (localsgd's, DiLoCo's outer gradient) weigh each survivor by it, as FedAvg weighs its clients;
        empty while no member is lost (every rank weighs the same, as ever)."""
        if not self.lost_ranks:
            return {}
        alive = self.alive_members
        dealt = sum(shard_rows[m.data_shard] for m in self.members if m.dealt) / len(alive)
        held = {m.rank: shard_rows[m.data_shard] + dealt for m in alive}
        total = sum(held.values())
        return {rank: rows / total if total else 1 / len(alive) for rank, rows in held.items()}

    def lose(self, rank: int, at_step: int, steps_discarded: int, orphans: str = ORPHANS[0]) -> Membership:
        """The membership with the alive member ``rank`` lost at ``at_step``, its shard's rows from then
        on dropped or dealt to the others (``orphans``)."""
        if not self.member(rank).alive:
            raise UserError(f"rank {rank} was lost already; a rank is lost once")
        if orphans not in ORPHANS:
            raise UserError(f"orphans {orphans!r} is not one of {', '.join(ORPHANS)}")
        members = tuple(
            Member(m.rank, m.replica, m.data_shard, False, at_step, steps_discarded, orphans)
            if m.rank == rank
            else m
            for m in self.members
        )
        return Membership(self.num_shards, members)

    def member(self, rank: int) -> Member:
        if not 0 <= rank < len(self.members):
            raise UserError(f"rank {rank} is not a member: the training has ranks 0..{len(self.members) - 1}")
        return self.members[rank]

    def shard_of(self, rank: int) -> int:
        """The data shard ``rank`` reads."""
        return self.member(rank).data_shard

    @property
    def replicas(self) -> tuple[int, ...]:
        return tuple(dict.fromkeys(member.replica for member in self.members))

    def ranks_of(self, replica: int) -> list[int]:
        return [member.rank for member in self.members if member.replica == replica]

    @property
    def lost_ranks(self) -> tuple[int, ...]:
        return tuple(member.rank for member in self.members if not member.alive)

    @property
    def alive_replicas(self) -> tuple[int, ...]:
        """Replicas with every rank alive: a replica that lost a rank lost that rank's slice of its
        model (fsdp), so it publishes nothing."""
        lost = {member.replica for member in self.members if not member.alive}
        return tuple(replica for replica in self.replicas if replica not in lost)

    @property
    def covered_shards(self) -> tuple[int, ...]:
        """The data shards the alive replicas trained on (a lost rank's too once dealt to them): what a
        fusion of them has seen."""
        alive = set(self.alive_replicas)
        return tuple(sorted({m.data_shard for m in self.members if m.replica in alive or m.dealt}))

    @property
    def coverage(self) -> float:
        """The share of the shard set the alive replicas cover (1.0: all of it)."""
        return len(self.covered_shards) / self.num_shards

    def without(self, *ranks: int) -> Membership:
        """The same membership with ``ranks`` lost."""
        for rank in ranks:
            self.member(rank)  # a rank that is not a member is an error, not a silent no-op
        members = tuple(
            Member(m.rank, m.replica, m.data_shard, m.alive and m.rank not in ranks, m.lost_at_step)
            for m in self.members
        )
        return Membership(self.num_shards, members)

    def to_json(self) -> dict[str, Any]:
        """train.json's and gather.json's ``membership``: the ranks, then what they amount to."""
        return {
            "num_shards": self.num_shards,
            "ranks": [_member_json(m) for m in self.members],
            "lost_ranks": list(self.lost_ranks),
            "alive_replicas": list(self.alive_replicas),
            "coverage": self.coverage,
            **({"steps_discarded": self.steps_discarded} if self.lost_ranks else {}),
        }

    @classmethod
    def from_json(cls, data: Any, where: str, fix: str) -> Membership:
        """What :meth:`to_json` wrote (the derived fields are recomputed, not trusted); a malformed entry
        is a one-line UserError naming ``where`` and ``fix``."""
        try:
            members = tuple(
                Member(
                    int(m["rank"]),
                    int(m["replica"]),
                    int(m["data_shard"]),
                    bool(m["alive"]),
                    None if m.get("lost_at_step") is None else int(m["lost_at_step"]),
                    int(m.get("steps_discarded", 0)),
                    str(m.get("orphans", ORPHANS[0])),
                )
                for m in data["ranks"]
            )
            return cls(int(data["num_shards"]), members)
        except (KeyError, TypeError, ValueError, UserError) as exc:
            raise UserError(f"{where}: 'membership' is malformed ({exc}); {fix}") from None


def _member_json(member: Member) -> dict[str, Any]:
    """A member's entry; a lost one's also says when it was lost and what it took with it."""
    entry = {
        "rank": member.rank,
        "replica": member.replica,
        "data_shard": member.data_shard,
        "alive": member.alive,
    }
    if member.lost_at_step is not None:
        entry |= {
            "lost_at_step": member.lost_at_step,
            "steps_discarded": member.steps_discarded,
            "orphans": member.orphans,
        }
    return entry


def recorded_membership(train_info: Mapping[str, Any], world_size: int, where: str, fix: str) -> Membership:
    """Who trained what, as train.json (``train_info``) records it; a train.json from before it did:
    every rank alive on its own shard, in replicas of its fsdp ``shards_per_replica`` ranks."""
    recorded = train_info.get("membership")
    if recorded is None:
        fsdp = train_info.get("fsdp")
        return Membership.full(world_size, fsdp["shards_per_replica"] if isinstance(fsdp, dict) else 1)
    membership = Membership.from_json(recorded, where, fix)
    if membership.world_size != world_size:
        raise UserError(
            f"{where}: its membership lists {membership.world_size} ranks, not {world_size}; {fix}"
        )
    return membership


def _share(steps: int, steps_per_epoch: int) -> float:
    """``steps`` of an epoch of ``steps_per_epoch`` as a share from 0 to 1."""
    return min(max(steps / max(steps_per_epoch, 1), 0.0), 1.0)
