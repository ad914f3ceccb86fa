"""Fuse a run's per-rank models into one, streaming block by block through the tensors.

By hand over folders you already have, from a mergekit YAML (:mod:`shardfuse.fusion.folders`)::

    python -m shardfuse.merge --mergekit merge.yml --out merged/

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
names the run in merge.json when several runs fuse one training. The paths (the rank files for every
method, LoRA adapters, a DCP checkpoint) are shardfuse.fusion.fuse's; ``merge`` reads gather.json's
record, resolves the method's record and parameters, and writes merge.json around the path that ran.

Memory: the engine (``shardfuse.fusion.engine``) reads every input with explicit reads (no mmap, see
safetensors_stream) in blocks of at most BLOCK_BYTES of float64 across all ranks and writes the output
block by block, so peak memory is a few blocks plus the interpreter, whatever the number of ranks or
the model size. Exceptions: the TIES scan holds one rank's float64 magnitudes of one tensor; greedy
soup holds one candidate model (and the copy its evaluation makes). Two worker threads read and hash a
few blocks ahead of the math, and do the math too when it is a plain mean (uniform, greedy soup).

Trust: before anything is read, every checkpoint gather.json lists must lie inside the training
directory, be listed once, and carry in its header the training and rank of its place in gather.json
(shardfuse.checkpoints.trust.read_gather); a method that selects its ranks on the validation split (greedy
soup: its record's ``select``), the one kind that builds the model, first checks that the model
gather.json describes fits the tensors (shardfuse.models.registry.check_model_fits).

Checksums: each ingredient's digest (BLAKE3 from gather.json format version 2 on, sha256 before:
``GatherRecord.checksum_algorithm``) is computed by the worker threads from the very bytes that
are merged and compared with gather.json before the output is renamed into place: one read per file, and
no window between check and use. merge.json's ``hash`` names the algorithm checked; its ingredients
carry gather.json's digests, each under its algorithm's name. The base (shared initial weights) is
checked against the sha256 of its sidecar base.json.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.trust import read_gather
from shardfuse.console.errors import run_cli
from shardfuse.experiment.records import MergeRecord
from shardfuse.fusion.engine import BLOCK_BYTES, peak_rss_mb
from shardfuse.fusion.fuse import check_request, fuse
from shardfuse.fusion.methods import registry
from shardfuse.io import StageParser, UserError, parse_json_arg, refuse_shared_outputs, write_json
from shardfuse.models.usercode import check_code_unchanged


def _finite(value: Any) -> Any:
    return None if isinstance(value, float) and not math.isfinite(value) else value


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
    search: dict[str, Any] | None = None,
    search_db: Path | None = None,
) -> MergeRecord:
    """Merge the ranks listed in gather.json with ``method`` (after aligning them to rank 0 with
    ``align: weight_matching``, :mod:`shardfuse.fusion.align`); write the weights and merge.json."""
    started = time.perf_counter()
    record = registry.method_record(method)
    gather = read_gather(
        gather_path,
        base=record.uses_base and dcp_dir is None,
        need=("tensors", "model") if record.uses_val or search is not None else ("tensors",),
        need_in_ranks=("sha256", "rows"),
    )
    if gather.adapted:
        from shardfuse.fusion.lora import refuse_unless_on_updates

        refuse_unless_on_updates(method)  # before anything else reads the adapters as whole models
    spec = gather.model or {}
    # The tensors are merged by name, whatever network they belong to; but a merged file whose model
    # code changed since training would be rebuilt as another network by every later stage.
    if spec.get("code"):  # user code (a spec with code names its model)
        check_code_unchanged(spec["model"], spec["code"], "merge")
    rows = gather.rows_trained  # weighted: FedAvg's weights, the rows each rank trained on
    search_record = None
    if search is not None:  # the best trial's parameters, searched on the validation split
        params, search_record = _searched(
            gather_path, gather, record, params or {}, search, val_split, batch_size, search_db
        )
    resolved = registry.resolve_params(method, params, rows)
    options = {"val_split": val_split, "dcp_dir": dcp_dir, "align": align}
    check_request(gather_path, gather, record, recalibrate=recalibrate, **options)
    weights = registry.rank_weights(method, resolved, rows)
    fused = fuse(
        gather, record, resolved, weights, out_weights, batch_size=batch_size, block_bytes=block_bytes,
        align_max_iter=align_max_iter, **options,
    )  # fmt: skip
    recalibration, output_sha256 = None, fused.sha256
    if recalibrate:
        from shardfuse.fusion.recalibrate import recalibrate_file  # deferred: imports torch

        recalibration = recalibrate_file(out_weights, spec, val_split, batch_size)
        output_sha256 = recalibration["sha256"]
    stats = fused.tensor_stats
    model_tensors = gather.model_tensors  # an adapter training's: the base's
    spreads = [s["max_abs_diff"] for s in stats.values()]
    merge_record = MergeRecord.of(
        run=run or gather.run,
        training=gather.run,
        method=method,
        params=resolved,
        num_ranks=len(rows),
        # What went in: the path's base, ingredients, alignment, ... and its weights (a selection's, a
        # DCP's none) over the method's.
        **{"weights": weights, **fused.inputs},
        recalibration=recalibration,
        search=search_record,
        tensor_stats={name: {k: _finite(v) for k, v in s.items()} for name, s in stats.items()},
        max_abs_diff_between_ranks=_finite(max(spreads, default=0.0)) if dcp_dir is None else None,
        seconds=time.perf_counter() - started,
        peak_rss_mb=peak_rss_mb(),
        output=out_weights.name,
        sha256=output_sha256,
        num_tensors=len(model_tensors),
        num_parameters=sum(math.prod(t["shape"]) for t in model_tensors.values()),
    )
    write_json(out_json, merge_record.to_json())
    return merge_record


def _searched(gather_path, gather, record, given, search, val_split, batch_size, search_db):
    from shardfuse.fusion.search import parse, search_merge

    if record.consolidates or record.select is not None or not record.params:
        what = "keeps rank 0" if record.consolidates else "has no parameter to search"
        what = "selects its ranks on the validation split itself" if record.select is not None else what
        raise UserError(f"merge_search: merge method {record.name} {what}; search a method with parameters")
    if val_split is None or search_db is None:
        raise UserError("merge_search needs --val-split (the validation split) and --search-db (the study)")
    from shardfuse.checkpoints.trust import STALE, shapes_of
    from shardfuse.data.verify import check_dataset_of, check_split
    from shardfuse.models.registry import check_model_fits  # deferred: imports torch

    kinds = {name: param.kind for name, param in record.params.items()}
    spec = parse(search, record.name, kinds, "merge_search")
    check_split(val_split, "val")  # the validation split prepare wrote (never the test split)
    check_dataset_of(val_split, "val", gather.dataset_sha256)  # of the training's own dataset
    check_model_fits(str(gather_path), gather.model, shapes_of(gather.tensors), STALE)
    return search_merge(gather, record.name, given, spec, val_split, batch_size, search_db)


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.merge", description=__doc__.splitlines()[0])
    parser.add_argument("--mergekit", type=Path, help="a mergekit YAML: merge its models into --out")
    parser.add_argument("--out", type=Path, help="--mergekit: the folder to write")
    parser.add_argument("--gather", type=Path, help="gather.json of the run's training")
    parser.add_argument("--method", choices=registry.names())
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
    parser.add_argument("--search-json", help="merge_search: the search as a JSON object (trials, space...)")
    parser.add_argument("--search-db", type=Path, help="merge_search: the study's SQLite file (resumed)")
    parser.add_argument("--out-weights", type=Path, help="merged.safetensors to write")
    parser.add_argument("--out-json", type=Path, help="merge.json to write")
    args = parser.parse_args(argv)
    if args.mergekit is not None or args.out is not None:
        _merge_mergekit(args, argv)
        return
    missing = [f"--{name.replace('_', '-')}" for name in ("gather", "method", "out_weights", "out_json")]
    missing = [flag for flag in missing if getattr(args, flag[2:].replace("-", "_")) is None]
    if missing:
        parser.error(
            f"the following arguments are required: {', '.join(missing)} (or --mergekit FILE --out DIR)"
        )
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
        search=None if args.search_json is None else parse_json_arg(args.search_json, "--search-json"),
        search_db=args.search_db,
    )
    if record.search is not None:
        found = record.search
        print(
            f"searched {found['trials_done']} trials ({found['sampler']}): best {found['objective']} "
            f"{found['best_value']:.6g} (default parameters {found['default_value']:.6g}): "
            f"{found['best_params']}"
        )
    spread = record.max_abs_diff_between_ranks
    print(
        f"merged {record.num_ranks} ranks with {args.method} in {record.seconds:.2f} s "
        f"(peak RSS {record.peak_rss_mb:.0f} MB): {record.num_parameters} parameters, "
        f"max |rank - rank 0| = {spread if spread is None else f'{spread:.3g}'}"
    )


def _merge_mergekit(args, argv: list[str] | None) -> None:
    if args.mergekit is None or args.out is None:
        raise UserError("--mergekit FILE and --out DIR go together; give both")
    given = [
        f for f in ("gather", "method", "out_weights", "out_json", "val_split", "dcp_dir") if getattr(args, f)
    ]
    if given:
        flag = "--" + given[0].replace("_", "-")
        raise UserError(
            f"{flag} is a run's merge; with --mergekit the YAML says what to merge: remove {flag}"
        )
    from shardfuse.fusion.folders import OUTPUT, merge_folders
    from shardfuse.fusion.methods.mergekit import read

    OUTPUT.check(args.out)  # before the YAML's models are read
    cfg = read(args.mergekit)
    record = merge_folders(cfg, args.out)
    print(
        f"merged {len(cfg.models)} models with {cfg.mergekit_method} (shardfuse's {cfg.method}) in "
        f"{record['seconds']:.2f} s (peak RSS {record['peak_rss_mb']:.0f} MB) -> {args.out}"
    )
    for note in cfg.notes:
        print(f"note: {note}")


if __name__ == "__main__":
    run_cli(main)
