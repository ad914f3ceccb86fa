"""The run's keys: what the train and merge rules read of a run, and what names its training."""

from __future__ import annotations

import hashlib
import json
import re
import shlex
from typing import Any

from shardfuse.data.partitioners import registry as partitioners
from shardfuse.experiment.run_config import flat_defaults
from shardfuse.fusion.methods import registry as merge_methods
from shardfuse.io import MAX_SEED

# Run and dataset names become directory names; matched in full (``$`` would accept a trailing newline).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")


# A file name holds at most NAME_MAX (255) bytes. The longest the workflow makes from a run, dataset or
# training name is io.atomic_path's temporary sibling of NAME.json (the dataset's input digests in
# .snakemake/shardfuse/inputs/); logs and benchmarks add only .log or .tsv, a training's staging
# directory .partial. Names are ASCII (RUN_NAME), so characters are bytes.
NAME_MAX = 255
LONGEST_FILE_OF_NAME = ".NAME.json.tmp-XXXXXXXX"
MAX_NAME_LENGTH = NAME_MAX - len(LONGEST_FILE_OF_NAME.replace("NAME", ""))


DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"


# Seeds are 64-bit integers everywhere they go (torch generators, JSON records, MLflow params); numpy
# alone would take any size. The train stage seeds rank r's torch generator with
# seed * RANK_SEED_STRIDE + r + 1 (train.py), so a run's seed leaves room for the schema's 4096 ranks.
# The schema's maxima are these numbers (a test holds them equal).
RANK_SEED_STRIDE = 1_000_003


MAX_RUN_SEED = (MAX_SEED - 4096) // RANK_SEED_STRIDE


def rank_seed(seed: int, rank: int) -> int:
    """Member ``rank``'s seed of dropout and data order in a run of ``seed``."""
    return seed * RANK_SEED_STRIDE + rank + 1


SEED_LIMITS = {
    "seed": f"each rank seeds torch with seed x {RANK_SEED_STRIDE} + rank + 1, a 64-bit integer",
    "shard_seed": "seeds are 64-bit integers",
    "merge_seed": "seeds are 64-bit integers",
}


# The run keys each stage sees: a stage's command (hence Snakemake's params trigger) changes only
# when one of its own keys changes, so a new merge method never re-runs training.
TRAIN_KEYS = (
    "strategy",
    "sync_every",
    "hidden_sizes",
    "activation",
    "dropout",
    "optimizer",
    "lr",
    "momentum",
    "weight_decay",
    "batch_size",
    "epochs",
    "seed",
    "checkpoint_every",
    "keep_checkpoints",
    "nonfinite_loss",
    "precision",
)


def merge_param_keys(method: str) -> dict[str, str]:
    """What merge method ``method`` reads from the run config (config key merge_<param> -> its param), from
    its record, read when called (a test's extension is seen); other keys do not reach the merge rule, so
    changing them does not re-run it. {} for a name no record has."""
    if method not in merge_methods.names():
        return {}
    return {f"merge_{param}": param for param in merge_methods.method_record(method).params}


# Train keys added after the first release (the model registry, then the training loop). They join a
# training's identity (and its command) only when set to something other than their default, so
# trainings configured before they existed keep their names and are not re-run. The defaults are the
# typed config's (the schema's are held equal to them); `!=` finds 0 equal to 0.0 and a YAML list equal
# to a TSV one.
TRAIN_DEFAULTS = flat_defaults()
OPTIONAL_TRAIN_KEYS = {
    key: TRAIN_DEFAULTS[key]
    for key in (
        "model",
        "model_args",
        "code_paths",
        "loss",
        "init_from",
        "lr_schedule",
        "warmup_steps",
        "min_lr",
        "grad_clip_norm",
        "grad_accum_steps",
        "betas",
        "eps",
        "eval_every",
        "keep",
        "patience",
        "outer_lr",
        "outer_momentum",
        "init",
        "model_output",
        "model_files",
        "find_unused_parameters",
        "static_graph",
        "init_from_prefix",
        "adapter",
        "fsdp",
        "fsdp_precision",
        "epoch_steps",
        "min_ranks",
        "orphans",
    )
}


# Numbers among them, stored as floats so that `outer_lr: 1` and `outer_lr: 1.0` name one training.
FLOAT_TRAIN_KEYS = ("min_lr", "grad_clip_norm", "eps", "outer_lr", "outer_momentum")


# Resolved while loading the config (not keys a user writes): the sha256 of the user model's code
# files, what init_from points at (a file, or the training and merge of another run), and the AdamW
# weight-decay rule (set when it changes training: adamw with weight_decay > 0).
DERIVED_TRAIN_KEYS = ("code_digest", "init_source", "decay_rule")


# AdamW decays only parameters with two or more dimensions (not biases and norm weights); runs it
# affects carry it, so they got new training names when the rule replaced decay-everything.
DECAY_RULE = "ndim>=2"


# Everything that determines a training's outputs. Runs that agree on all of these (e.g. a sweep over
# merge methods) share one training: its ranks are trained once and fused several ways.
TRAINING_KEYS = (
    "dataset",
    "world_size",
    "shard_seed",
    "drop_remainder",
    "nodes",
    "nproc_per_node",
    *TRAIN_KEYS,
)


def merge_align_args(run_cfg: dict[str, Any]) -> str:
    """The merge command's alignment options: empty unless the run aligns (so the command of a run
    configured before alignment existed is unchanged and Snakemake does not re-run its merge)."""
    align = run_cfg["merge_align"]  # a resolved run: every key has its value (schema defaults filled)
    args = [] if align == "none" else ["--align", align]
    if run_cfg["merge_recalibrate"]:
        args.append("--recalibrate")
    return " ".join(args)


def merge_params(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """The params of the run's merge method (null values mean the method's own default)."""
    mapping = merge_param_keys(run_cfg["merge_method"])
    return {param: run_cfg[key] for key, param in mapping.items() if run_cfg[key] is not None}


def _set_train_keys(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """The optional and derived train keys a run sets (those not at their defaults)."""
    found = {
        key: run_cfg[key]
        for key, default in OPTIONAL_TRAIN_KEYS.items()
        if key in run_cfg and run_cfg[key] != default
    }
    found.update({key: run_cfg[key] for key in DERIVED_TRAIN_KEYS if run_cfg.get(key) is not None})
    return found


def train_config(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """What the train stage reads of a run (its command line, hence Snakemake's params trigger)."""
    return {**{key: run_cfg[key] for key in TRAIN_KEYS}, **_set_train_keys(run_cfg)}


def training_identity(run_cfg: dict[str, Any]) -> dict[str, Any]:
    return {
        **{key: run_cfg[key] for key in TRAINING_KEYS},
        **_set_train_keys(run_cfg),
        **shardset_identity(run_cfg),
    }


# A run over checkpoints (``checkpoints``): what its "training" (the collected inputs) is made of: the
# sources as written, the base, and the keys its model is built from. The files' contents are the DAG's
# (an edited file re-collects); the name follows what the config says.
CHECKPOINT_IDENTITY_KEYS = (
    "dataset", "checkpoints", "base", "model", "model_args", "hidden_sizes", "activation", "dropout",
    "code_paths", "model_files", "model_output", "init_from_prefix", "seed", "code_digest",
)  # fmt: skip
CHECKPOINTS_SUFFIX = "checkpoints"  # a collection's name: <dataset>-c<N>-checkpoints-<digest>


def is_checkpoint_run(run_cfg: dict[str, Any]) -> bool:
    return bool(run_cfg.get("checkpoints"))


def training_name(run_cfg: dict[str, Any]) -> str:
    """A readable, content-addressed name: results/trainings/<name>/ holds the trained ranks (a run over
    checkpoints: the collected ones, ``<dataset>-c<N>-checkpoints-<digest>``)."""
    if is_checkpoint_run(run_cfg):
        identity = {key: run_cfg.get(key) for key in CHECKPOINT_IDENTITY_KEYS}
        digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
        count = len(run_cfg["checkpoints"])
        return f"{run_cfg['dataset']}-c{count}-{CHECKPOINTS_SUFFIX}-{digest}"
    identity = json.dumps(training_identity(run_cfg), sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{run_cfg['dataset']}-w{run_cfg['world_size']}-{run_cfg['strategy']}-{digest}"


def partitioner_of(run_cfg: dict[str, Any]) -> str:
    """The run's partitioner (a config from before the key existed: the default, iid)."""
    return run_cfg.get("partition", partitioners.DEFAULT)


def partition_params(run_cfg: dict[str, Any], num_classes: int | None = None) -> dict[str, Any]:
    """The run's partitioner's params, from its partition_<param> keys (null or absent: the record's
    default), checked by the record (a UserError names the key; ``num_classes``, where the config knows
    it, is checked too)."""
    name = partitioner_of(run_cfg)
    record = partitioners.find(name)
    given = {
        param: run_cfg[f"partition_{param}"]
        for param in record.params
        if run_cfg.get(f"partition_{param}") is not None
    }
    return partitioners.resolve_params(name, given, run_cfg["world_size"], num_classes)


def scores_locally(run_cfg: dict[str, Any]) -> bool:
    """Whether evaluate scores the run's models on each rank's local test distribution too: its
    partitioner has a local rule (every one but iid, whose runs keep the evaluate command they had)."""
    return partitioners.find(partitioner_of(run_cfg)).local is not None


def shardset_identity(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """What the run's partitioner adds to its shard set's identity, and so to its training's: flat keys
    (partition, partition_<param>), none for iid (shard sets and trainings keep their names)."""
    return partitioners.shardset_identity(partitioner_of(run_cfg), partition_params(run_cfg))


def shard_config(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """The keys of the shard set a run reads: its own, or for a run over checkpoints (no partition) the
    dataset's one-shard iid set, whose moments give a numeric model's data statistics."""
    if not is_checkpoint_run(run_cfg):
        return run_cfg
    return {**run_cfg, "world_size": 1, "drop_remainder": False, "partition": "iid"}


def shardset_name(run_cfg: dict[str, Any]) -> str:
    """Directory name of a shard set, from its identity: shards depend only on the dataset, world size,
    seed, remainder and the partitioner with its params. iid's is w{W}-seed{S}[-drop]; another
    partitioner's adds its name and, when it has params, a digest of them (the manifest records them)."""
    suffix = "-drop" if run_cfg["drop_remainder"] else ""
    name = f"w{run_cfg['world_size']}-seed{run_cfg['shard_seed']}{suffix}"
    identity = shardset_identity(run_cfg)
    if not identity:
        return name
    name = f"{name}-{partitioner_of(run_cfg)}"
    params = partition_params(run_cfg)
    if params:
        name += "-" + hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:10]
    return name


def partition_args(run_cfg: dict[str, Any]) -> str:
    """The partition command's options for the run's shard set (the rule's params: its identity passed
    as flags, never read back from the directory name). iid's are the options of the days before
    partitioners, so Snakemake's params trigger does not re-run existing shard sets."""
    args = [f"--world-size {run_cfg['world_size']} --seed {run_cfg['shard_seed']}"]
    if run_cfg["drop_remainder"]:
        args.append("--drop-remainder")
    if shardset_identity(run_cfg):
        params = json.dumps(partition_params(run_cfg), sort_keys=True)
        args.append(
            f"--partitioner {shlex.quote(partitioner_of(run_cfg))} --params-json {shlex.quote(params)}"
        )
    return " ".join(args)
