"""Check a foreign ``init_from`` (a safetensors file or a save_pretrained folder) against the run's model
before any job: every tensor's name, shape and dtype, the first misfit one line.

The config check runs it for each run whose init_from is not a shardfuse checkpoint (nor run:NAME):
the Snakefile's process must not import torch, and the model is built here, on the meta device (no
memory for its tensors), from the spec its dataset's keys determine
(:mod:`shardfuse.data.sources.describe`; for the sources whose shapes only their files tell, nothing
is checked here and the train stage checks). The weights are matched by
:func:`shardfuse.checkpoints.init_weights.match_names`, as the train stage loads them. By hand::

    python -m shardfuse.check_init --init-from pretrained/gpt2-tiny \\
        --run-json '{"model": "hf", "model_args": {"config": {"model_type": "gpt2", "n_layer": 1}}}' \\
        --dataset-json '{"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 32}'

Prints ``{"checked": true, "tensors": N}`` (or ``"checked": false`` with the reason) on stdout.
With ``--align`` instead of ``--init-from`` it checks ``merge_align`` on a user model: the model built
on the meta device must declare ``permutation_groups()`` (``{"checked": true, "groups": N}``); with
``--adapter``, a LoRA ``adapter``: its target_modules must match modules of the model and its r fit
them (``{"checked": true, "targets": N}``; the run JSON then carries ``adapter``).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from shardfuse.checkpoints.init_weights import expected_of, match_names, read_init_weights
from shardfuse.console.errors import run_cli
from shardfuse.data.sources.describe import info_from_spec
from shardfuse.experiment.run_config import ModelConfig, TrainConfig
from shardfuse.fusion.align import declared_groups
from shardfuse.io import StageParser, UserError, parse_json_arg
from shardfuse.models.adapter import storable_state
from shardfuse.models.registry import meta_model
from shardfuse.models.spec import model_spec


def meta_model_of(run: dict, dataset_spec: dict, checked_by: str) -> tuple[ModelConfig, Any, Any]:
    """(model config, model spec, the model on the meta device), or a {"checked": False} answer as the
    third item when the shapes come from the files (``checked_by`` checks them) or the model does not
    build on the meta device."""
    cfg: ModelConfig = TrainConfig.from_flat(run).model
    info = info_from_spec(dataset_spec)
    if info is None:
        reason = f"source {dataset_spec['source']} learns its shapes from its files; {checked_by} checks them"
        return cfg, None, {"checked": False, "reason": reason}
    spec = model_spec(
        cfg.model,
        cfg.model_args,
        cfg.code_paths,
        info,
        run_cfg=cfg.mlp_keys(),
        output=cfg.model_output,
        model_files=cfg.model_files,
    )
    model = meta_model(spec)
    if model is None:
        return (
            cfg,
            spec,
            {"checked": False, "reason": f"model {cfg.model!r} does not build on the meta device"},
        )
    return cfg, spec, model


def check_init(init_from: Path, run: dict, dataset_spec: dict) -> dict:
    """{"checked": bool, ...}; a misfit file is a UserError naming the tensor."""
    weights = read_init_weights(init_from)
    cfg, _, model = meta_model_of(run, dataset_spec, "train")
    if isinstance(model, dict):
        return model
    expected, ties = storable_state(model)
    plan = match_names(weights, expected_of(expected), ties, cfg.init_from_prefix)
    return {"checked": True, "tensors": len(plan)}


def check_adapter(run: dict, dataset_spec: dict) -> dict:
    """{"checked": bool, ...}; target_modules matching nothing, or an r above a target's smaller dimension,
    is the train stage's own UserError (:func:`shardfuse.models.lora.inject`, on the meta device here)."""
    from shardfuse.models.lora import inject  # deferred: peft

    cfg, _, model = meta_model_of(run, dataset_spec, "train")
    if isinstance(model, dict):
        return model
    with torch.device("meta"):
        targets = inject(model, cfg.adapter, seed=0)
    return {"checked": True, "targets": len(targets)}


def check_align(run: dict, dataset_spec: dict) -> dict:
    """{"checked": bool, ...}; a model without permutation_groups() is a UserError (merge's own line)."""
    cfg, spec, model = meta_model_of(run, dataset_spec, "merge")
    if isinstance(model, dict):
        return model
    return {"checked": True, "groups": len(declared_groups(spec, cfg.model))}


def check_fsdp(run: dict, dataset_spec: dict) -> dict:
    """{"checked": bool, ...}; a model without wrap units is the train stage's own UserError
    (:func:`shardfuse.rank.fsdp.wrap_units`)."""
    from shardfuse.rank.fsdp import wrap_units

    cfg, _, model = meta_model_of(run, dataset_spec, "train")
    if isinstance(model, dict):
        return model
    return {"checked": True, "units": len(wrap_units(model, cfg.model))}


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.check_init", description=__doc__.splitlines()[0])
    parser.add_argument("--init-from", type=Path, help="a safetensors file or folder")
    parser.add_argument("--align", action="store_true", help="check merge_align: the permutation groups")
    parser.add_argument("--adapter", action="store_true", help="check adapter: its target modules and r")
    parser.add_argument("--fsdp", action="store_true", help="check fsdp: the model's wrap units")
    parser.add_argument(
        "--run-json", default="{}", help="the run's model keys (model, model_args, init_from_prefix, ...)"
    )
    parser.add_argument("--dataset-json", required=True, help="the run's dataset spec, as in the config")
    args = parser.parse_args(argv)
    run = parse_json_arg(args.run_json, "--run-json")
    dataset_spec = parse_json_arg(args.dataset_json, "--dataset-json")
    if not isinstance(run, dict) or not isinstance(dataset_spec, dict) or "source" not in dataset_spec:
        raise UserError("--run-json and --dataset-json must be JSON objects, the dataset's with a source")
    if args.align:
        print(json.dumps(check_align(run, dataset_spec)))
    elif args.adapter:
        print(json.dumps(check_adapter(run, dataset_spec)))
    elif args.fsdp:
        print(json.dumps(check_fsdp(run, dataset_spec)))
    elif args.init_from is not None:
        print(json.dumps(check_init(args.init_from, run, dataset_spec)))
    else:
        raise UserError(
            "pass --init-from PATH (check init_from), --align (check merge_align), --adapter "
            "(check adapter) or --fsdp (check fsdp)"
        )


if __name__ == "__main__":
    run_cli(main)
