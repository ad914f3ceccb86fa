"""Trust nothing we did not write: the checkpoints gather.json lists, and the model a checkpoint's header
describes, are checked before any tensor is read or any model is built.

A library module: merge, evaluate and the track stage read gather.json through :func:`read_gather`, which
returns its typed record (shardfuse.checkpoints.gather_record); no command line. By hand::

    python -c "import shardfuse.checkpoints.trust as t; \\
        print(t.read_gather('results/trainings/<training>/gather.json', base=True).ranks)"

gather.json is a plain file. Edited by hand, stale or copied, it could send merge and evaluate to any
file, with a sha256 to match (whoever edits it can recompute one), and they would "succeed" with
another model. So each checkpoint it lists (the ranks; the base where present, and it must be present
where a stage reads it) must

- lie inside the training directory, the directory that holds gather.json, symlinks resolved (the
  layout: ``results/trainings/<training>/{gather.json,ranks/base.safetensors,ranks/rank-<r>.safetensors}``);
- be listed once (same resolved file, hard links included);
- be safetensors whose shardfuse header names the training gather.json names, the rank of its place
  in gather.json (the base: none) and, where both say, the same world size.

Only headers are read (no torch, no tensor data); merge still checks every input's checksum against
gather.json on the bytes it merges: the digest ``hash`` names (``GatherRecord.checksum_algorithm``; BLAKE3
from format version 2 on), sha256 in a gather.json without ``format_version``.

A header's model spec is checked against the header's tensors before a model is built
(:func:`check_spec_bounds` here, torch-free: the exact state dict of the built-in mlp, and for the other
built-ins no size argument beyond what the file holds; ``shardfuse.models.registry.check_model_fits`` adds a
build on torch's meta device, which allocates no tensor memory). The reader checks that the header's
tensors cover the file exactly, so a model whose state dict matches them is no larger than the file: a
spec saying ``hidden_sizes: [2e9]`` is refused, never allocated.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.gather_record import STALE, GatheredRank, GatherRecord
from shardfuse.checkpoints.stream import InvalidSafetensors, SafetensorsReader
from shardfuse.cluster.membership import Membership
from shardfuse.io import UserError, read_json

METADATA_KEY = "shardfuse"  # as shardfuse.checkpoints.weights (not imported: keep this module light)
RERUN_TRAIN = "re-run training (snakemake -R train)"
RERUN_MERGE = "re-run merge (snakemake -R merge)"
RERUN_GATHER = "re-run gather (snakemake -R gather)"

Shapes = dict[str, tuple[int, ...]]


# ---------------------------------------------------------------- gather.json


def read_gather(
    gather_path: str | os.PathLike,
    *,
    base: bool = False,
    need: tuple[str, ...] = (),
    need_in_ranks: tuple[str, ...] = (),
) -> GatherRecord:
    """gather.json's record, once every checkpoint it lists is known to be this training's (see the
    module docstring). ``base``: the caller reads the base, so gather.json must name one. ``need`` and
    ``need_in_ranks``: the entries of gather.json and of each rank that the caller reads."""
    gather_path = Path(gather_path)
    gather = GatherRecord.from_json(
        read_json(gather_path, "gather record"), gather_path, need=need, need_in_ranks=need_in_ranks
    )
    numbers = gather.rank_numbers
    for number in numbers:
        if number < 0 or numbers.count(number) > 1:
            what = "a negative rank" if number < 0 else "twice"
            raise UserError(f"{gather_path} lists rank {number} {what}; {STALE}")
    world_size = gather.world_size
    replicas = gather.replicas if gather.replicas is not None else world_size  # fsdp > 1: one per replica
    alive = None  # after a rank lost for good: the replicas that published (shardfuse.rank.loss)
    if gather.membership is not None:
        alive = Membership.from_json(gather.membership, str(gather_path), STALE).alive_replicas
    if alive is not None and len(alive) != (replicas or 0):
        if sorted(numbers) != list(alive):
            raise UserError(
                f"{gather_path} lists ranks {sorted(numbers)} but its membership has ranks {list(alive)} "
                f"alive; {STALE}"
            )
        min_ranks = gather.membership.get("min_ranks")
        if isinstance(min_ranks, int) and len(alive) < min_ranks:
            raise UserError(
                f"{gather_path} lists {len(alive)} surviving rank(s) but the training went on only with "
                f"min_ranks {min_ranks}; {STALE}"
            )
    elif world_size is not None and replicas != len(gather.ranks):
        what = f"{replicas} replicas of world size" if replicas != world_size else "world size"
        raise UserError(f"{gather_path} lists {len(gather.ranks)} ranks for {what} {world_size}; {STALE}")
    if base and not gather.base:
        raise UserError(f"{gather_path} names no base checkpoint ('base' is missing, null or empty); {STALE}")
    entries: list[tuple[str, str, int | None]] = [
        (f"rank {entry.rank}", entry.path, entry.rank) for entry in gather.ranks
    ]
    if gather.base:
        entries.append(("the base", gather.base, None))
    training_dir = gather_path.absolute().parent.resolve()
    seen: dict[tuple[int, int], str] = {}
    for label, path, rank in entries:
        _check_entry(gather_path, training_dir, label, path, rank, gather, seen)
    return gather


def open_listed(
    path: Path, expected_bytes: int | None, what: str, hash_algorithm: str = "sha256"
) -> SafetensorsReader:
    """A checkpoint gather.json lists, opened for hashed reads once its size is the one recorded."""
    if not path.is_file() or (expected_bytes is not None and path.stat().st_size != expected_bytes):
        raise UserError(f"{what}: {path} is missing or changed since gather; {RERUN_GATHER}")
    return SafetensorsReader(path, hash_algorithm=hash_algorithm)


def check_listed_digest(reader: SafetensorsReader, entry: GatheredRank, what: str) -> None:
    """The rank file's bytes, as read, must match the digest its gather.json entry records for the
    reader's algorithm (alignment's permuted copies carry their own digests: shardfuse.fusion.align)."""
    if reader.hexdigest() != entry.digest(reader.hash_algorithm):
        raise UserError(f"{what}: {entry.path} is missing or changed since gather; {RERUN_GATHER}")


def check_listed_header(reader: SafetensorsReader, expected: dict[str, Any], what: str) -> None:
    if reader.header() != expected:
        raise UserError(
            f"{what}: {reader.path} does not hold the tensors gather.json records; {RERUN_GATHER}"
        )


def check_base_header(path: str | os.PathLike, metadata: dict[str, Any], run: str) -> None:
    """The base checkpoint's header names the training (train.json's, gather.json's ``run``) and no rank:
    a base copied in from another training, or a rank's file, is refused where re-running training is
    the fix (gather, and merge for a base swapped after gather: re-running gather would not help)."""
    if metadata.get("run") != run or metadata.get("rank") is not None:
        said = "the base" if metadata.get("rank") is None else f"rank {metadata.get('rank')!r}"
        raise UserError(
            f"base checkpoint {path} is {said} of training {metadata.get('run')!r}, not the base of "
            f"{run!r} (train.json): it was replaced after training; {RERUN_TRAIN}"
        )


def _check_entry(
    gather_path: Path,
    training_dir: Path,
    label: str,
    path_text: str,
    rank: int | None,
    gather: GatherRecord,
    seen: dict[tuple[int, int], str],
) -> None:
    """One listed checkpoint: inside the training directory, listed once, its header naming the
    training and its rank (``rank`` None: the base)."""
    path = Path(path_text)
    resolved = path.resolve()
    shown = path_text if resolved == path.absolute() else f"{path_text} (a link to {resolved})"
    where = f"{label} in {gather_path} points at {shown}"
    if not resolved.is_relative_to(training_dir):
        shown_dir = gather_path.parent if str(gather_path.parent) != "." else training_dir
        raise UserError(
            f"{where}, which lies outside the training directory {shown_dir}: it is not a checkpoint "
            f"of this training; {STALE}"
        )
    if not resolved.is_file():
        raise UserError(f"{where}, which is not a file; {STALE}")
    status = resolved.stat()
    key = (status.st_dev, status.st_ino)
    if key in seen:
        raise UserError(f"{where}, the file {seen[key]} points at too; {STALE}")
    seen[key] = label
    try:
        metadata = checkpoint_metadata(resolved)
    except InvalidSafetensors as exc:
        raise UserError(f"{where}, which is not a safetensors checkpoint ({exc.reason}); {STALE}") from None
    except UserError:
        raise UserError(f"{where}, which cannot be read as a checkpoint; {STALE}") from None
    if metadata is None:
        raise UserError(
            f"{where}, which has no shardfuse header: it is not a checkpoint of this training; {STALE}"
        )
    said = metadata.get("run")
    if rank is None:  # the ranks (checked first) agree with gather.json: the base alone was swapped
        check_base_header(path, metadata, gather.run)
    if said != gather.run:
        raise UserError(f"{where}, whose header says training {said!r}, not {gather.run!r}; {STALE}")
    said = metadata.get("rank")
    if said != rank or isinstance(said, bool):
        if rank is None:
            says = f"rank {said!r}, not the base"
        elif said is None:
            says = f"it is the base, not rank {rank}"
        else:
            says = f"rank {said!r}"
        raise UserError(f"{where}, whose header says {says}; {STALE}")
    said, world_size = metadata.get("world_size"), gather.world_size
    if said is not None and world_size is not None and said != world_size:
        raise UserError(f"{where}, whose header says world size {said!r}, not {world_size}; {STALE}")


def checkpoint_metadata(path: str | os.PathLike) -> dict[str, Any] | None:
    """The shardfuse metadata in a safetensors header (None if it has none); reads the header only."""
    with SafetensorsReader(path, hash_reads=False) as reader:
        raw = reader.metadata.get(METADATA_KEY)
    if raw is None:
        return None
    try:
        metadata = json.loads(raw)
    except json.JSONDecodeError:
        return None
    return metadata if isinstance(metadata, dict) else None


def check_merged(path: str | os.PathLike, gather: GatherRecord) -> None:
    """The merged model evaluate scores must be a merge of gather.json's training (rank None)."""
    metadata = checkpoint_metadata(path)
    said_run = None if metadata is None else metadata.get("run")
    said_rank = None if metadata is None else metadata.get("rank")
    if metadata is None or said_run != gather.run or said_rank is not None:
        says = "no shardfuse header" if metadata is None else f"training {said_run!r}, rank {said_rank!r}"
        raise UserError(
            f"merged model {path} is not a merge of training {gather.run!r} (its header says {says}); "
            f"{RERUN_MERGE}"
        )


def check_merged_record(
    path: str | os.PathLike, record_path: str | os.PathLike, method: str | None, sha256: str | None
) -> None:
    """The merged model is the one its merge.json (``record_path``) describes: its sha256 is the one
    recorded (not another run's merged model copied over it, not an edited file) and its header's method
    is the record's (not a merge.json edited to another method). An older merge.json without a sha256
    is checked by the method alone."""
    from shardfuse.io import sha256_file

    metadata = checkpoint_metadata(path) or {}
    said = metadata.get("merge_method")
    if method is not None and said is not None and said != method:
        raise UserError(
            f"{record_path} says method {method!r} but {path} was merged with {said!r} (one of them was "
            f"edited or copied from another run); {RERUN_MERGE}"
        )
    if sha256 is not None and (found := sha256_file(path)) != sha256:
        raise UserError(
            f"{path} is not the merged model its {record_path} recorded (sha256 {sha256[:12]}… there, "
            f"{found[:12]}… here: another run's merged model, or an edited file); {RERUN_MERGE}"
        )


# ---------------------------------------------------------------- model specs against tensors


def header_spec(path: str | os.PathLike, rerun: str) -> tuple[dict[str, Any], Shapes]:
    """(model spec, tensor shapes) of a checkpoint, from its header alone."""
    with SafetensorsReader(path, hash_reads=False) as reader:
        shapes = {name: tuple(info.shape) for name, info in reader.tensors.items()}
    metadata = checkpoint_metadata(path)
    if metadata is None or not isinstance(metadata.get("model"), dict):
        raise UserError(f"checkpoint {path} has no model spec in its shardfuse header; {rerun}")
    return metadata["model"], shapes


def shapes_of(tensors: dict[str, dict[str, Any]]) -> Shapes:
    """Tensor shapes from gather.json's ``tensors`` ({name: {shape, dtype}})."""
    try:
        return {name: tuple(int(d) for d in entry["shape"]) for name, entry in tensors.items()}
    except (KeyError, TypeError, ValueError):
        raise UserError(f"gather.json's 'tensors' entry is malformed; {STALE}") from None
