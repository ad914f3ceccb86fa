"""Gather a training's per-rank checkpoints and verify they belong together.

By hand (``<training>`` is a directory of ``results/trainings/``, named by ``config.training_name``)::

    python -m shardfuse.gather --train-dir results/trainings/<training>/ranks --world-size 2 \
        --out results/trainings/<training>/gather.json

Checks that every rank 0..world_size-1 wrote a checkpoint, that each is readable safetensors with
shardfuse metadata for that rank, that all ranks have the keys, shapes and dtypes of the run's base
checkpoint, and records each file's checksums. Any problem is one error that names the rank. The base
itself must be the one training wrote: its header names the run (train.json's) and no rank, its
``init_sha256`` is the initial state the ranks' headers record, and its bytes match its sidecar
base.json's sha256; a swapped base is refused here, where re-running training is the fix.

gather.json format version 2 (``format_version: 2``, ``hash: "blake3"``) records each rank's BLAKE3
digest, the one merge verifies (several times faster than sha256: bench/RESULTS.md, merge), next to its
sha256. The sha256 costs nothing extra here: training's sidecar (rank-<r>.json) records the sha256,
so gather computes it anyway to prove the file is the one training wrote; both come from one read.
A gather.json without ``format_version`` (version 1) has sha256 only, and merge verifies that.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from shardfuse.checkpoints.gather_record import FORMAT_VERSION, GatheredRank, GatherRecord
from shardfuse.checkpoints.trust import check_base_header
from shardfuse.checkpoints.weights import read_header, read_metadata
from shardfuse.cluster.membership import recorded_membership
from shardfuse.console.errors import run_cli
from shardfuse.io import StageParser, UserError, file_digests, read_json, sha256_file, write_json

RERUN = "re-run training (snakemake -R train)"
HASH = "blake3"  # the digest merge verifies


def _compare_headers(rank: int, header: dict[str, Any], reference: dict[str, Any]) -> None:
    missing = sorted(set(reference) - set(header))
    extra = sorted(set(header) - set(reference))
    if missing or extra:
        detail = f"missing tensors {missing}" if missing else f"unexpected tensors {extra}"
        raise UserError(f"rank {rank}: checkpoint has {detail} compared with the base model; {RERUN}")
    for name, info in reference.items():
        if header[name] != info:
            raise UserError(
                f"rank {rank}: tensor {name!r} is {header[name]['dtype']}{header[name]['shape']} "
                f"but the base model has {info['dtype']}{info['shape']}; {RERUN}"
            )


def _check_base(path: Path, metadata: dict[str, Any], run: str) -> str:
    """The base is the one training wrote for this run: its header names the run and no rank, and its
    bytes are those its sidecar base.json records (one sha256 of the file, returned)."""
    check_base_header(path, metadata, run)
    sidecar = path.with_suffix(".json")
    digest = sha256_file(path)
    if sidecar.is_file():
        recorded = read_json(sidecar, "base sidecar").get("sha256")
        if recorded not in (None, digest):
            raise UserError(
                f"base checkpoint {path} has sha256 {digest[:12]}… but {sidecar} records "
                f"{str(recorded)[:12]}… (the file changed after training); {RERUN}"
            )
    return digest


def _check_base_start(path: Path, base_meta: dict[str, Any], rank: int, metadata: dict[str, Any]) -> None:
    """The base holds the initial weights the rank started from (``init_sha256``, the digest of the
    initial state every rank records): every rank's of a shared init, rank 0's of ``init: per_rank``."""
    if rank != 0 and metadata.get("init") == "per_rank":
        return
    started, recorded = metadata.get("init_sha256"), base_meta.get("init_sha256")
    if started is not None and recorded != started:
        raise UserError(
            f"base checkpoint {path} holds initial weights {str(recorded)[:12]}… but rank {rank} started "
            f"from {started[:12]}… (init_sha256 in their headers): it is not this training's base; {RERUN}"
        )


def recorded_rows_seen(train_info: dict[str, Any], path: Path) -> dict[int, int]:
    """{rank: rows it trained on} from train.json's ``ranks`` (none from trainings older than
    epoch_steps); a value that is not a count is a one-line error."""
    found = {}
    for index, entry in enumerate(train_info.get("ranks") or []):
        if not isinstance(entry, dict) or entry.get("rows_seen") is None:
            continue
        value = entry["rows_seen"]
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise UserError(f"{path}: ranks[{index}].rows_seen is {value!r}, not a count of rows; {RERUN}")
        found[entry.get("rank")] = value
    return found


def gather(train_dir: Path, world_size: int) -> GatherRecord:
    train_info = read_json(train_dir / "train.json", "training summary")
    if train_info["world_size"] != world_size:
        raise UserError(
            f"{train_dir} was trained with world size {train_info['world_size']} but the run "
            f"config says {world_size}; {RERUN}"
        )
    base_path = train_dir / "base.safetensors"
    base_header = read_header(base_path)
    base_meta = read_metadata(base_path)
    adapter = train_info.get("adapter")
    reference = base_header if adapter is None else adapter_header(adapter, base_header)
    membership = recorded_membership(train_info, world_size, str(train_dir / "train.json"), RERUN)
    # fsdp > 1: one checkpoint per replica (its ranks' shards gathered), fused as ranks are otherwise.
    replicas = len(membership.replicas)
    rows_seen = recorded_rows_seen(train_info, train_dir / "train.json")
    ranks = []
    for rank in membership.alive_replicas:
        path = train_dir / f"rank-{rank}.safetensors"
        if not path.is_file():
            raise UserError(f"rank {rank}: checkpoint {path} is missing; {RERUN}")
        metadata = read_metadata(path)
        if metadata.get("rank") != rank or metadata.get("run") != train_info["run"]:
            raise UserError(
                f"rank {rank}: {path} holds rank {metadata.get('rank')} of run "
                f"{metadata.get('run')!r}, not rank {rank} of {train_info['run']!r}; {RERUN}"
            )
        if metadata.get("adapter") != adapter:
            raise UserError(
                f"rank {rank}: {path} holds {'an adapter' if metadata.get('adapter') else 'a whole model'} "
                f"but train.json records {'an adapter training' if adapter else 'a whole-model training'} "
                f"(or another adapter); {RERUN}"
            )
        _compare_headers(rank, read_header(path), reference)
        _check_base_start(base_path, base_meta, rank, metadata)
        digests = file_digests(path, ("sha256", HASH))
        digest = digests["sha256"]
        sidecar = path.with_suffix(".json")
        if sidecar.is_file() and read_json(sidecar).get("sha256") not in (None, digest):
            raise UserError(
                f"rank {rank}: {path} does not match the sha256 recorded in {sidecar} (the file "
                f"changed after training); {RERUN}"
            )
        ranks.append(
            GatheredRank(
                rank=rank,
                path=str(path),
                sha256=digest,
                blake3=digests[HASH],
                bytes=path.stat().st_size,
                rows=int(metadata["rows"]),
                num_steps=int(metadata["num_steps"]),
                rows_seen=rows_seen.get(rank),
            )
        )
    base_sha256 = _check_base(base_path, base_meta, train_info["run"])
    if adapter is not None and adapter.get("base_sha256") != base_sha256:
        raise UserError(
            f"base checkpoint {base_path} is not the base the adapters were trained on (its sha256 is "
            f"not their header's base_sha256); {RERUN}"
        )
    return GatherRecord(
        format_version=FORMAT_VERSION,
        hash=HASH,
        run=train_info["run"],
        world_size=world_size,
        strategy=train_info["strategy"],
        model=train_info["model"],
        base=str(train_dir / "base.safetensors"),
        num_parameters=sum(_numel(info["shape"]) for info in base_header.values()),
        tensors=reference,
        ranks=tuple(ranks),
        adapter=adapter,
        base_tensors=None if adapter is None else base_header,
        replicas=replicas if replicas != world_size else None,
        # train.json's as written (checked by recorded_membership): it also holds the rows coverage
        membership={**membership.to_json(), **_coverage(train_info)},
        dataset_sha256=_dataset_sha256(train_info),
    )


def _coverage(train_info: dict[str, Any]) -> dict[str, Any]:
    """After a lost rank: train.json's rows coverage of the published models (overall, per epoch) and
    the min_ranks the training went on with."""
    recorded = train_info.get("membership") or {}
    keys = ("coverage", "coverage_per_epoch", "min_ranks")
    return {key: recorded[key] for key in keys if key in recorded and recorded.get("lost_ranks")}


def _dataset_sha256(train_info: dict[str, Any]) -> str | None:
    """The sha256 of the train split the training's shards were cut from, as their manifest records it;
    None where there is no readable manifest (then no split is checked against it)."""
    shard_dir = train_info.get("shard_dir")
    try:
        source = read_json(Path(shard_dir) / "manifest.json").get("source") if shard_dir else None
    except (OSError, ValueError, UserError, AttributeError):
        return None
    digest = source.get("sha256") if isinstance(source, dict) else None
    return digest if isinstance(digest, str) else None


def adapter_header(adapter: dict[str, Any], base: dict[str, Any]) -> dict[str, Any]:
    """The factors every rank of an adapter training holds ({module}.lora_A.weight [r, in],
    lora_B [out, r], in the base weight's dtype), from train.json's targets over the base's header."""
    header: dict[str, Any] = {}
    r = adapter.get("r")
    targets = adapter.get("targets")
    if not isinstance(r, int) or not isinstance(targets, dict) or not targets:
        raise UserError(f"train.json's adapter entry has no rank r or no targets; {RERUN}")
    for module, target in targets.items():
        weight = base.get(f"{module}.weight")
        if weight is None or not isinstance(target, dict) or weight["shape"] != target.get("shape"):
            raise UserError(
                f"the base has no weight {module}.weight of the shape the adapter of {module!r} was "
                f"trained on; {RERUN}"
            )
        out, inp = weight["shape"][::-1] if target.get("fan_in_fan_out") else weight["shape"]
        header[f"{module}.lora_A.weight"] = {"shape": [r, inp], "dtype": weight["dtype"]}
        header[f"{module}.lora_B.weight"] = {"shape": [out, r], "dtype": weight["dtype"]}
    return header


def _numel(shape: list[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.gather", description=__doc__.splitlines()[0])
    parser.add_argument("--train-dir", type=Path, required=True, help="the train rule's output directory")
    parser.add_argument("--world-size", type=int, required=True, help="ranks the run config expects")
    parser.add_argument("--out", type=Path, required=True, help="gather.json to write")
    args = parser.parse_args(argv)
    write_json(args.out, gather(args.train_dir, args.world_size).to_json())


if __name__ == "__main__":
    run_cli(main)
