"""Permutation alignment before a merge: weight matching (Ainsworth et al. 2022, "Git Re-Basin").

A library module for the merge stage. Hidden units of a network can be permuted without changing its
function; ranks that did not start from the same weights (``init: per_rank``) learn the same features
in different orders, and averaging them then mixes unrelated units. ``merge_align: weight_matching``
permutes every rank's hidden units to match rank 0's before the merge method runs (rank 0 is the
reference, never permuted; aligning to rank 0 rather than to an iterated running average keeps the
result independent of rank order beyond the reference, and costs one pass per rank).

**Permutation groups.** A group is a set of hidden units and every (tensor, axis) they index:
``{group: [(tensor name, axis), ...]}``. The built-in ``mlp`` (each hidden layer: its Linear's weight
rows and bias, the next Linear's weight columns) and ``cnn`` (each conv stage: its conv's output
channels and bias, its BatchNorm's weight, bias and running statistics, the next conv's input channels
or the head's columns) name theirs in their catalog records (shardfuse.models.catalog: a function beside
the factory). A user model declares its own with a method
``permutation_groups(self) -> dict[str, list[tuple[str, int]]]`` naming its own state-dict keys (the
framework adds its ``model.`` prefix); a model without it cannot be aligned (one-line error).

**Weight matching**, for one rank B against reference A: start from the identity; for each group in
turn, the cost ``C[i, j] = sum over its (tensor, axis) of <A's slice i, B's slice j>`` (B's other axes
already permuted by the other groups' current permutations) is maximised by a linear assignment
(``scipy.optimize.linear_sum_assignment``); repeat over all groups until a full sweep changes nothing
(at most ``max_iter`` sweeps). A rank whose permutations all come out the identity is merged from its
original file, so shared-initialisation ranks merge bitwise as without alignment.

**Memory.** Alignment needs whole models: the reference and one rank at a time are in memory (two
models), unlike the merge itself, which streams block by block.
"""

from __future__ import annotations

import hashlib
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from shardfuse.checkpoints.gather_record import GatherRecord
from shardfuse.io import UserError, file_digests
from shardfuse.models.catalog import Groups, aligned_names, builtin, spoken
from shardfuse.models.spec import normalized_spec


def permutation_groups(model_spec: dict[str, Any], names: list[str]) -> Groups:
    """The model's permutation groups (a built-in's record names its function, a user model declares
    them), checked against ``names``."""
    model = normalized_spec(model_spec)["model"]
    record = builtin(model)
    aligned = record is not None and record.aligned
    groups = record.permutation_groups(names) if aligned else declared_groups(model_spec, model)
    missing = sorted({name for members in groups.values() for name, _ in members} - set(names))
    if missing:
        raise UserError(
            f"permutation groups of model {model!r} name tensor {missing[0]!r} that the checkpoint lacks; "
            "fix the model's permutation_groups() or set merge_align: none"
        )
    return groups


def declared_groups(model_spec: dict[str, Any], model: str) -> Groups:
    """A user model's own permutation groups (built on the meta device); none is a UserError."""
    from shardfuse.models.registry import build_model

    with torch.device("meta"):
        built = build_model(model_spec)
    inner = getattr(built, "model", built)
    declare = getattr(inner, "permutation_groups", None)
    if not callable(declare):
        raise UserError(
            f"merge_align weight_matching needs the model's permutation groups: the built-in "
            f"{spoken(aligned_names())} declare them, {model!r} does not; give it a permutation_groups() "
            "method (config/README.md, merge_align) or set merge_align: none"
        )
    prefix = "model." if inner is not built else ""
    return {
        group: [(prefix + name, int(axis)) for name, axis in members] for group, members in declare().items()
    }


def _permuted(
    tensor: torch.Tensor, name: str, axes: dict[str, list[tuple[str, int]]], perms, skip: str | None
):
    for group, axis in axes.get(name, []):
        if group != skip:
            tensor = tensor.index_select(axis, perms[group])
    return tensor


def _tensor_axes(groups: Groups) -> dict[str, list[tuple[str, int]]]:
    axes: dict[str, list[tuple[str, int]]] = {}
    for group, members in groups.items():
        for name, axis in members:
            axes.setdefault(name, []).append((group, axis))
    return axes


def weight_matching(
    reference: dict[str, torch.Tensor], other: dict[str, torch.Tensor], groups: Groups, max_iter: int = 100
) -> tuple[dict[str, torch.Tensor], int]:
    """Permutations (group -> index tensor: aligned = other.index_select(axis, perm)) that match
    ``other``'s units to ``reference``'s, and the sweeps it took."""
    from scipy.optimize import linear_sum_assignment

    axes = _tensor_axes(groups)
    sizes = {group: reference[members[0][0]].shape[members[0][1]] for group, members in groups.items()}
    perms = {group: torch.arange(size) for group, size in sizes.items()}
    ref = {name: reference[name].double() for name in axes}
    oth = {name: other[name].double() for name in axes}
    for sweep in range(1, max_iter + 1):
        changed = False
        for group in sorted(groups):
            size = sizes[group]
            cost = torch.zeros(size, size, dtype=torch.float64)
            for name, axis in groups[group]:
                a = ref[name].movedim(axis, 0).reshape(size, -1)
                b = _permuted(oth[name], name, axes, perms, skip=group).movedim(axis, 0).reshape(size, -1)
                cost += a @ b.T
            _, columns = linear_sum_assignment(cost.numpy(), maximize=True)
            candidate = torch.as_tensor(columns, dtype=torch.long)
            current = cost[torch.arange(size), perms[group]].sum()
            if cost[torch.arange(size), candidate].sum() > current + 1e-12 * max(1.0, abs(float(current))):
                perms[group], changed = candidate, True
        if not changed:
            return perms, sweep
    return perms, max_iter


def apply_permutations(
    tensors: dict[str, torch.Tensor], groups: Groups, perms: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    axes = _tensor_axes(groups)
    return {name: _permuted(t, name, axes, perms, skip=None).contiguous() for name, t in tensors.items()}


def is_identity(perms: dict[str, torch.Tensor]) -> bool:
    return all(bool(torch.equal(p, torch.arange(len(p)))) for p in perms.values())


def moved_units(perms: dict[str, torch.Tensor]) -> dict[str, int]:
    """Per group, how many units the permutation moves (0: identity)."""
    return {group: int((p != torch.arange(len(p))).sum()) for group, p in perms.items()}


def align_gather(
    gather: GatherRecord, model_spec: dict[str, Any], work_dir: Path, max_iter: int = 100
) -> tuple[GatherRecord, dict[str, Any]]:
    """Align every rank gather.json lists to its first rank. Returns the gather record for the merge engine
    (aligned ranks point at files in ``work_dir``; identity-aligned ranks keep their own file) and the
    record for merge.json. Each original file's sha256 is checked against gather.json as it is read."""
    from safetensors import safe_open
    from safetensors.torch import load

    from shardfuse.checkpoints.weights import write_safetensors

    ranks = gather.ranks
    first = _read_checked(Path(ranks[0].path), ranks[0].sha256, f"rank {ranks[0].rank}")
    reference = load(first)
    groups = permutation_groups(model_spec, sorted(reference))
    engine_ranks, record_ranks = [ranks[0]], []
    for entry in ranks[1:]:
        path = Path(entry.path)
        tensors = load(_read_checked(path, entry.sha256, f"rank {entry.rank}"))
        perms, sweeps = weight_matching(reference, tensors, groups, max_iter)
        moved = moved_units(perms)
        record_ranks.append({"rank": entry.rank, "sweeps": sweeps, "moved_units": moved})
        if is_identity(perms):
            engine_ranks.append(entry)
            continue
        with safe_open(str(path), framework="pt") as handle:
            metadata = handle.metadata()
        aligned = work_dir / f"aligned-rank-{entry.rank}.safetensors"
        write_safetensors(apply_permutations(tensors, groups, perms), aligned, metadata)
        digests = file_digests(aligned, tuple(entry.digests()))  # the copy's, as gather records the files'
        engine_ranks.append(replace(entry, **digests, path=str(aligned), bytes=aligned.stat().st_size))
    record = {
        "method": "weight_matching",
        "reference_rank": ranks[0].rank,
        "groups": {group: len(members) for group, members in groups.items()},
        "ranks": record_ranks,
    }
    return gather.with_ranks(engine_ranks), record


def _read_checked(path: Path, expected: str, label: str) -> bytes:
    data = path.read_bytes()
    if hashlib.sha256(data).hexdigest() != expected:
        raise UserError(f"{label}: {path} changed since gather; re-run gather (snakemake -R gather)")
    return data
