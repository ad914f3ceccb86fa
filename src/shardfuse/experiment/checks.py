"""What the schema cannot say about a run: its dataset's task, its model, its init source, the
merge method's demands, the training loop's keys; each refused with the key and the fix.
"""

from __future__ import annotations

import difflib
import posixpath
from pathlib import Path
from typing import Any

from shardfuse.checkpoints.init_weights import read_init_weights
from shardfuse.experiment.init_check import (
    check_foreign_init,
    check_model_adapter,
    check_model_aligns,
    check_model_fsdp,
)
from shardfuse.experiment.keys import (
    DECAY_RULE,
    FLOAT_TRAIN_KEYS,
    OPTIONAL_TRAIN_KEYS,
    SOURCE_TASKS,
    merge_params,
    training_name,
)
from shardfuse.experiment.run_config import ADAPTER_DEFAULTS
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods.registry import BY_NAME, WEIGHTED_METHODS
from shardfuse.io import UserError
from shardfuse.models.hf import check_hf_args
from shardfuse.models.usercode import code_fingerprint, is_builtin, load_factory, model_files_of


def dataset_task(dataset: dict[str, Any]) -> str:
    return dataset.get("task", "classification")


def check_dataset_task(name: str, spec: dict[str, Any], task: str) -> None:
    """Which keys a source needs for its task (the schema cannot say it clearly)."""
    where = f"config error at datasets.{name}"
    source = spec["source"]
    tasks = SOURCE_TASKS.get(source, ("classification", "regression"))
    if task not in tasks:
        raise ConfigError(
            f"{where}.task: source {source} gives {' or '.join(tasks)} data, not {task}; "
            f"set task: {tasks[0]} or use another source"
        )
    needs: dict[tuple[str, str], tuple[str, ...]] = {
        ("synthetic", "classification"): ("num_classes",),
        ("synthetic", "regression"): ("num_outputs",),
        ("parquet", "classification"): ("label_column",),
        ("parquet", "regression"): ("label_columns",),
        ("csv", "classification"): ("label_column",),
        ("csv", "regression"): ("label_columns",),
    }
    missing = [key for key in needs.get((source, task), ()) if key not in spec]
    if missing:
        raise ConfigError(f"{where}: a {task} dataset from {source} needs `{missing[0]}`; add it")
    if task == "classification" and len(spec.get("classes", [0, 1])) < 2:
        raise ConfigError(
            f"{where}.classes: {spec['classes']!r} keeps a single class, and a classifier needs at "
            "least 2; list two or more labels, or remove classes"
        )
    other_task = {"classification": "regression", "regression": "classification"}.get(task)
    stray = [key for key in needs.get((source, other_task), ()) if key in spec and other_task]
    stray += ["classes"] if "classes" in spec and task != "classification" else []
    if stray:
        raise ConfigError(
            f"{where}.{stray[0]}: only {other_task or 'classification'} datasets use it but task is "
            f"{task}; remove it or set task: {other_task or 'classification'}"
        )


def check_model(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """The model reference imports, its code is fingerprinted, the loss fits the task; sets code_digest."""
    where = f"config error at runs[{name}]"
    task = dataset_task(datasets[run["dataset"]])
    if run["loss"] != "mse" and task != "regression":
        raise ConfigError(
            f"{where}.loss: {run['loss']} is a regression loss but dataset {run['dataset']!r} is "
            f"{task}; remove loss or use a regression dataset"
        )
    try:
        if run["model"] == "hf":
            check_hf_args(run["model_args"])
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


# The built-in models whose permutation groups merge knows (shardfuse.fusion.align.BUILTIN_GROUPS, which
# imports torch: a test holds the two equal).
ALIGNED_BUILTINS = ("mlp", "cnn")


def check_align(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """merge_align needs the model's permutation groups: the built-in mlp and cnn have them, the other
    built-ins not, a user model declares them (looked up now in a subprocess, as init_from is checked)."""
    model = run["model"]
    if run["merge_align"] == "none" or model in ALIGNED_BUILTINS:
        return
    where = f"config error at runs[{name}]"
    if is_builtin(model):
        raise ConfigError(
            f"{where}.merge_align: weight_matching needs the model's permutation groups: the built-in "
            f"mlp and cnn declare them, {model!r} does not; set merge_align: none or use mlp or cnn"
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


def check_run(name: str, run: dict[str, Any], datasets: dict[str, Any], fix: str) -> None:
    """Rules that span several keys, which the schema cannot say clearly; resolves nproc_per_node."""
    where = f"config error at runs[{name}]"
    if run["dataset"] not in datasets:
        raise ConfigError(
            f"{where}.dataset: unknown dataset {run['dataset']!r}; define it under `datasets:` "
            f"(defined: {', '.join(sorted(datasets))})"
        )
    nodes, world_size = run["nodes"], run["world_size"]
    if run["nproc_per_node"] is None:
        if world_size % nodes:
            raise ConfigError(
                f"{where}.nodes: world_size {world_size} (the number of shards) cannot be split "
                f"evenly over {nodes} nodes; make world_size a multiple of nodes"
            )
        run["nproc_per_node"] = world_size // nodes
    elif nodes * run["nproc_per_node"] != world_size:
        raise ConfigError(
            f"{where}: nodes x nproc_per_node = {nodes} x {run['nproc_per_node']} = "
            f"{nodes * run['nproc_per_node']} but world_size (the number of shards) is "
            f"{world_size}; make them agree"
        )
    method = run["merge_method"]
    if method == "slerp" and world_size != 2:
        raise ConfigError(
            f"{where}.merge_method: slerp interpolates exactly two models but world_size is "
            f"{world_size}; use world_size 2 or another merge_method"
        )
    if run["merge_weights"] is not None and len(run["merge_weights"]) != world_size:
        raise ConfigError(
            f"{where}.merge_weights: {len(run['merge_weights'])} weights for {world_size} ranks; "
            "give one weight per rank or null (weights by shard rows)"
        )
    if run["merge_weights"] is not None and method not in WEIGHTED_METHODS:
        raise ConfigError(
            f"{where}.merge_weights: only merge_method {', '.join(WEIGHTED_METHODS[:-1])} or "
            f"{WEIGHTED_METHODS[-1]} uses weights; "
            "remove them or set merge_method weighted"
        )
    if method == "nuslerp" and world_size > 2:  # one rank: nuslerp returns it (as the method does)
        raise ConfigError(
            f"{where}.merge_method: nuslerp interpolates exactly two models but world_size is "
            f"{world_size}; use world_size 2, or multislerp or karcher"
        )
    density, epsilon = run["merge_density"] or 1.0, run["merge_epsilon"]
    if method == "della" and density < 1 and not (density - epsilon > 0 and density + epsilon < 1):
        raise ConfigError(
            f"{where}.merge_epsilon: della keeps entries with probability merge_density +- merge_epsilon, "
            f"which must lie in (0, 1) (density {density:g}, epsilon {epsilon:g}); lower "
            "merge_epsilon"
        )
    if method == "greedy_soup" and datasets[run["dataset"]].get("val_fraction", 0.1) == 0:
        raise ConfigError(
            f"{where}.merge_method: greedy_soup needs a validation split but dataset "
            f"{run['dataset']!r} has val_fraction 0; set val_fraction > 0"
        )
    if run.get("merge_recalibrate") and datasets[run["dataset"]].get("val_fraction", 0.1) == 0:
        raise ConfigError(
            f"{where}.merge_recalibrate: re-estimating BatchNorm statistics needs a validation split but "
            f"dataset {run['dataset']!r} has val_fraction 0; set val_fraction > 0 or merge_recalibrate: false"
        )
    if run.get("merge_align", "none") != "none" and method == "consolidate":
        raise ConfigError(
            f"{where}.merge_align: consolidate checks that the ranks are identical, there is nothing to "
            "align; remove merge_align or choose another merge_method"
        )
    # DiLoCo ends with an outer step, so its ranks publish the same weights unless each keeps its best.
    identical = run["strategy"] == "ddp" or (run["strategy"] == "diloco" and run.get("keep") != "best")
    if method == "consolidate" and not identical:
        raise ConfigError(
            f"{where}.merge_method: consolidate needs identical ranks (strategy ddp, or diloco keeping "
            f"its last weights) but strategy is {run['strategy']}"
            f"{' with keep best' if run['strategy'] == 'diloco' else ''}; "
            "use merge_method uniform or weighted"
        )
    if run["strategy"] == "ddp" and run["sync_every"] != 0:
        raise ConfigError(
            f"{where}.sync_every: only localsgd and diloco sync every N steps (ddp syncs gradients "
            "every step); remove sync_every or set strategy localsgd or diloco"
        )
    if run["strategy"] == "diloco" and run["sync_every"] == 0:
        raise ConfigError(
            f"{where}.sync_every: strategy diloco needs sync_every >= 1 (the inner steps between "
            "outer steps, e.g. 16); set sync_every"
        )


# Why init: per_rank is refused with these strategies.
EQUAL_RANKS = {
    "ddp": "ddp starts every rank from rank 0's weights",
    "diloco": "diloco's outer step needs one shared starting point",
}


def check_training_loop(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """Training-loop keys that only make sense with some other key; sets decay_rule.

    A key set to a non-default value where nothing reads it would give a new training name for the
    same training, so it is an error rather than ignored. Warmup longer than the run is the train
    stage's check: only it knows the number of steps."""
    where = f"config error at runs[{name}]"
    strategy, optimizer, dataset = run["strategy"], run["optimizer"], run["dataset"]
    for key in ("outer_lr", "outer_momentum"):
        if strategy != "diloco" and run[key] != OPTIONAL_TRAIN_KEYS[key]:
            raise ConfigError(
                f"{where}.{key}: only strategy diloco has an outer optimiser but strategy is "
                f"{strategy}; remove {key} or set strategy diloco"
            )
    for key in ("find_unused_parameters", "static_graph"):
        if strategy != "ddp" and run[key] != OPTIONAL_TRAIN_KEYS[key]:
            raise ConfigError(
                f"{where}.{key}: a DistributedDataParallel setting but strategy is {strategy}, which "
                f"keeps no DDP wrapper; remove {key} or set strategy ddp"
            )
    if run["init"] == "per_rank" and strategy in EQUAL_RANKS:
        raise ConfigError(
            f"{where}.init: per_rank gives each rank its own initial weights but "
            f"{EQUAL_RANKS[strategy]}; use init shared or strategy localsgd"
        )
    if run["init"] == "per_rank" and run["init_from"] is not None:
        raise ConfigError(
            f"{where}.init: per_rank draws each rank's own initial weights but init_from gives every "
            "rank the same ones; remove init or init_from"
        )
    for key in ("betas", "eps"):
        if optimizer != "adamw" and run[key] != OPTIONAL_TRAIN_KEYS[key]:
            raise ConfigError(
                f"{where}.{key}: {key} is an AdamW setting but optimizer is {optimizer}; remove "
                f"{key} or set optimizer adamw"
            )
    if run["min_lr"] > run["lr"]:
        raise ConfigError(
            f"{where}.min_lr: min_lr {run['min_lr']:g} is above lr {run['lr']:g} (the schedule "
            "decays from lr down to min_lr); make min_lr <= lr"
        )
    if run["min_lr"] != 0 and run["lr_schedule"] == "constant":
        raise ConfigError(
            f"{where}.min_lr: only lr_schedule cosine or linear decays to min_lr but lr_schedule "
            "is constant; remove min_lr or set lr_schedule cosine or linear"
        )
    no_val = datasets[dataset].get("val_fraction", 0.1) == 0
    if run["keep"] == "best" and run["eval_every"] == 0:
        raise ConfigError(
            f"{where}.keep: keep best needs validation while training but eval_every is 0; set "
            "eval_every to the optimiser steps between validations, e.g. 50"
        )
    if run["keep"] == "best" and no_val:
        raise ConfigError(
            f"{where}.keep: keep best needs a validation split but dataset {dataset!r} has "
            "val_fraction 0; set val_fraction > 0 or keep last"
        )
    if run["patience"] is not None and run["eval_every"] == 0:
        raise ConfigError(
            f"{where}.patience: early stopping counts validations but eval_every is 0; set "
            "eval_every >= 1 or remove patience"
        )
    if run["eval_every"] > 0 and no_val:
        raise ConfigError(
            f"{where}.eval_every: validation while training needs a validation split but dataset "
            f"{dataset!r} has val_fraction 0; set val_fraction > 0 or eval_every 0"
        )
    for key in FLOAT_TRAIN_KEYS:
        if run[key] is not None:
            run[key] = float(run[key])
    run["betas"] = [float(beta) for beta in run["betas"]]
    if optimizer == "adamw" and run["weight_decay"] > 0:
        run["decay_rule"] = DECAY_RULE


LINEAR_IN_UPDATES = ("uniform", "weighted", "task_arithmetic")


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
    reason = BY_NAME[method].not_on_updates if method in BY_NAME else None
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
    if adapter["init"] == "per_rank" and run["strategy"] in EQUAL_RANKS:
        raise ConfigError(
            f"{where}.adapter.init: per_rank gives each rank its own adapter but "
            f"{EQUAL_RANKS[run['strategy']]}; use adapter.init shared or strategy localsgd"
        )
    if run.get("merge_adapter") == "cat" and method not in LINEAR_IN_UPDATES:
        raise ConfigError(
            f"{where}.merge_adapter: cat is exact only for the methods linear in the updates "
            f"({', '.join(LINEAR_IN_UPDATES)}), not {method}; use merge_adapter svd"
        )
    if datasets is not None:  # its targets and r against the model, built on the meta device
        check_model_adapter(where, run, datasets[run["dataset"]])


# The built-in models with FSDP wrap units (shardfuse.rank.fsdp.wrap_units, which imports torch).
FSDP_BUILTINS = ("mlp", "transformer")


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
    if model in FSDP_BUILTINS:
        return
    if is_builtin(model):
        raise ConfigError(
            f"{where}.fsdp: fsdp {shards} needs the model's wrap units, which the built-in {model} has "
            "not (mlp and transformer have); set fsdp: 1 for it"
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
