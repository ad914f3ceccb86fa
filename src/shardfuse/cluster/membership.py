"""Who trains what: which data shard each rank reads, which replica (model copy) it belongs to, and which
ranks are alive. Kept apart from torch's rank and world size (as torchtitan's ``ParallelDims`` /
``get_dp_info`` and Lightning's ``ClusterEnvironment`` keep the data-parallel view apart from the
process group): torch numbers the processes of one attempt, membership says what each contributes.

Today every rank is alive and rank ``r`` reads shard ``r`` in replica ``r // ranks_per_replica``
(:meth:`Membership.full`). The object can also say that a rank was lost (:meth:`Membership.without`),
which replicas still have all their ranks, and which shards (hence what share of the training data)
the surviving replicas cover, so that a later change can let survivors go on and record what a fused
model is made of. The rank set-up picks its shard from it, train.json and gather.json record it.

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


@dataclass(frozen=True)
class Member:
    rank: int  # torch's global rank (the process of this attempt)
    replica: int  # the model copy it trains: its checkpoint's number (rank-<replica>.safetensors)
    data_shard: int  # the shard it reads (the manifest's shards[data_shard], shard-<n>.parquet)
    alive: bool = True


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
        """The data shards the alive replicas trained on: what a fusion of them has seen."""
        alive = set(self.alive_replicas)
        return tuple(sorted({m.data_shard for m in self.members if m.replica in alive}))

    @property
    def coverage(self) -> float:
        """The share of the shard set the alive replicas cover (1.0: all of it)."""
        return len(self.covered_shards) / self.num_shards

    def without(self, *ranks: int) -> Membership:
        """The same membership with ``ranks`` lost."""
        for rank in ranks:
            self.member(rank)  # a rank that is not a member is an error, not a silent no-op
        members = tuple(
            Member(m.rank, m.replica, m.data_shard, m.alive and m.rank not in ranks) for m in self.members
        )
        return Membership(self.num_shards, members)

    def to_json(self) -> dict[str, Any]:
        """train.json's and gather.json's ``membership``: the ranks, then what they amount to."""
        return {
            "num_shards": self.num_shards,
            "ranks": [
                {"rank": m.rank, "replica": m.replica, "data_shard": m.data_shard, "alive": m.alive}
                for m in self.members
            ],
            "lost_ranks": list(self.lost_ranks),
            "alive_replicas": list(self.alive_replicas),
            "coverage": self.coverage,
        }

    @classmethod
    def from_json(cls, data: Any, where: str, fix: str) -> Membership:
        """What :meth:`to_json` wrote (the derived fields are recomputed, not trusted); a malformed entry
        is a one-line UserError naming ``where`` and ``fix``."""
        try:
            members = tuple(
                Member(int(m["rank"]), int(m["replica"]), int(m["data_shard"]), bool(m["alive"]))
                for m in data["ranks"]
            )
            return cls(int(data["num_shards"]), members)
        except (KeyError, TypeError, ValueError, UserError) as exc:
            raise UserError(f"{where}: 'membership' is malformed ({exc}); {fix}") from None


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
