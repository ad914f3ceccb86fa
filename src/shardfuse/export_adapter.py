"""Export a run's fused LoRA update as a PEFT adapter folder.

By hand (as the export_adapter rule runs it)::

    python -m shardfuse.export_adapter --gather results/trainings/<training>/gather.json \\
        --merge-json results/runs/<run>/merge.json --mode svd --out results/runs/<run>/adapter

The run's merge fused the ranks' updates ΔW_i = (alpha/r)·B_i·A_i with its method; this stage writes
that fused update again as an adapter (``shardfuse.fusion.lora``):

- ``svd``: each merged ΔW re-factorised to rank r (its best rank-r approximation); the relative
  truncation error ||ΔW - ΔW_r||_F / ||ΔW||_F of every module is recorded.
- ``cat``: the ranks' factors side by side, rank N·r, the exact update of the methods linear in the
  updates (uniform, weighted, task_arithmetic); others are refused.

The folder holds ``adapter_config.json`` and ``adapter_model.safetensors`` as PEFT writes them
(``PeftModel.from_pretrained(base, folder)`` loads it onto the training's base model) and
``fusion.json``: the mode, the method, the rank, each module's truncation error and the base's sha256.
``--base-ref`` is written as ``base_model_name_or_path`` (the transformers folder of the base, for
``AutoPeftModel``). The folder is written beside its target and renamed into place.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.checkpoints.gather_record import GatherRecord
from shardfuse.checkpoints.trust import check_merged_record, read_gather
from shardfuse.console.errors import run_cli
from shardfuse.experiment.records import MergeRecord
from shardfuse.io import OutputFolder, StageParser, UserError, atomic_dir, write_json
from shardfuse.models.catalog import exports_hf
from shardfuse.models.tasks import named_task, task_record

MODES = ("svd", "cat")
OUTPUT = OutputFolder("export_adapter", "--out", "fusion.json", "trained_r")  # the folders it writes
PEFT_PREFIX = "base_model.model."  # PEFT's names of a model's tensors in an adapter file


def fused_adapter(
    info: GatherRecord, merge: MergeRecord, mode: str
) -> tuple[dict[str, Any], int, dict[str, float]]:
    """({module: LoraFactors} of the fused update, the adapter's rank, {module: truncation error})."""
    from shardfuse.fusion import lora

    adapter = info.adapter
    method, params = merge.required("method"), merge.params or {}
    weights = merge.weights
    ranks = lora.read_rank_factors(info)
    rank_numbers = info.rank_numbers
    r, scaling = int(adapter["r"]), float(adapter["alpha"]) / int(adapter["r"])
    out: dict[str, Any] = {}
    errors: dict[str, float] = {}
    if mode == "cat":
        lora.refuse_unless_on_updates(method)
        coefficients = lora.linear_coefficients(method, params, len(ranks), weights)
        for name in ranks[0]:
            out[name] = lora.cat_factors([rank[name] for rank in ranks], coefficients, scaling)
            errors[name] = 0.0
        return out, r * len(ranks), errors
    options = {"rank_numbers": rank_numbers, "weights": weights}  # as the merge passed them
    for merged in lora.merge_updates(method, params, ranks, **options):
        fan_in_fan_out = ranks[0][merged.name].fan_in_fan_out
        out[merged.name], errors[merged.name] = lora.svd_factors(merged.update, r, scaling, fan_in_fan_out)
    return out, r, errors


def export_adapter(
    gather_path: Path, merge_json: Path, mode: str, out: Path, base_ref: str | None = None
) -> dict[str, Any]:
    from shardfuse.checkpoints.weights import write_safetensors

    if mode not in MODES:
        raise UserError(f"--mode {mode!r} is not one of {', '.join(MODES)}; choose svd or cat")
    info = read_gather(gather_path, need=("tensors",), need_in_ranks=("rows",))
    adapter = info.adapter
    if adapter is None:
        raise UserError(
            f"{gather_path} is the gather of a whole-model training, not of LoRA adapters; merge_adapter "
            "applies to runs with an adapter"
        )
    merge = MergeRecord.read(merge_json)
    if merge.training != info.run:
        raise UserError(
            f"{merge_json} is a merge of training {merge.training!r}, not of {info.run!r}; re-run merge "
            "(snakemake -R merge)"
        )
    merged = merge_json.parent / (merge.output or "merged.safetensors")
    if merged.is_file():  # the adapter must be the fusion the merged model beside it is
        check_merged_record(merged, merge_json, merge.method, merge.sha256)
    factors, rank, errors = fused_adapter(info, merge, mode)
    alpha = float(adapter["alpha"]) / int(adapter["r"]) * rank  # the same scaling alpha / r
    dtype = np.float32
    tensors = {}
    for name, factor in factors.items():
        module = name.removesuffix(".weight")
        tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = np.ascontiguousarray(factor.a, dtype=dtype)
        tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = np.ascontiguousarray(factor.b, dtype=dtype)
    modules = sorted(name.removesuffix(".weight") for name in factors)
    fan_in_fan_out = {bool(adapter["targets"][m].get("fan_in_fan_out")) for m in modules}
    if len(fan_in_fan_out) > 1:
        raise UserError(
            "the adapter mixes Linear and Conv1D targets; PEFT's adapter_config has one fan_in_fan_out "
            "for all: adapt modules of one kind"
        )
    spec = info.model or {}
    config = {
        "peft_type": "LORA",
        "task_type": task_record(named_task(spec)).peft_task_type if exports_hf(spec.get("model")) else None,
        "base_model_name_or_path": base_ref,
        "r": rank,
        "lora_alpha": alpha,
        "lora_dropout": 0.0,
        "target_modules": modules,
        "fan_in_fan_out": fan_in_fan_out.pop(),
        "bias": "none",
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "use_rslora": False,
        "use_dora": False,
    }
    values = list(errors.values())
    record = {
        "run": merge.run,
        "training": info.run,
        "mode": mode,
        "method": merge.method,
        "params": merge.params,
        "r": rank,
        "lora_alpha": alpha,
        "trained_r": int(adapter["r"]),
        "base_sha256": adapter["base_sha256"],
        "truncation_error": errors,
        "max_truncation_error": max(values, default=0.0),
        "mean_truncation_error": sum(values) / len(values) if values else 0.0,
        "num_parameters": int(sum(t.size for t in tensors.values())),
    }
    with atomic_dir(out, OUTPUT) as tmp:
        write_safetensors(tensors, tmp / "adapter_model.safetensors", {"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
        write_json(tmp / "fusion.json", record)
    return record


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.export_adapter", description=__doc__.splitlines()[0])
    parser.add_argument("--gather", type=Path, required=True, help="the training's gather.json")
    parser.add_argument("--merge-json", type=Path, required=True, help="the run's merge.json (its method)")
    parser.add_argument("--mode", required=True, help="svd (rank r again) or cat (rank N·r, linear methods)")
    parser.add_argument(
        "--out",
        type=Path,
        required=True,
        help="the adapter folder to write (replaced only if empty or written by export_adapter)",
    )
    parser.add_argument("--base-ref", help="base_model_name_or_path: the base's transformers folder")
    args = parser.parse_args(argv)
    OUTPUT.check(args.out)  # before any input is read
    record = export_adapter(args.gather, args.merge_json, args.mode, args.out, args.base_ref)
    print(
        f"exported the {record['method']} fusion of {args.gather.parent.name} as a rank-{record['r']} "
        f"adapter ({args.mode}, max truncation error {record['max_truncation_error']:.3g}) -> {args.out}"
    )


if __name__ == "__main__":
    run_cli(main)
