"""The merge stage's three paths, from a training's gather.json record to one merged file: the rank
checkpoints through the streaming engine (every method; aligned first where asked; a selecting method
such as greedy soup chooses its ranks on the validation split first), LoRA adapters fused in update
space, or a sharded DCP checkpoint consolidated. :func:`check_request` refuses a combination no path
takes, before anything is read; :func:`fuse` picks the path.

A library module for ``python -m shardfuse.merge`` (which reads gather.json, resolves the method's
parameters and writes merge.json around :func:`fuse`) and bench/merge.py; no command line. Every input's
digest is checked against gather.json on the very bytes merged, before the output is renamed into place;
anything raised leaves no output behind.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.checkpoints.dcp import ShardedCheckpoint
from shardfuse.checkpoints.gather_record import GatheredRank, GatherRecord
from shardfuse.checkpoints.stream import SafetensorsReader, SafetensorsWriter, file_order
from shardfuse.checkpoints.trust import (
    STALE,
    check_base_header,
    check_listed_digest,
    check_listed_header,
    open_listed,
    shapes_of,
)
from shardfuse.console.progress import StageProgress
from shardfuse.data.verify import check_dataset_of, check_split
from shardfuse.fusion.engine import BLOCK_BYTES, Engine, MemorySink
from shardfuse.fusion.methods.registry import Method, consolidating_names, tensor_params
from shardfuse.fusion.soup import Selection
from shardfuse.io import UserError, atomic_path, read_json

METADATA_KEY = "shardfuse"  # as shardfuse.checkpoints.weights (not imported: it would import torch)


class Fused(NamedTuple):
    """What one merge path wrote: the output's sha256, per-tensor statistics, and the fields of
    merge.json (shardfuse.experiment.records.MergeRecord) that say what went in (ingredients, base,
    weights, the selection under the method's name, alignment, adapter, or dcp)."""

    sha256: str
    tensor_stats: dict[str, dict[str, Any]]
    inputs: dict[str, Any]


def check_request(
    gather_path: Path,
    gather: GatherRecord,
    method: Method,
    *,
    val_split: Path | None,
    dcp_dir: Path | None,
    align: str,
    recalibrate: bool,
) -> None:
    """Refuse, before anything is read, what no merge path does: DCP input to another method than
    consolidate, a selecting method without the validation split (or with another file in its place),
    a model spec that does not fit the tensors (the selecting methods build the model), alignment of
    identical ranks, and what LoRA adapters cannot take."""
    name = method.name
    if dcp_dir is not None and not method.consolidates:
        raise UserError(
            "--dcp-dir consolidates a sharded checkpoint: use it with --method "
            f"{' or '.join(consolidating_names())}, not {name}"
        )
    if method.uses_val and val_split is None:
        raise UserError(
            f"{name} ranks the ranks by their held-out score and needs --val-split PATH (the dataset's "
            "val.parquet; never the test split)"
        )
    if val_split is not None and (method.uses_val or recalibrate):
        check_split(val_split, "val")  # the validation split prepare wrote (never the test split)
        check_dataset_of(val_split, "val", gather.dataset_sha256)  # of the training's own dataset
    if method.uses_val:
        from shardfuse.models.registry import check_model_fits  # deferred: imports torch

        check_model_fits(str(gather_path), gather.model, shapes_of(gather.tensors), STALE)
    if align != "none" and (dcp_dir is not None or method.consolidates):
        raise UserError(
            f"merge_align {align} permutes ranks that differ; {name} (identical ranks) takes none"
        )
    if gather.adapted and (align != "none" or dcp_dir is not None or recalibrate):
        raise UserError(
            "LoRA adapters are fused in update space over their shared frozen base: merge_align, "
            "--dcp-dir and merge_recalibrate do not apply; leave them out"
        )


def fuse(
    gather: GatherRecord,
    method: Method,
    params: dict[str, Any],
    weights: list[float] | None,
    out_weights: Path,
    *,
    val_split: Path | None = None,
    batch_size: int = 4096,
    dcp_dir: Path | None = None,
    block_bytes: int = BLOCK_BYTES,
    align: str = "none",
    align_max_iter: int = 100,
) -> Fused:
    """Write the merged weights by the path that fits the training (checked by :func:`check_request`):
    LoRA adapters, a DCP checkpoint, or the rank files (aligned to rank 0 first with
    ``align: weight_matching``, :mod:`shardfuse.fusion.align`)."""
    out_weights.parent.mkdir(parents=True, exist_ok=True)
    if gather.adapted:
        return merge_adapter_files(gather, method.name, params, weights, out_weights, block_bytes=block_bytes)
    if dcp_dir is not None:
        return merge_from_dcp(dcp_dir, gather, method.name, params, out_weights)
    alignment = None
    with tempfile.TemporaryDirectory(prefix=".align-", dir=out_weights.parent) as work:
        engine_gather = gather
        if align == "weight_matching":
            from shardfuse.fusion.align import align_gather  # deferred: imports torch and scipy

            engine_gather, alignment = align_gather(gather, gather.model or {}, Path(work), align_max_iter)
        fused = merge_rank_files(
            engine_gather,
            method,
            params,
            weights,
            out_weights,
            val_split=val_split,
            batch_size=batch_size,
            block_bytes=block_bytes,
        )
    if alignment is None:
        return fused
    # merge.json names the files gather.json lists, with their digests, not the aligned copies.
    return fused._replace(
        inputs={**fused.inputs, "ingredients": _ingredients(gather.ranks), "alignment": alignment}
    )


def _merged_metadata(first: SafetensorsReader, method: str, params: dict[str, Any]) -> dict[str, str]:
    raw = first.metadata.get(METADATA_KEY)
    if raw is None:
        raise UserError(f"checkpoint {first.path} has no shardfuse metadata; point at a shardfuse checkpoint")
    metadata = {**json.loads(raw), "rank": None, "merge_method": method, "merge_params": params}
    return {METADATA_KEY: json.dumps(metadata, sort_keys=True)}


def _base_sha256(base: SafetensorsReader) -> str:
    digest = base.sha256()
    sidecar = base.path.with_suffix(".json")
    if sidecar.is_file() and read_json(sidecar, "base sidecar").get("sha256") not in (None, digest):
        raise UserError(
            f"base checkpoint {base.path} does not match the sha256 in {sidecar} (changed after "
            "training); re-run training (snakemake -R train)"
        )
    return digest


def _open_base(
    stack: contextlib.ExitStack, gather: GatherRecord, tensors: dict[str, Any]
) -> SafetensorsReader:
    """The base gather.json names, its header naming the training and holding ``tensors``."""
    base = stack.enter_context(open_listed(Path(gather.base), None, "base"))
    check_base_header(base.path, json.loads(base.metadata.get(METADATA_KEY) or "{}"), gather.run)
    check_listed_header(base, tensors, "base")
    return base


def _write(out_weights: Path, entries: dict, metadata: dict[str, str], fill) -> tuple[str, Any]:
    """Write ``out_weights`` atomically; ``fill(writer)`` streams the tensors and returns a result.
    Anything ``fill`` raises (a checksum mismatch included) leaves no output behind."""
    with atomic_path(out_weights) as tmp:
        writer = SafetensorsWriter(tmp, entries, metadata)
        try:
            result = fill(writer)
        except BaseException:
            writer.discard()
            raise
        return writer.close(), result


def _ingredients(ranks: tuple[GatheredRank, ...]) -> list[dict[str, Any]]:
    """merge.json's ingredients: each rank with the digests gather.json records, each under its
    algorithm's name, and its rows."""
    return [{"rank": r.rank, "path": r.path, **r.digests(), "rows": int(r.rows or 0)} for r in ranks]


def _select(
    method: Method,
    readers: list[SafetensorsReader],
    gather: GatherRecord,
    params: dict[str, Any],
    val_split: Path,
    batch_size: int,
    block_bytes: int,
) -> Selection:
    """Run the method's selection: candidates merged in memory by the method's own plan, one at a
    time, scored on the validation split by the shared scorer."""
    from shardfuse.scoring.scorer import Scorer  # deferred: imports torch
    from shardfuse.scoring.split import load_split

    fix = f"{method.name} needs one — set the dataset's val_fraction > 0 (e.g. 0.1)"
    split = load_split(val_split, "val").require_rows("validation", fix)
    scorer = Scorer(split, gather.model or {}, batch_size)
    rank_numbers = gather.rank_numbers
    tensors = readers[0].tensors
    names = file_order({name: (t.dtype.name, list(t.shape)) for name, t in tensors.items()})

    def merge_of(indices: list[int]) -> dict[str, Any]:
        sink = MemorySink(tensors)
        chosen = [readers[i] for i in indices]
        Engine(
            chosen, None, method.name, params, [rank_numbers[i] for i in indices], block_bytes=block_bytes
        ).run(names, sink)
        return sink.tensors_for_torch()

    return method.select(rank_numbers, merge_of, scorer)


def merge_rank_files(
    gather: GatherRecord,
    method: Method,
    params: dict[str, Any],
    weights: list[float] | None,
    out_weights: Path,
    *,
    val_split: Path | None,
    batch_size: int,
    block_bytes: int,
) -> Fused:
    """Stream the rank checkpoints gather.json lists (and the base, for task-vector methods) through
    the engine; every input's digest is checked against gather.json before the output is in place."""
    rank_numbers = gather.rank_numbers
    what = [f"rank {number}" for number in rank_numbers]
    algorithm = gather.checksum_algorithm
    inputs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        readers = [
            stack.enter_context(open_listed(Path(r.path), r.bytes, label, algorithm))
            for r, label in zip(gather.ranks, what, strict=True)
        ]
        for reader, label in zip(readers, what, strict=True):
            check_listed_header(reader, gather.tensors, label)
        base = _open_base(stack, gather, gather.tensors) if method.uses_base else None
        metadata = _merged_metadata(readers[0], method.name, params)
        selected = list(range(len(readers)))
        if method.select is not None:
            selection = _select(method, readers, gather, params, Path(val_split), batch_size, block_bytes)
            selected = selection.indices
            inputs[method.name] = selection.record
            inputs["weights"] = selection.weights
        engine = Engine(
            [readers[i] for i in selected],
            base,
            method.name,
            params,
            [rank_numbers[i] for i in selected],
            weights,
            block_bytes,
        )
        if engine.table is not None:  # parameters given per layer or per tensor
            inputs["per_tensor_params"] = engine.table.summary()
        entries = {name: (t.dtype.name, list(t.shape)) for name, t in readers[0].tensors.items()}

        def fill(writer: SafetensorsWriter) -> dict:
            total = sum(readers[0].tensors[name].numel for name in writer.names)
            # "merge <run>" (the workflow's output is results/runs/<run>/merged.safetensors)
            with StageProgress(f"merge {out_weights.parent.name}", total, "parameters") as progress:
                stats = engine.run(writer.names, writer, progress.advance)
            for reader, r, label in zip(readers, gather.ranks, what, strict=True):
                check_listed_digest(reader, r, label)
            if base is not None:
                inputs["base"] = {"path": str(base.path), "sha256": _base_sha256(base)}
            return stats

        digest, stats = _write(out_weights, entries, metadata, fill)
    # Each ingredient with the digests gather.json records, each under its algorithm's name; merge.json's
    # ``hash`` names the one checked against the merged bytes.
    inputs["hash"] = algorithm
    inputs["ingredients"] = _ingredients(gather.ranks)
    return Fused(digest, stats, inputs)


def merge_adapter_files(
    gather: GatherRecord,
    method: str,
    params: dict[str, Any],
    weights: list[float] | None,
    out_weights: Path,
    *,
    block_bytes: int,
) -> Fused:
    """Fuse the LoRA adapters gather.json lists in update space: merged W = W0 + M(ΔW_1..ΔW_N) for each
    adapted module (``shardfuse.fusion.lora``), the base's other tensors as they are; the output is a
    whole model in the base's layout. The factors (small) are read whole, the base one tensor at a
    time as it is written; every input's digest is checked before the output is in place."""
    from shardfuse.fusion import lora  # the adapter path only

    adapter = gather.adapter
    factors = lora.read_rank_factors(gather)  # each file's size, header and digest checked
    # The merge engine resolves parameters given per layer or per tensor (and warns); this is merge.json's
    # summary of them.
    names = list(lora.update_tensors(factors))
    table = tensor_params(method, params, names, len(factors), warn=False)
    with contextlib.ExitStack() as stack:
        base = _open_base(stack, gather, gather.base_tensors)
        base_meta = json.loads(base.metadata[METADATA_KEY])
        metadata = {**base_meta, "merge_method": method, "merge_params": params}
        metadata["merged_adapter"] = {k: adapter[k] for k in ("type", "r", "alpha", "targets", "base_sha256")}
        entries = {name: (t.dtype.name, list(t.shape)) for name, t in base.tensors.items()}
        stats: dict[str, dict[str, Any]] = {}

        def fill(writer: SafetensorsWriter) -> None:
            tensors = lora.BaseTensors(base, writer.names)
            options = {"rank_numbers": gather.rank_numbers, "weights": weights, "block_bytes": block_bytes}
            for tensor in lora.merge_model(method, params, tensors, factors, **options):
                writer.write(tensor.name, lora.encode_tensor(tensor.weight, entries[tensor.name][0]))
                if tensor.merged is not None:
                    stats[tensor.name] = tensor.merged.stats
            if _base_sha256(base) != adapter.get("base_sha256"):
                raise UserError(
                    f"base checkpoint {base.path} is not the base the adapters were trained on (its sha256 "
                    "differs from their header's base_sha256); re-run training (snakemake -R train)"
                )

        digest, _ = _write(out_weights, entries, {METADATA_KEY: json.dumps(metadata, sort_keys=True)}, fill)
    inputs = {
        "hash": gather.checksum_algorithm,
        "base": {"path": str(base.path), "sha256": adapter["base_sha256"]},
        "ingredients": _ingredients(gather.ranks),
        "adapter": {k: adapter[k] for k in ("type", "r", "alpha", "init") if k in adapter},
    }
    if table is not None:
        inputs["per_tensor_params"] = table.summary()
    return Fused(digest, stats, inputs)


def merge_from_dcp(
    dcp_dir: Path, gather: GatherRecord, method: str, params: dict[str, Any], out_weights: Path
) -> Fused:
    """Consolidate a sharded torch.distributed.checkpoint (safetensors format) into one file; the
    rank files only lend the metadata. DCP entries that are not model tensors are skipped."""
    with SafetensorsReader(Path(gather.ranks[0].path)) as first:
        metadata = _merged_metadata(first, method, params)
    with ShardedCheckpoint(dcp_dir) as checkpoint:
        wanted = gather.tensors
        for name, expected in wanted.items():
            found = checkpoint.shapes.get(name)
            if found is None or [found[0], found[1]] != [expected["dtype"], expected["shape"]]:
                what = "lacks" if found is None else f"has {found[0]}{found[1]} for"
                raise UserError(
                    f"DCP checkpoint {dcp_dir} {what} tensor {name!r} (the model has "
                    f"{expected['dtype']}{expected['shape']}); consolidate the checkpoint of this run"
                )
        entries = {name: (t["dtype"], t["shape"]) for name, t in wanted.items()}

        def fill(writer: SafetensorsWriter) -> None:
            for name in writer.names:
                writer.write(name, checkpoint.assemble(name).reshape(-1).view(np.uint8))

        digest, _ = _write(out_weights, entries, metadata, fill)
        files = [{"path": str(r.path), "sha256": r.sha256(), "bytes": r.size} for r in checkpoint.readers]
        skipped = sorted(set(checkpoint.shapes) - set(wanted))
    dcp = {"dir": str(dcp_dir), "files": files, "skipped_tensors": skipped}
    return Fused(digest, {}, {"ingredients": [], "dcp": dcp, "weights": None})
