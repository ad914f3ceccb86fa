"""What the schema cannot say about a run's model and how it is laid out: the model reference and its
arguments, merge_align's permutation groups, init_from's weights, a LoRA adapter, fsdp's wrap units and
a registered model's name; each refused with the key and the fix (the config loader calls these after
shardfuse.experiment.checks's run checks). Torch-free: what only the model's code can answer is asked in
a subprocess (shardfuse.experiment.init_check).
"""

from __future__ import annotations

import difflib
import posixpath
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.init_weights import read_init_weights
from shardfuse.experiment.checks import dataset_task
from shardfuse.experiment.init_check import (
    check_foreign_init,
    check_model_adapter,
    check_model_aligns,
    check_model_fsdp,
)
from shardfuse.experiment.keys import (
    merge_params,
    training_name,
)
from shardfuse.experiment.run_config import ModelConfig
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods import registry as merge_methods
from shardfuse.io import UserError
from shardfuse.models import catalog
from shardfuse.models.catalog import spoken
from shardfuse.models.spec import ADAPTER_DEFAULTS
from shardfuse.models.tasks import task_names, task_record
from shardfuse.models.usercode import code_fingerprint, is_builtin, load_factory, model_files_of
from shardfuse.strategies.registry import (
    apart_starters,
    find_strategy,
)


def check_model(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """The model reference imports, its code is fingerprinted, the loss fits the task; sets code_digest."""
    where = f"config error at runs[{name}]"
    task = dataset_task(datasets[run["dataset"]])
    # The default loss is every task's (the others ignore it); another must be one the task takes.
    if run["loss"] != ModelConfig.loss and run["loss"] not in task_record(task).losses:
        owners = " or ".join(name for name in task_names() if run["loss"] in task_record(name).losses)
        raise ConfigError(
            f"{where}.loss: {run['loss']} is a {owners} loss but dataset {run['dataset']!r} is "
            f"{task}; remove loss or use a {owners} dataset"
        )
    try:
        if (record := catalog.builtin(run["model"])) is not None:
            record.check_model_args(run["model_args"])
        files = model_files_of(run["model"], run["model_args"], run["model_files"])
        fingerprint = code_fingerprint(run["model"], run["code_paths"], files)
        if not is_builtin(run["model"]):
            load_factory(run["model"], run["code_paths"])
    except UserError as exc:
        raise ConfigError(f"{where}.model: {exc}") from None
    if fingerprint is not None:
        run["code_digest"] = fingerprint["digest"]
    check_init_from(name, run, datasets)
    check_align(name, run, datasets)


def check_align(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """merge_align needs the model's permutation groups: the built-in mlp and cnn have them, the other
    built-ins not, a user model declares them (looked up now in a subprocess, as init_from is checked)."""
    model = run["model"]
    if run["merge_align"] == "none" or model in catalog.aligned_names():
        return
    where = f"config error at runs[{name}]"
    if is_builtin(model):
        aligned = catalog.aligned_names()
        raise ConfigError(
            f"{where}.merge_align: weight_matching needs the model's permutation groups: the built-in "
            f"{spoken(aligned)} declare them, {model!r} does not; set merge_align: none or use "
            f"{' or '.join(aligned)}"
        )
    check_model_aligns(where, run, datasets[run["dataset"]])


def check_init_from(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """init_from's file or folder exists and is safetensors; a foreign one (not written by shardfuse)
    fits the model, checked now (shardfuse.experiment.init_check). Sets init_source."""
    where = f"config error at runs[{name}]"
    init_from = run["init_from"]
    if init_from is None and run["init_from_prefix"]:
        raise ConfigError(
            f"{where}.init_from_prefix: it renames the tensors of init_from but init_from is not set; "
            "remove init_from_prefix or set init_from"
        )
    if init_from is None or init_from.startswith("run:"):
        return
    if not Path(init_from).exists():
        raise ConfigError(
            f"{where}.init_from: {init_from} is not a file or folder; give a safetensors file, a "
            "save_pretrained folder or run:NAME (the merged model of run NAME)"
        )
    try:
        foreign = read_init_weights(init_from).foreign
    except UserError as exc:
        raise ConfigError(f"{where}.init_from: {exc}") from None
    run["init_source"] = {"file": init_from} if Path(init_from).is_file() else {"folder": init_from}
    if foreign:
        check_foreign_init(where, run, datasets[run["dataset"]])


def resolve_init_sources(runs: dict[str, dict[str, Any]]) -> None:
    """``init_from: run:NAME``: NAME must exist and the chain must end; the run's training identity
    then includes NAME's training and merge (a changed pretraining gives a new fine-tuning)."""

    def source_of(name: str, chain: tuple[str, ...]) -> dict[str, Any] | None:
        init_from = runs[name]["init_from"]
        if init_from is None or not init_from.startswith("run:"):
            return runs[name].get("init_source")
        parent = init_from[len("run:") :]
        if parent not in runs:
            close = difflib.get_close_matches(parent, list(runs), n=1)
            hint = f" (did you mean run:{close[0]}?)" if close else ""
            raise ConfigError(
                f"config error at runs[{name}].init_from: no run named {parent!r}{hint}; name a run of "
                "this experiment or a safetensors file"
            )
        if parent in chain:
            cycle = " -> ".join([*chain[chain.index(parent) :], parent])
            raise ConfigError(
                f"config error at runs[{name}].init_from: runs initialise each other in a cycle "
                f"({cycle}); one of them must start from scratch or from a file"
            )
        source_of(parent, (*chain, parent))
        parent_cfg = runs[parent]
        source = {
            "run": parent,
            "training": training_name(parent_cfg),
            "merge_method": parent_cfg["merge_method"],
            "merge_params": merge_params(parent_cfg),
        }
        runs[name]["init_source"] = source
        return source

    for name in runs:
        source_of(name, (name,))


def check_adapter(name: str, run: dict[str, Any], datasets: dict[str, Any] | None = None) -> None:
    """A LoRA adapter and the keys it rules out; fills the adapter's defaults in (so that spelling a
    default out, or 16 for 16.0, names the same training)."""
    where = f"config error at runs[{name}]"
    adapter, method = run.get("adapter"), run["merge_method"]
    if adapter is None:
        if run.get("merge_adapter", "none") != "none":
            raise ConfigError(
                f"{where}.merge_adapter: writes the fused LoRA update as an adapter, but the run trains no "
                "adapter; set adapter: {type: lora, r: 8} or remove merge_adapter"
            )
        return
    adapter = {**ADAPTER_DEFAULTS, **adapter}
    adapter["alpha"], adapter["dropout"] = float(adapter["alpha"]), float(adapter["dropout"])
    run["adapter"] = adapter
    reason = merge_methods.method_record(method).not_on_updates if method in merge_methods.names() else None
    if reason is not None:
        raise ConfigError(
            f"{where}.merge_method: {method} cannot fuse LoRA adapters: it {reason}; choose a method that "
            "works on task vectors (uniform, weighted, task_arithmetic, ties, dare, ...)"
        )
    for key, fix in (("merge_align", "none"), ("merge_recalibrate", False)):
        if run.get(key) not in (fix, None):
            raise ConfigError(
                f"{where}.{key}: LoRA adapters are fused in update space over their one frozen base, "
                f"there is nothing to {'align' if key == 'merge_align' else 'recalibrate'}; remove {key}"
            )
    if run["init"] == "per_rank":
        raise ConfigError(
            f"{where}.init: per_rank gives each rank its own base, but adapters train over one frozen "
            "base; remove init (adapter.init: per_rank draws each rank's own adapter)"
        )
    equal_start = find_strategy(run["strategy"]).equal_start
    if adapter["init"] == "per_rank" and equal_start is not None:
        raise ConfigError(
            f"{where}.adapter.init: per_rank gives each rank its own adapter but {equal_start}; use "
            f"adapter.init shared or strategy {apart_starters()}"
        )
    linear = merge_methods.linear_names()
    if run.get("merge_adapter") == "cat" and method not in linear:
        raise ConfigError(
            f"{where}.merge_adapter: cat is exact only for the methods linear in the updates "
            f"({', '.join(linear)}), not {method}; use merge_adapter svd"
        )
    if run.get("merge_adapter") == "cat":
        try:
            merge_methods.refuse_per_tensor_cat(method, merge_params(run))
        except UserError as exc:
            raise ConfigError(f"{where}.merge_adapter: {exc}") from None
    if datasets is not None:  # its targets and r against the model, built on the meta device
        check_model_adapter(where, run, datasets[run["dataset"]])


def check_fsdp(name: str, run: dict[str, Any], datasets: dict[str, Any] | None = None) -> None:
    """fsdp: S shards each replica's model: S divides world_size, the model has wrap units, and nothing
    that needs whole per-rank models (or ranks drawn apart) is asked for."""
    where = f"config error at runs[{name}]"
    shards, world_size = run["fsdp"], run["world_size"]
    if shards == 1:
        if run["fsdp_precision"] != "fp32":
            raise ConfigError(
                f"{where}.fsdp_precision: sets FSDP's mixed precision but fsdp is 1 (no sharding); set "
                "fsdp > 1 or remove fsdp_precision (precision: bf16 is the unsharded runs' key)"
            )
        return
    if world_size % shards:
        raise ConfigError(
            f"{where}.fsdp: {shards} shards per replica do not divide world_size {world_size} "
            f"(world_size = replicas x fsdp); set fsdp to a divisor of {world_size}"
        )
    refused = (
        ("init", "per_rank", "draws each rank's own weights, but the ranks of a replica share one "
         "sharded model and replicas must shard alike", "remove init"),
        ("merge_align", None, "permutes whole models of independently started ranks, but fsdp "
         "replicas start alike", "set merge_align: none"),
        ("adapter", None, "is not trained sharded yet", "remove adapter or set fsdp: 1"),
        ("keep", "best", "keeps each rank's best weights whole in memory, which sharding avoids",
         "set keep: last"),
    )  # fmt: skip
    for key, bad, why, fix in refused:
        value = run.get(key)
        if (bad is None and value not in (None, "none")) or (bad is not None and value == bad):
            raise ConfigError(f"{where}.{key}: {key} {value!r} with fsdp {shards}: it {why}; {fix}")
    if run["precision"] == "bf16":
        raise ConfigError(
            f"{where}.precision: bf16 autocast with fsdp {shards}; sharded runs take fsdp_precision: bf16 "
            "(bf16 parameters, fp32 reduction) instead"
        )
    model = run["model"]
    if model in catalog.fsdp_names():
        return
    if is_builtin(model):
        raise ConfigError(
            f"{where}.fsdp: fsdp {shards} needs the model's wrap units, which the built-in {model} has "
            f"not ({spoken(catalog.fsdp_names())} have); set fsdp: 1 for it"
        )
    if datasets is not None:  # an hf or user model: its units looked up on the meta device
        check_model_fsdp(where, run, datasets[run["dataset"]])


def check_registered_model(name: str | None, where: str = "config error at mlflow.registered_model") -> None:
    """MLflow's rules for a registered model's name (mlflow 3: utils.validation._validate_model_name,
    and the file store's): not blank, no '/', ':' or '%', not a path that resolves to another name
    ('.', '..x'). MLflow itself refuses it only at track, after the run is logged."""
    if name is None:
        return
    bad = [char for char in "/:%" if char in name]
    if not name.strip():
        reason = "it is blank"
    elif bad:
        reason = f"it contains {bad[0]!r}"
    elif name == "." or name.startswith(".."):
        reason = f"MLflow would read it as the path {posixpath.normpath(name)!r}"
    else:
        return
    raise ConfigError(
        f"{where}: {name!r} is not a name MLflow accepts ({reason}); use a name without '/', ':' or '%' "
        "that does not start with '..', e.g. shardfuse-digits"
    )
