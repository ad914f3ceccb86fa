"""gather.json as a typed record: what the gather stage writes about a training's checkpoints, read back
with every entry's type checked, before any stage trusts a path or a digest in it.

The record of the file passed from gather to merge, evaluate, track and export, as train.json, merge.json
and eval.json are (shardfuse.experiment.records). It lives here rather than beside them because the
readers are libraries below ``experiment``: the trust checks (shardfuse.checkpoints.trust.read_gather,
which returns it) and the merge paths in fusion. Torch-free. By hand::

    python -c "from shardfuse.checkpoints.gather_record import GatherRecord; \\
        import json; print(GatherRecord.from_json(json.load(open('results/trainings/T/gather.json'))).rows)"

A field a stage does not read may be absent (or null); the stage names those it reads (``need``,
``need_in_ranks``) and those must be present. Keys this version does not know are kept in ``extra`` and
written back after the known ones.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields, replace
from typing import Any

from shardfuse.io import HASH_ALGORITHMS, UserError

STALE = "gather.json was edited or is stale: re-run gather (snakemake -R gather)"
FORMAT_VERSION = 2  # the newest gather.json this version reads and the one gather writes

JSON_TYPES = {
    str: "a string",
    int: "an integer",
    float: "a number",
    bool: "a boolean",
    dict: "an object",
    list: "a list",
    type(None): "null",
}
KINDS = {"str": str, "int": int, "dict": dict, "list": list, "tuple": list}


def _kind(annotation: Any) -> type:
    """The JSON kind of a field from its annotation (a string: ``int | None`` -> int)."""
    return KINDS[str(annotation).split("|")[0].split("[")[0].strip()]


def _is(value: Any, kind: type) -> bool:
    return isinstance(value, kind) and not (kind is int and isinstance(value, bool))


def _checked(cls: type, source: str, where: str, data: Any, need: tuple[str, ...]) -> dict[str, Any]:
    """``data``'s known fields, each of its field's JSON kind where present (not null), and those in
    ``need`` present; a one-line UserError naming the entry otherwise."""
    if not isinstance(data, dict):
        raise UserError(f"{source}: {where or 'the record'} is not a JSON object; {STALE}")
    values = {}
    for f in fields(cls):
        if f.name == "extra":
            continue
        value = data.get(f.name)
        if value is None and f.name not in need:
            continue  # absent, or null: the same to a stage that does not read it
        kind = _kind(f.type)
        if f.name not in data or not _is(value, kind):
            found = "missing" if f.name not in data else JSON_TYPES.get(type(value), "malformed")
            raise UserError(f"{source}: {where + f.name!r} is {found}, not {JSON_TYPES[kind]}; {STALE}")
        values[f.name] = value
    return values


def _json(record: Any) -> dict[str, Any]:
    """The record's known fields that are set, in field order, then its unknown keys."""
    data = {f.name: getattr(record, f.name) for f in fields(record) if f.name != "extra"}
    return {**{key: value for key, value in data.items() if value is not None}, **record.extra}


@dataclass(frozen=True)
class GatheredRank:
    """One rank's checkpoint: its file, its digests (``sha256``, and ``blake3`` from format version 2),
    its size in bytes, its shard rows and steps, and the rows it trained on (``rows_seen``: train.json's,
    absent from trainings older than epoch_steps)."""

    rank: int
    path: str
    sha256: str | None = None
    blake3: str | None = None
    bytes: int | None = None
    rows: int | None = None
    num_steps: int | None = None
    rows_seen: int | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def digest(self, algorithm: str) -> str | None:
        """The digest this entry records for ``algorithm`` (shardfuse.io.HASH_ALGORITHMS)."""
        return getattr(self, algorithm, None)

    def digests(self) -> dict[str, str]:
        """{algorithm: digest} of every digest recorded."""
        return {name: value for name in ("sha256", "blake3") if (value := getattr(self, name)) is not None}

    def to_json(self) -> dict[str, Any]:
        return _json(self)


@dataclass(frozen=True)
class GatherRecord:
    """gather.json, field by field in the order the gather stage writes them."""

    run: str
    ranks: tuple[GatheredRank, ...]
    format_version: int | None = None  # absent: version 1 (sha256 digests only)
    hash: str | None = None  # the digest merge verifies (checksum_algorithm)
    world_size: int | None = None
    strategy: str | None = None
    model: dict[str, Any] | None = None  # the model spec training recorded
    base: str | None = None  # the shared initial weights' file
    num_parameters: int | None = None
    tensors: dict[str, Any] | None = None  # {name: {"shape", "dtype"}} every rank holds
    adapter: dict[str, Any] | None = None  # LoRA trainings: train.json's adapter entry
    base_tensors: dict[str, Any] | None = None  # LoRA trainings: the base's tensors (ranks hold factors)
    replicas: int | None = None  # fsdp > 1: one checkpoint per replica
    membership: dict[str, Any] | None = None  # which replica trained which shard, which ranks are alive
    # sha256 of the train split the training's shards were cut from (their manifest's source): a val or
    # test split another stage is given must be of the same prepared dataset; absent from older files
    dataset_sha256: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    # The order gather writes the keys in (the dataclass's puts the required fields first).
    ORDER = (
        "format_version", "hash", "run", "world_size", "strategy", "model", "base", "num_parameters",
        "tensors", "ranks", "adapter", "base_tensors", "replicas", "membership", "dataset_sha256",
    )  # fmt: skip

    @classmethod
    def from_json(
        cls,
        data: Any,
        source: str | os.PathLike = "gather.json",
        need: tuple[str, ...] = (),
        need_in_ranks: tuple[str, ...] = (),
    ) -> GatherRecord:
        """The record of a gather.json object; ``need`` and ``need_in_ranks`` name the entries of the file
        and of each rank the caller reads (``run`` and ``ranks`` always; each rank's ``rank``, ``path``
        and the digest ``hash`` names)."""
        source = str(source)
        values = _checked(cls, source, "", data, ("run", "ranks", *need))
        version = values.get("format_version") or 1
        if version > FORMAT_VERSION:
            raise UserError(
                f"{source} has format version {version}, newer than this shardfuse reads "
                f"({FORMAT_VERSION}); re-run gather with this version (snakemake -R gather)"
            )
        algorithm = values.get("hash") or "sha256"
        if algorithm not in HASH_ALGORITHMS:
            raise UserError(
                f"{source}: 'hash' is {algorithm!r}, not one of {', '.join(HASH_ALGORITHMS)}; {STALE}"
            )
        if not values["ranks"]:
            raise UserError(f"{source} lists no ranks; {STALE}")
        rank_need = ("rank", "path", *need_in_ranks, *((algorithm,) if "hash" in values else ()))
        ranks = []
        for index, entry in enumerate(values["ranks"]):
            known = _checked(GatheredRank, source, f"ranks[{index}].", entry, rank_need)
            ranks.append(GatheredRank(**known, extra={k: v for k, v in entry.items() if k not in known}))
        values["ranks"] = tuple(ranks)
        names = {f.name for f in fields(cls)}
        return cls(**values, extra={key: value for key, value in data.items() if key not in names})

    def to_json(self) -> dict[str, Any]:
        data = {name: getattr(self, name) for name in self.ORDER}
        data["ranks"] = [rank.to_json() for rank in self.ranks]
        return {**{key: value for key, value in data.items() if value is not None}, **self.extra}

    @property
    def checksum_algorithm(self) -> str:
        """The hash whose digest merge verifies for each rank: ``hash`` (format version 2: blake3);
        sha256 for a gather.json without one (version 1). The rank entry's field has its name."""
        return self.hash or "sha256"

    @property
    def adapted(self) -> bool:
        """The ranks hold LoRA factors over the shared base, not whole models."""
        return self.adapter is not None

    @property
    def rank_numbers(self) -> list[int]:
        return [rank.rank for rank in self.ranks]

    @property
    def rows(self) -> list[int]:
        """Each rank's shard rows (the caller asked for them: ``need_in_ranks=("rows",)``)."""
        return [int(rank.rows or 0) for rank in self.ranks]

    @property
    def rows_trained(self) -> list[int]:
        """What merge_method weighted weighs each rank by: the rows it trained on (cycled or stopped
        early as epoch_steps said), or a gather.json of an older training's shard rows. Over whole epochs
        of the default epoch_steps these are the shard rows times the epochs: the same weights."""
        if all(rank.rows_seen is not None for rank in self.ranks):
            return [int(rank.rows_seen) for rank in self.ranks]
        return self.rows

    @property
    def model_tensors(self) -> dict[str, Any]:
        """The whole model's tensors: the base's for an adapter training, the ranks' otherwise."""
        return self.base_tensors or self.tensors or {}

    def with_ranks(self, ranks: list[GatheredRank]) -> GatherRecord:
        """The same training with other rank entries (alignment's permuted copies)."""
        return replace(self, ranks=tuple(ranks))
