"""What the schema cannot say about a run: its dataset's task, the merge method's demands, the training
loop's keys, its partition; each refused with the key and the fix (the model's own checks are
shardfuse.experiment.model_checks's). The rules of a method, a strategy, a source or a partitioner are
its record's: these ask the records.
"""

from __future__ import annotations

from typing import Any

from shardfuse.data import labels
from shardfuse.data.epoch_steps import alignment_problem, unaligned
from shardfuse.data.labels import find_layout, layout_of
from shardfuse.data.sources.registry import find_source
from shardfuse.experiment.keys import (
    DECAY_RULE,
    FLOAT_TRAIN_KEYS,
    OPTIONAL_TRAIN_KEYS,
    merge_params,
)
from shardfuse.experiment.schema import ConfigError
from shardfuse.fusion.methods import registry as merge_methods
from shardfuse.io import UserError
from shardfuse.models.tasks import named_task
from shardfuse.strategies.registry import (
    apart_runs,
    apart_starters,
    find_strategy,
    identical_publishers,
    own_keys_problem,
    rank_loss_problem,
)


def dataset_task(dataset: dict[str, Any]) -> str:
    return named_task(dataset)


def check_dataset_task(name: str, spec: dict[str, Any], task: str) -> None:
    """Which keys a source needs for its task (the schema cannot say it clearly): the source's record
    and the layout of the task's targets say; then the record's own check (``config_check``)."""
    where = f"config error at datasets.{name}"
    source = find_source(spec["source"])
    tasks = source.tasks()
    if task not in tasks:
        raise ConfigError(
            f"{where}.task: source {source.name} gives {' or '.join(tasks)} data, not {task}; "
            f"set task: {tasks[0]} or use another source"
        )
    missing = [key for key in sorted(source.required_for(task)) if key not in spec]
    if missing:
        raise ConfigError(f"{where}: a {task} dataset from {source.name} needs `{missing[0]}`; add it")
    layout = layout_of(task)
    if problem := layout.config_problem(spec):
        raise ConfigError(f"{where}.{problem[0]}: {problem[1]}")
    # A key of another layout of targets (its required keys here, then the layouts' own keys) names the
    # task it belongs to; not one this task takes too (hf_disk's feature_columns).
    others = [find_layout(other) for other in source.labels if other != layout.name]
    own = source.keys_of(layout.name).keys
    stray = [(key, other) for other in others for key in sorted(source.keys_of(other.name).required - own)]
    stray += [
        (key, other) for other in labels.RECORDS if other is not layout for key in sorted(other.spec_keys)
    ]
    # The optional keys only another layout of this source takes (jsonl's prompt_field, a classification
    # dataset's label_field) too.
    stray += [(key, find_layout(name)) for name, keys in source.foreign(task).items() for key in sorted(keys)]
    if found := next(((key, other) for key, other in stray if key in spec), None):
        key, owner = found[0], found[1].task_name()
        raise ConfigError(
            f"{where}.{key}: only {owner} datasets use it but task is {task}; remove it or set task: {owner}"
        )
    # The source's own check before any job (csv, parquet: categorical_columns and the feature columns'
    # types in the file's header or first rows).
    if problem := source.config_check(spec):
        raise ConfigError(f"{where}.{problem[0]}: {problem[1]}")


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
    # What merge fuses: one checkpoint per rank, or per replica where fsdp shards each replica's model.
    shards = run.get("fsdp") or 1
    fused = world_size // shards if world_size % shards == 0 else world_size
    ranks = (
        f"{fused} ranks" if shards == 1 else f"{fused} replica(s) (world_size {world_size} / fsdp {shards})"
    )
    if run["merge_weights"] is not None and len(run["merge_weights"]) != fused:
        raise ConfigError(
            f"{where}.merge_weights: {len(run['merge_weights'])} weights for {ranks}; "
            "give one weight per rank or null (weights by shard rows)"
        )
    weighted = merge_methods.weighted_names()
    if run["merge_weights"] is not None and method not in weighted:
        raise ConfigError(
            f"{where}.merge_weights: only merge_method {', '.join(weighted[:-1])} or "
            f"{weighted[-1]} uses weights; "
            "remove them or set merge_method weighted"
        )
    # The method's own checks (its parameters together, the number of ranks it takes), as the merge stage
    # runs them: the record is the one place they are said.
    try:
        record = merge_methods.method_record(method)
        merge_methods.resolve_params(method, merge_params(run), [1] * fused)
    except UserError as exc:
        said = f" (merge fuses {ranks})" if shards > 1 else ""
        raise ConfigError(f"{where}.merge_method: {exc}{said}") from None
    if record.uses_val and datasets[run["dataset"]]["val_fraction"] == 0:
        raise ConfigError(
            f"{where}.merge_method: {method} needs a validation split but dataset "
            f"{run['dataset']!r} has val_fraction 0; set val_fraction > 0"
        )
    if run.get("merge_search") is not None:
        check_merge_search(where, run, record, datasets[run["dataset"]])
    if run.get("merge_recalibrate") and datasets[run["dataset"]]["val_fraction"] == 0:
        raise ConfigError(
            f"{where}.merge_recalibrate: re-estimating BatchNorm statistics needs a validation split but "
            f"dataset {run['dataset']!r} has val_fraction 0; set val_fraction > 0 or merge_recalibrate: false"
        )
    if run.get("merge_align", "none") != "none" and record.consolidates:
        raise ConfigError(
            f"{where}.merge_align: {method} checks that the ranks are identical, there is nothing to "
            "align; remove merge_align or choose another merge_method"
        )
    strategy = find_strategy(run["strategy"])
    if record.consolidates and not strategy.publishes_identical(run.get("keep", "last")):
        keep_best = " with keep best" if strategy.publishes_identical("last") else ""
        raise ConfigError(
            f"{where}.merge_method: {method} needs identical ranks ({identical_publishers()}) but "
            f"strategy is {strategy.name}{keep_best}; use merge_method uniform or weighted"
        )
    if (problem := strategy.sync_every_problem(run["sync_every"])) is not None:
        raise ConfigError(f"{where}.{problem}")


def check_training_loop(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """Training-loop keys that only make sense with some other key; sets decay_rule.

    A key set to a non-default value where nothing reads it would give a new training name for the
    same training, so it is an error rather than ignored. Warmup longer than the run is the train
    stage's check: only it knows the number of steps."""
    where = f"config error at runs[{name}]"
    strategy, optimizer, dataset = find_strategy(run["strategy"]), run["optimizer"], run["dataset"]
    if (problem := own_keys_problem(strategy.name, run, OPTIONAL_TRAIN_KEYS)) is not None:
        raise ConfigError(f"{where}.{problem}")
    if run["init"] == "per_rank" and strategy.equal_start is not None:
        raise ConfigError(
            f"{where}.init: per_rank gives each rank its own initial weights but "
            f"{strategy.equal_start}; use init shared or strategy {apart_starters()}"
        )
    problem = alignment_problem(run["epoch_steps"], strategy, run["sync_every"], run["fsdp"], apart_runs())
    if problem is not None:
        raise ConfigError(f"{where}.{problem}")
    problem = rank_loss_problem(
        run["min_ranks"], run["world_size"], strategy.name, run["fsdp"], run["nodes"], run["orphans"],
        unaligned(run["epoch_steps"]),
    )  # fmt: skip
    if problem is not None:
        key = "orphans" if problem.startswith("orphans") else "min_ranks"
        raise ConfigError(f"{where}.{key}: {problem}")
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
    no_val = datasets[dataset]["val_fraction"] == 0
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


def check_merge_search(where: str, run: dict[str, Any], record: Any, dataset: dict[str, Any]) -> None:
    """merge_search before any job: a method with parameters to search, a validation split to search
    on, and a search Optuna can run (shardfuse.fusion.search.parse)."""
    from shardfuse.fusion.search import parse

    if record.consolidates or record.select is not None or not record.params:
        what = "keeps rank 0" if record.consolidates else "has no parameter to search"
        what = "selects its ranks on the validation split itself" if record.select is not None else what
        raise ConfigError(
            f"{where}.merge_search: merge method {record.name} {what}; search a method with parameters "
            "(task_arithmetic, ties, dare, ...)"
        )
    if dataset["val_fraction"] == 0:
        raise ConfigError(
            f"{where}.merge_search: trials are scored on the validation split but dataset "
            f"{run['dataset']!r} has val_fraction 0; set val_fraction > 0"
        )
    kinds = {name: param.kind for name, param in record.params.items()}
    try:
        parse(run["merge_search"], record.name, kinds, f"{where}.merge_search")
    except UserError as exc:
        raise ConfigError(str(exc)) from None
