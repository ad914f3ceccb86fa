"""Collect a run's existing checkpoints into the folder a training writes, so gather, merge, evaluate,
plots, export and tracking treat them as its ranks.

By hand (as the collect rule runs it, for a run with ``checkpoints``)::

    python -m shardfuse.collect --run-name <dataset>-c2-checkpoints-<digest> \\
        --shard-dir results/shards/digits/w1-seed0 --dataset-dir results/datasets/digits \\
        --config-json '{"model": "mlp", ...}' --checkpoint a.safetensors --checkpoint ft/ \\
        [--base pretrained/] --out-dir results/trainings/<name>/ranks

The model is built as a training builds it (the run's model keys on the dataset, the data statistics of
the whole train split from the one-shard set ``--shard-dir``, the seed's initial weights); ``--base``
loads into it (default: those weights as built, for ``model: hf`` the pretrained folder's), and it is
written as ``base.safetensors``. Each ``--checkpoint`` (a safetensors file or a save_pretrained folder)
is loaded into a copy of it by init_from's rules (every tensor the model stores, by name and shape,
floating-point dtypes cast to the model's: :mod:`shardfuse.checkpoints.init_weights`; the first tensor
that does not fit is one line naming the file and the tensor) and written as ``rank-<r>.safetensors``
with its sidecar. ``train.json`` records a collection: no steps, no rows, each rank's source and the
sha256 of what it read. Nothing is unpickled. The folder appears whole or not at all.
"""

from __future__ import annotations

import copy
import shutil
import socket
from pathlib import Path
from typing import Any

from shardfuse.cluster.ownership import TRAINING_FOLDER
from shardfuse.console.errors import exit_now, run_cli
from shardfuse.experiment.records import COLLECTED_MODE, TrainRecord
from shardfuse.experiment.run_config import TrainConfig
from shardfuse.io import (
    StageParser,
    UserError,
    parse_json_arg,
    replace_dir,
    sha256_file,
    staging_dir,
    write_json,
)


def collect(
    run: str,
    shard_dir: Path,
    dataset_dir: Path,
    cfg: TrainConfig,
    checkpoints: list[Path],
    out_dir: Path,
    base: Path | None = None,
) -> TrainRecord:
    """Write ``out_dir`` (whole, atomically): the base, one rank per checkpoint, and train.json."""
    import torch

    from shardfuse.checkpoints.weights import save_weights
    from shardfuse.data.dataset_info import read_dataset_info
    from shardfuse.data.manifest import read_manifest
    from shardfuse.models.adapter import storable_state, ties_of
    from shardfuse.models.registry import build_model, set_data_stats
    from shardfuse.rank.setup import data_stats, spec_of, state_digest

    info = read_dataset_info(dataset_dir)
    manifest = read_manifest(shard_dir)
    spec = spec_of(cfg, info)
    torch.manual_seed(cfg.loop.seed)
    model = build_model(spec)
    set_data_stats(model, *data_stats(manifest, info, shard_dir))
    if base is not None:
        _load(model, base, cfg.model.init_from_prefix, "base")
    ties = ties_of(model)
    meta: dict[str, Any] = {
        "run": run,
        "world_size": len(checkpoints),
        "strategy": "localsgd",
        "model": spec,
        "init_from": None if base is None else str(base),
        "init_sha256": state_digest(model),
        "host": socket.gethostname(),
    }
    if ties:
        meta["ties"] = ties
    TRAINING_FOLDER.check(out_dir)
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(out_dir)
    try:
        save_weights(staged / "base.safetensors", storable_state(model)[0], {**meta, "rank": None})
        entries = []
        for rank, source in enumerate(checkpoints):
            loaded = copy.deepcopy(model)
            _load(loaded, source, cfg.model.init_from_prefix, f"checkpoint {rank}")
            rank_meta = {**meta, "rank": rank, "rows": 0, "num_steps": 0, "source": str(source)}
            digest = save_weights(staged / f"rank-{rank}.safetensors", storable_state(loaded)[0], rank_meta)
            read = [sha256_file(path) for path in _files_of(source)]
            entry = {"rank": rank, "rows": 0, "num_steps": 0, "rows_seen": 0, "host": meta["host"]}
            entry |= {"checkpoint": f"rank-{rank}.safetensors", "sha256": digest, "source": str(source)}
            entries.append({**entry, "source_sha256": read})
        record = TrainRecord(
            run=run,
            world_size=len(checkpoints),
            strategy="localsgd",
            mode=COLLECTED_MODE,
            sync_every=0,
            num_steps=0,
            epochs=0,
            steps_per_epoch=0,
            effective_batch_size=0,
            rows_per_step=0.0,
            bytes_all_reduced_per_rank=0,
            num_syncs=0,
            init="shared",
            train_seconds=0.0,
            framework_seconds=0.0,
            step_metrics=False,
            hosts=[meta["host"]] * len(checkpoints),
            device="cpu",
            torch_version=torch.__version__,
            shard_dir=str(shard_dir),
            dataset_dir=str(dataset_dir),
            task=spec["task"],
            model=spec,
            init_from=meta["init_from"],
            ranks=entries,
        )
        write_json(staged / "train.json", record.to_json())
        replace_dir(staged, out_dir, TRAINING_FOLDER)
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return record


def _load(model: Any, source: Path, prefix_map: dict[str, str | None] | None, what: str) -> None:
    """init_from's loading (every stored tensor by name and shape), its errors naming the checkpoint."""
    from shardfuse.rank.setup import load_init_weights

    try:
        load_init_weights(model, source, prefix_map)
    except UserError as exc:
        raise UserError(f"{what}: {str(exc).replace('init_from ', '', 1)}") from None


def _files_of(source: Path) -> list[Path]:
    from shardfuse.checkpoints.init_weights import weight_files

    return weight_files(source).shards if source.is_dir() else [source]


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.collect", description=__doc__.splitlines()[0])
    parser.add_argument("--run-name", required=True, help="the collection's name (its training name)")
    parser.add_argument("--shard-dir", type=Path, required=True, help="the dataset's one-shard set")
    parser.add_argument("--dataset-dir", type=Path, required=True)
    parser.add_argument("--config-json", required=True, help="the run's train config (its model keys)")
    parser.add_argument(
        "--checkpoint", type=Path, action="append", required=True, help="a safetensors file or folder"
    )
    parser.add_argument("--base", type=Path, help="the weights task vectors are measured from")
    parser.add_argument("--out-dir", type=Path, required=True, help="results/trainings/<name>/ranks")
    args = parser.parse_args(argv)
    TRAINING_FOLDER.check(args.out_dir)  # before any checkpoint is read
    cfg = TrainConfig.from_flat(parse_json_arg(args.config_json, "--config-json"))
    from shardfuse.checkpoints.init_weights import read_init_weights

    for path in [*args.checkpoint, *([args.base] if args.base else [])]:  # headers first: one line each
        if not path.exists():
            raise UserError(f"checkpoint {path} does not exist; fix the run's checkpoints (or base)")
        try:
            read_init_weights(path)
        except UserError as exc:
            raise UserError(f"checkpoint {str(exc).replace('init_from ', '', 1)}") from None
    record = collect(
        args.run_name, args.shard_dir, args.dataset_dir, cfg, args.checkpoint, args.out_dir, args.base
    )
    print(f"collected {record.world_size} checkpoint(s) into {args.out_dir}")


if __name__ == "__main__":
    run_cli(main)
    exit_now()
