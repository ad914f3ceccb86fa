"""Fuse a run's per-rank models into one, streaming block by block through the tensors.

By hand (as the merge rule runs it)::

    python -m shardfuse.merge --run <run> --gather results/trainings/<training>/gather.json \\
        --method ties --params-json '{"density": 0.2}' --val-split results/datasets/digits/val.parquet \\
        --out-weights results/runs/<run>/merged.safetensors --out-json results/runs/<run>/merge.json

Methods and their parameters: ``shardfuse.fusion.methods.registry`` (one record per method: its plan,
parameters and defaults). ``--val-split`` is read by greedy_soup and ``--recalibrate`` only, and
only the validation split prepare wrote is accepted (its rows and sha256 must be the sibling
dataset.json's val entry; the test split is named as such and refused). ``--dcp-dir DIR``
(consolidate only) builds the output from a sharded
torch.distributed.checkpoint saved in DCP's safetensors format instead of the rank files; DCP's
default format stores its index as a pickle and is refused (see ``ShardedCheckpoint``). ``--run``
names the run in merge.json when several runs fuse one training. The two paths are
``merge_rank_files`` (every method) and ``merge_from_dcp``; ``merge`` checks the arguments and writes
merge.json around either.

Memory: the engine (``shardfuse.fusion.engine``) reads every input with explicit reads (no mmap, see
safetensors_stream) in blocks of at most BLOCK_BYTES of float64 across all ranks and writes the output
block by block, so peak memory is a few blocks plus the interpreter, whatever the number of ranks or
the model size. Exceptions: the TIES scan holds one rank's float64 magnitudes of one tensor; greedy
soup holds one candidate model (and the copy its evaluation makes). Two worker threads read and hash a
few blocks ahead of the math, and do the math too when it is a plain mean (uniform, greedy soup).

Trust: before anything is read, every checkpoint gather.json lists must lie inside the training
directory, be listed once, and carry in its header the training and rank of its place in gather.json
(shardfuse.checkpoints.trust.read_gather); greedy soup, the one method that builds the model, first checks
that the model gather.json describes fits the tensors (shardfuse.models.registry.check_model_fits).

Checksums: each ingredient's digest (BLAKE3 from gather.json format version 2 on, sha256 before:
``shardfuse.checkpoints.trust.checksum_algorithm``) is computed by the worker threads from the very bytes that
are merged and compared with gather.json before the output is renamed into place: one read per file, and
no window between check and use. merge.json's ``hash`` names the algorithm checked; its ingredients
carry gather.json's digests, each under its algorithm's name. The base (shared initial weights) is
checked against the sha256 of its sidecar base.json.
"""

from __future__ import annotations

import contextlib
import json
import math
import resource
import tempfile
import time
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.checkpoints.stream import SafetensorsReader, SafetensorsWriter, ShardedCheckpoint
from shardfuse.checkpoints.trust import (
    STALE,
    check_base_header,
    check_listed_digest,
    check_listed_header,
    checksum_algorithm,
    open_listed,
    read_gather,
    shapes_of,
)
from shardfuse.data.verify import check_split
from shardfuse.experiment.records import MergeRecord
from shardfuse.fusion.engine import BLOCK_BYTES, Engine
from shardfuse.fusion.methods.registry import METHODS, USES_BASE, USES_VAL, rank_weights, resolve_params
from shardfuse.fusion.soup import greedy_soup
from shardfuse.io import (
    HASH_ALGORITHMS,
    StageParser,
    UserError,
    atomic_path,
    parse_json_arg,
    read_json,
    refuse_shared_outputs,
    run_cli,
    write_json,
)
from shardfuse.models.usercode import check_code_unchanged

METADATA_KEY = "shardfuse"  # as shardfuse.checkpoints.weights (not imported: it would import torch)


# ---------------------------------------------------------------- inputs and checks


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


def peak_rss_mb() -> float:
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


# ---------------------------------------------------------------- the stage


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


class Fused(NamedTuple):
    """What one merge path wrote: the output's sha256, per-tensor statistics, and the fields of
    merge.json (:class:`MergeRecord`) that say what went in (ingredients, base, weights, greedy_soup, or
    dcp)."""

    sha256: str
    tensor_stats: dict[str, dict[str, Any]]
    inputs: dict[str, Any]


def merge_rank_files(
    info: dict[str, Any],
    method: str,
    params: dict[str, Any],
    weights: list[float] | None,
    out_weights: Path,
    *,
    val_split: Path | None,
    batch_size: int,
    block_bytes: int,
) -> Fused:
    """Stream the rank checkpoints gather.json lists (and the base, for task-vector methods) through
    the engine; every input's sha256 is checked against gather.json before the output is in place."""
    ranks = info["ranks"]
    rank_numbers = [int(r["rank"]) for r in ranks]
    what = [f"rank {number}" for number in rank_numbers]
    algorithm = checksum_algorithm(info)
    inputs: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        readers = [
            stack.enter_context(open_listed(Path(r["path"]), r.get("bytes"), label, algorithm))
            for r, label in zip(ranks, what, strict=True)
        ]
        for reader, label in zip(readers, what, strict=True):
            check_listed_header(reader, info["tensors"], label)
        base = None
        if method in USES_BASE:
            base = stack.enter_context(open_listed(Path(info["base"]), None, "base"))
            check_base_header(base.path, json.loads(base.metadata.get(METADATA_KEY) or "{}"), info["run"])
            check_listed_header(base, info["tensors"], "base")
        metadata = _merged_metadata(readers[0], method, params)
        selected = list(range(len(readers)))
        if method == "greedy_soup":
            soup = greedy_soup(readers, rank_numbers, info["model"], Path(val_split), batch_size, block_bytes)
            selected = [rank_numbers.index(number) for number in soup["selected"]]
            inputs["greedy_soup"] = soup
            inputs["weights"] = [1 / len(selected) if i in selected else 0.0 for i in range(len(readers))]
        engine = Engine(
            [readers[i] for i in selected],
            base,
            method,
            params,
            [rank_numbers[i] for i in selected],
            weights,
            block_bytes,
        )
        entries = {name: (t.dtype.name, list(t.shape)) for name, t in readers[0].tensors.items()}

        def fill(writer: SafetensorsWriter) -> dict:
            stats = engine.run(writer.names, writer)
            for reader, r, label in zip(readers, ranks, what, strict=True):
                check_listed_digest(reader, r, label)
            if base is not None:
                inputs["base"] = {"path": str(base.path), "sha256": _base_sha256(base)}
            return stats

        digest, stats = _write(out_weights, entries, metadata, fill)
    # Each ingredient with the digests gather.json records, each under its algorithm's name; merge.json's
    # ``hash`` names the one checked against the merged bytes.
    inputs["hash"] = algorithm
    inputs["ingredients"] = _ingredients(ranks)
    return Fused(digest, stats, inputs)


def _ingredients(ranks: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """merge.json's ingredients: each rank with the digests gather.json records, each under its
    algorithm's name, and its rows."""
    return [
        {
            "rank": int(r["rank"]),
            "path": r["path"],
            **{a: r[a] for a in HASH_ALGORITHMS if a in r},
            "rows": int(r["rows"]),
        }
        for r in ranks
    ]


def merge_adapter_files(
    info: dict[str, Any],
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

    adapter, ranks = info["adapter"], info["ranks"]
    rank_numbers = [int(r["rank"]) for r in ranks]
    factors = lora.read_rank_factors(info)  # each file's size, header and digest checked
    with open_listed(Path(info["base"]), None, "base") as base:
        check_base_header(base.path, json.loads(base.metadata.get(METADATA_KEY) or "{}"), info["run"])
        check_listed_header(base, info["base_tensors"], "base")
        base_meta = json.loads(base.metadata[METADATA_KEY])
        metadata = {**base_meta, "merge_method": method, "merge_params": params}
        metadata["merged_adapter"] = {k: adapter[k] for k in ("type", "r", "alpha", "targets", "base_sha256")}
        entries = {name: (t.dtype.name, list(t.shape)) for name, t in base.tensors.items()}
        stats: dict[str, dict[str, Any]] = {}

        def fill(writer: SafetensorsWriter) -> None:
            tensors = lora.BaseTensors(base, writer.names)
            options = {"rank_numbers": rank_numbers, "weights": weights, "block_bytes": block_bytes}
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
        "hash": checksum_algorithm(info),
        "base": {"path": str(base.path), "sha256": adapter["base_sha256"]},
        "ingredients": _ingredients(ranks),
        "adapter": {k: adapter[k] for k in ("type", "r", "alpha", "init") if k in adapter},
    }
    return Fused(digest, stats, inputs)


def merge_from_dcp(
    dcp_dir: Path, info: dict[str, Any], method: str, params: dict[str, Any], out_weights: Path
) -> Fused:
    """Consolidate a sharded torch.distributed.checkpoint (safetensors format) into one file; the
    rank files only lend the metadata. DCP entries that are not model tensors are skipped."""
    with SafetensorsReader(Path(info["ranks"][0]["path"])) as first:
        metadata = _merged_metadata(first, method, params)
    with ShardedCheckpoint(dcp_dir) as checkpoint:
        wanted = info["tensors"]
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


def merge(
    gather_path: Path,
    method: str,
    out_weights: Path,
    out_json: Path,
    params: dict[str, Any] | None = None,
    *,
    val_split: Path | None = None,
    batch_size: int = 4096,
    dcp_dir: Path | None = None,
    run: str | None = None,
    block_bytes: int = BLOCK_BYTES,
    align: str = "none",
    align_max_iter: int = 100,
    recalibrate: bool = False,
) -> MergeRecord:
    """Merge the ranks listed in gather.json with ``method`` (after aligning them to rank 0 with
    ``align: weight_matching``, :mod:`shardfuse.fusion.align`); write the weights and merge.json."""
    started = time.perf_counter()
    info = read_gather(
        gather_path,
        base=method in USES_BASE and dcp_dir is None,
        need=("tensors", "model") if method in USES_VAL else ("tensors",),
        need_in_ranks=("sha256", "rows"),
    )
    if info.get("adapter") is not None:
        from shardfuse.fusion.lora import refuse_unless_on_updates

        refuse_unless_on_updates(method)  # before anything else reads the adapters as whole models
    spec = info.get("model") if isinstance(info.get("model"), dict) else {}
    # The tensors are merged by name, whatever network they belong to; but a merged file whose model
    # code changed since training would be rebuilt as another network by every later stage.
    check_code_unchanged(spec.get("model", "mlp"), spec.get("code"), "merge")
    rows = [int(r["rows"]) for r in info["ranks"]]
    resolved = resolve_params(method, params, rows)
    if dcp_dir is not None and method != "consolidate":
        raise UserError(
            f"--dcp-dir consolidates a sharded checkpoint: use it with --method consolidate, not {method}"
        )
    if method in USES_VAL and val_split is None:
        raise UserError(
            f"{method} ranks the ranks by their held-out score and needs --val-split PATH (the dataset's "
            "val.parquet; never the test split)"
        )
    if val_split is not None and (method in USES_VAL or recalibrate):
        check_split(val_split, "val")  # the validation split prepare wrote (never the test split)
    if method in USES_VAL:
        from shardfuse.models.registry import check_model_fits  # deferred: imports torch

        check_model_fits(str(gather_path), info["model"], shapes_of(info["tensors"]), STALE)
    weights = rank_weights(method, resolved, rows)
    if align != "none" and (dcp_dir is not None or method == "consolidate"):
        raise UserError(
            f"merge_align {align} permutes ranks that differ; consolidate (identical ranks) takes none"
        )
    alignment = None
    if info.get("adapter") is not None:
        if align != "none" or dcp_dir is not None or recalibrate:
            raise UserError(
                "LoRA adapters are fused in update space over their shared frozen base: merge_align, "
                "--dcp-dir and merge_recalibrate do not apply; leave them out"
            )
        out_weights.parent.mkdir(parents=True, exist_ok=True)
        fused = merge_adapter_files(info, method, resolved, weights, out_weights, block_bytes=block_bytes)
    elif dcp_dir is not None:
        fused = merge_from_dcp(dcp_dir, info, method, resolved, out_weights)
    else:
        out_weights.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".align-", dir=out_weights.parent) as work:
            engine_info = info
            if align == "weight_matching":
                from shardfuse.fusion.align import align_gather  # deferred: imports torch and scipy

                engine_info, alignment = align_gather(info, spec, Path(work), align_max_iter)
            fused = merge_rank_files(
                engine_info,
                method,
                resolved,
                weights,
                out_weights,
                val_split=val_split,
                batch_size=batch_size,
                block_bytes=block_bytes,
            )
        if alignment is not None:  # merge.json names the files gather.json lists, not the aligned copies
            originals = {int(r["rank"]): r for r in info["ranks"]}
            for ingredient in fused.inputs["ingredients"]:
                original = originals[ingredient["rank"]]
                ingredient.update(
                    {key: original[key] for key in ("path", *HASH_ALGORITHMS) if key in ingredient}
                )
    recalibration, output_sha256 = None, fused.sha256
    if recalibrate:
        from shardfuse.fusion.recalibrate import recalibrate_file  # deferred: imports torch

        recalibration = recalibrate_file(out_weights, spec, val_split, batch_size)
        output_sha256 = recalibration["sha256"]
    stats = fused.tensor_stats
    model_tensors = info.get("base_tensors") or info["tensors"]  # an adapter training's: the base's
    spreads = [s["max_abs_diff"] for s in stats.values()]
    record = MergeRecord(
        run=run or info["run"],
        training=info["run"],
        method=method,
        params=resolved,
        num_ranks=len(rows),
        # What went in: the path's base, ingredients, ... and its weights (greedy soup's, a DCP's none)
        # over the method's.
        **{"weights": weights, **fused.inputs},
        alignment=alignment,
        recalibration=recalibration,
        tensor_stats={name: {k: _finite(v) for k, v in s.items()} for name, s in stats.items()},
        max_abs_diff_between_ranks=_finite(max(spreads, default=0.0)) if dcp_dir is None else None,
        seconds=time.perf_counter() - started,
        peak_rss_mb=peak_rss_mb(),
        output=out_weights.name,
        sha256=output_sha256,
        num_tensors=len(model_tensors),
        num_parameters=sum(math.prod(t["shape"]) for t in model_tensors.values()),
    )
    write_json(out_json, record.to_json())
    return record


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.merge", description=__doc__.splitlines()[0])
    parser.add_argument("--gather", type=Path, required=True, help="gather.json of the run's training")
    parser.add_argument("--method", required=True, choices=METHODS)
    parser.add_argument("--params-json", default="{}", help="the method's parameters as a JSON object")
    parser.add_argument("--val-split", type=Path, help="validation split Parquet (read by greedy_soup only)")
    parser.add_argument("--batch-size", type=int, default=4096, help="greedy_soup: rows per forward pass")
    parser.add_argument("--dcp-dir", type=Path, help="consolidate: a sharded torch.distributed.checkpoint")
    parser.add_argument("--run", help="run name for merge.json (default: the training's name)")
    parser.add_argument(
        "--align", choices=("none", "weight_matching"), default="none", help="permutation alignment first"
    )
    parser.add_argument("--align-max-iter", type=int, default=100, help="weight matching: sweeps at most")
    parser.add_argument(
        "--recalibrate",
        action="store_true",
        help="re-estimate BatchNorm statistics on --val-split after merging",
    )
    parser.add_argument("--out-weights", type=Path, required=True, help="merged.safetensors to write")
    parser.add_argument("--out-json", type=Path, required=True, help="merge.json to write")
    args = parser.parse_args(argv)
    refuse_shared_outputs(args, "--out-weights", "--out-json")
    if args.batch_size < 1:
        raise UserError(f"--batch-size {args.batch_size} must be at least 1")
    if args.align_max_iter < 1:
        raise UserError(f"--align-max-iter {args.align_max_iter} must be at least 1")
    params = parse_json_arg(args.params_json, "--params-json")
    record = merge(
        args.gather,
        args.method,
        args.out_weights,
        args.out_json,
        params,
        val_split=args.val_split,
        batch_size=args.batch_size,
        dcp_dir=args.dcp_dir,
        run=args.run,
        align=args.align,
        align_max_iter=args.align_max_iter,
        recalibrate=args.recalibrate,
    )
    spread = record.max_abs_diff_between_ranks
    print(
        f"merged {record.num_ranks} ranks with {args.method} in {record.seconds:.2f} s "
        f"(peak RSS {record.peak_rss_mb:.0f} MB): {record.num_parameters} parameters, "
        f"max |rank - rank 0| = {spread if spread is None else f'{spread:.3g}'}"
    )


if __name__ == "__main__":
    run_cli(main)
