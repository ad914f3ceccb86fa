"""Load and validate the experiment configuration before any job starts.

The Snakefile calls :func:`load_experiment`; by hand::

    python -m shardfuse.config --configfile config/config.yaml   # every resolved run and its training

A run is ``run_defaults`` overlaid with its row of the runs table, filled with schema defaults and then
validated, so a typo, a wrong type or an impossible value is one error that names the key.
"""

from __future__ import annotations

import copy
import csv
import difflib
import hashlib
import json
import math
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from shardfuse.fusion.methods.registry import RECORDS, WEIGHTED_METHODS
from shardfuse.io import StageParser, UserError, run_cli
from shardfuse.models.usercode import code_fingerprint, is_builtin, load_factory

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
# Run and dataset names become directory names; matched in full (``$`` would accept a trailing newline).
RUN_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]*")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
# YAML 1.1 (PyYAML) reads a number with an exponent as a float only with a dot and a signed exponent:
# 1e-8 and 1.0e8 are strings there, 1.0e-8 and 1.0e+8 are floats.
YAML_TEXT_EXPONENT = re.compile(r"^([-+]?\d+(?:\.\d*)?)[eE]([-+]?)(\d+)$")
# Seeds are 64-bit integers everywhere they go (torch generators, JSON records, MLflow params); numpy
# alone would take any size. The train stage seeds rank r's torch generator with
# seed * RANK_SEED_STRIDE + r + 1 (train.py), so a run's seed leaves room for the schema's 4096 ranks.
# The schema's maxima are these numbers (a test holds them equal).
MAX_SEED = 2**63 - 1
RANK_SEED_STRIDE = 1_000_003
MAX_RUN_SEED = (MAX_SEED - 4096) // RANK_SEED_STRIDE
SEED_LIMITS = {
    "seed": f"each rank seeds torch with seed x {RANK_SEED_STRIDE} + rank + 1, a 64-bit integer",
    "shard_seed": "seeds are 64-bit integers",
    "merge_seed": "seeds are 64-bit integers",
}
# A dataset's task when its spec does not say; and the tasks each source can give (default: both
# classification and regression).
DEFAULT_TASKS = {"diabetes": "regression", "text": "causal_lm"}
SOURCE_TASKS = {
    "digits": ("classification",),
    "digits_images": ("classification",),
    "image_folder": ("classification",),
    "diabetes": ("regression",),
    "text": ("causal_lm",),
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
# What each merge method reads from the run config (config key merge_<param> -> merge param), from the
# methods' own records; other keys do not reach the merge rule, so changing them does not re-run it.
MERGE_PARAMS = {record.name: {f"merge_{param}": param for param in record.params} for record in RECORDS}
# Train keys added after the first release (the model registry, then the training loop). They join a
# training's identity (and its command) only when set to something other than their default, so
# trainings configured before they existed keep their names and are not re-run. The defaults are the
# schema's (a test holds them equal); `!=` finds 0 equal to 0.0 and a YAML list equal to a TSV one.
OPTIONAL_TRAIN_KEYS = {
    "model": "mlp",
    "model_args": {},
    "code_paths": [],
    "loss": "mse",
    "init_from": None,
    "lr_schedule": "constant",
    "warmup_steps": 0,
    "min_lr": 0.0,
    "grad_clip_norm": None,
    "grad_accum_steps": 1,
    "betas": [0.9, 0.999],
    "eps": 1.0e-8,
    "eval_every": 0,
    "keep": "last",
    "patience": None,
    "outer_lr": 0.7,
    "outer_momentum": 0.9,
    "init": "shared",
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
# Keys that only some strategies use: a non-ddp run's ddp baseline may differ in them.
STRATEGY_KEYS = ("strategy", "sync_every", "outer_lr", "outer_momentum", "init")
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


class ConfigError(UserError):
    """The configuration is invalid; the message names the key and the fix."""


@dataclass(frozen=True)
class Experiment:
    runs: dict[str, dict[str, Any]]  # run name -> fully resolved run config
    datasets: dict[str, dict[str, Any]]
    tracking_uri: str
    mlflow_experiment: str
    registered_model: str | None = None
    live: bool = False

    def training(self, run: str) -> str:
        return training_name(self.runs[run])

    @property
    def trainings(self) -> dict[str, dict[str, Any]]:
        """Training name -> the config of the first run that uses it (identical training keys)."""
        found: dict[str, dict[str, Any]] = {}
        for cfg in self.runs.values():
            found.setdefault(training_name(cfg), cfg)
        return found

    def ddp_baseline(self, run: str) -> str | None:
        """The ddp run trained like ``run`` in every other respect, if the experiment has one."""
        cfg = self.runs[run]

        def rest(run_cfg: dict[str, Any]) -> dict[str, Any]:
            identity = training_identity(run_cfg)
            return {k: v for k, v in identity.items() if k not in STRATEGY_KEYS}

        for other, other_cfg in self.runs.items():
            if other_cfg["strategy"] == "ddp" and rest(other_cfg) == rest(cfg):
                return other
        return None


def merge_align_args(run_cfg: dict[str, Any]) -> str:
    """The merge command's alignment options: empty unless the run aligns (so the command of a run
    configured before alignment existed is unchanged and Snakemake does not re-run its merge)."""
    align = run_cfg.get("merge_align", "none")
    args = [] if align == "none" else ["--align", align]
    if run_cfg.get("merge_recalibrate"):
        args.append("--recalibrate")
    return " ".join(args)


def merge_params(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """The params of the run's merge method (null values mean the method's own default)."""
    mapping = MERGE_PARAMS.get(run_cfg["merge_method"], {})
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
    return {**{key: run_cfg[key] for key in TRAINING_KEYS}, **_set_train_keys(run_cfg)}


def training_name(run_cfg: dict[str, Any]) -> str:
    """A readable, content-addressed name: results/trainings/<name>/ holds the trained ranks."""
    identity = json.dumps(training_identity(run_cfg), sort_keys=True)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:10]
    return f"{run_cfg['dataset']}-w{run_cfg['world_size']}-{run_cfg['strategy']}-{digest}"


def shardset_name(run_cfg: dict[str, Any]) -> str:
    """Directory name of a shard set: shards depend only on (dataset, world size, seed, remainder)."""
    suffix = "-drop" if run_cfg["drop_remainder"] else ""
    return f"w{run_cfg['world_size']}-seed{run_cfg['shard_seed']}{suffix}"


def load_schema(path: str | os.PathLike = SCHEMA_PATH) -> dict[str, Any]:
    with open(path) as fh:
        return yaml.safe_load(fh)


def _where(error: jsonschema.ValidationError) -> str:
    return ".".join(str(p) for p in error.absolute_path) or "(top level)"


def _describe(error: jsonschema.ValidationError) -> str:
    key = error.absolute_path[-1] if error.absolute_path else None
    if error.validator == "maximum" and key in SEED_LIMITS:
        reason = "seeds are 64-bit integers" if "datasets" in error.absolute_path else SEED_LIMITS[key]
        return f"seed {error.instance} is too large; use a seed from 0 to {error.validator_value} ({reason})"
    if error.validator == "additionalProperties":
        allowed = sorted(error.schema.get("properties", {}))
        extra = sorted(set(error.instance) - set(allowed))
        close = difflib.get_close_matches(extra[0], allowed, n=1) if extra else []
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        hint += f"; valid keys: {', '.join(allowed)}" if allowed else ""
        return f"unknown key {', '.join(repr(k) for k in extra)}{hint}"
    if error.validator == "enum":
        return f"{error.instance!r} is not one of {', '.join(map(str, error.validator_value))}"
    if error.validator == "oneOf" and _where(error) == "runs":
        return "must be a path to a TSV file or a mapping {run name: {key: value}}"
    exponent = YAML_TEXT_EXPONENT.match(error.instance) if isinstance(error.instance, str) else None
    if error.validator == "type" and exponent:
        mantissa, sign, digits = exponent.groups()
        written = f"{mantissa if '.' in mantissa else mantissa + '.0'}e{sign or '+'}{digits}"
        return f"{error.message} (YAML reads {error.instance} as text; write {written})"
    return error.message


def _validate(instance: Any, schema: dict[str, Any], where: str, fix: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        # The deepest error is the most specific one (if/then and oneOf report on the parent first).
        error = max(errors, key=lambda e: len(e.absolute_path))
        location = _where(error)
        if location == "(top level)":
            prefix = where or location
        else:
            prefix = f"{where}.{location}" if where else location
        raise ConfigError(f"config error at {prefix}: {_describe(error)}; {fix}")


def _non_finite(value: Any, path: tuple = ()) -> tuple[tuple, float] | None:
    """The path and value of the first NaN or infinity in ``value`` (JSON Schema's number admits them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return path, value
    if isinstance(value, dict):
        items = value.items()
    elif isinstance(value, list):
        items = enumerate(value)
    else:
        return None
    for key, item in items:
        found = _non_finite(item, (*path, key))
        if found:
            return found
    return None


def _check_finite(instance: Any, where: str, fix: str) -> None:
    """YAML's .nan and .inf and a TSV cell's nan or inf are floats: refuse them, wherever they are."""
    found = _non_finite(instance)
    if found:
        path, value = found
        location = ".".join([where, *map(str, path)]) if where else ".".join(map(str, path))
        raise ConfigError(
            f"config error at {location}: {value} is not a finite number (NaN and infinity are not "
            f"allowed); {fix}"
        )


def _with_defaults(instance: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    filled = dict(instance)
    for key, sub in schema.get("properties", {}).items():
        if key not in filled and "default" in sub:
            filled[key] = copy.deepcopy(sub["default"])
    return filled


def _coerce_cell(value: str, key: str, prop: dict[str, Any], where: str) -> Any:
    """Turn one TSV cell into the JSON type the schema expects for ``key``."""
    kind = prop.get("type") or ("string" if "enum" in prop else None)
    text = value.strip()
    if isinstance(kind, list):  # e.g. [integer, "null"]: a key that may also be null
        if "null" in kind and text.lower() in {"null", "none"}:
            return None
        kind = next((k for k in kind if k != "null"), None)
    try:
        if kind == "integer":
            return int(text)
        if kind == "number":
            return float(text)
        if kind == "boolean":
            lowered = text.lower()
            if lowered in {"true", "yes", "1"}:
                return True
            if lowered in {"false", "no", "0"}:
                return False
            raise ValueError(text)
        if kind == "object":
            value = json.loads(text)
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        if kind == "array":
            if text.startswith("["):
                return json.loads(text)
            item = {"integer": int, "string": str}.get(prop.get("items", {}).get("type"), float)
            return [item(part) for part in re.split(r"[,\s]+", text) if part]
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(
            f"config error at {where}.{key}: {text!r} is not a valid {kind}; "
            f"write e.g. {_example(kind)} in that cell"
        ) from None
    return text


def _example(kind: str | None) -> str:
    examples = {
        "integer": "2",
        "number": "0.05",
        "boolean": "true",
        "array": "64,32",
        "object": '{"width": 32}',
    }
    return examples.get(kind or "", "a word")


def read_runs_table(path: str | os.PathLike, run_props: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Read the TSV experiment table: a `run` column plus any run keys; empty cells take the default."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config error at runs: runs table {path} does not exist; create it or point "
            "`runs:` at your TSV (paths are relative to the working directory)"
        )
    with open(path, newline="") as fh:
        # Comment and blank lines are left out; line_numbers maps what the reader sees to the file.
        numbered = [
            (number, line)
            for number, line in enumerate(fh, start=1)
            if line.strip() and not line.lstrip().startswith("#")
        ]
    line_numbers = [number for number, _ in numbered]
    reader = csv.DictReader([line for _, line in numbered], delimiter="\t")
    header = reader.fieldnames or []
    if "run" not in header:
        raise ConfigError(
            f"config error at runs: {path} has no `run` column; the first header cell must be "
            "`run` (columns are tab-separated)"
        )
    twice = sorted({col for col in header if header.count(col) > 1})
    if twice:
        raise ConfigError(
            f"config error at runs: column {twice[0]!r} appears more than once in the header of {path}; "
            "keep one column per key"
        )
    unknown = [col for col in header if col != "run" and col not in run_props]
    if unknown:
        close = difflib.get_close_matches(unknown[0], list(run_props), n=1)
        if close:
            raise ConfigError(
                f"config error at runs: {path} has unknown column {unknown[0]!r} (did you mean "
                f"{close[0]!r}?); rename the column"
            )
        raise ConfigError(
            f"config error at runs: {path} has unknown column {unknown[0]!r}; valid columns: "
            f"run, {', '.join(sorted(run_props))}"
        )
    runs: dict[str, dict[str, Any]] = {}
    last_line = reader.line_num
    for row in reader:
        line_no, last_line = line_numbers[last_line], reader.line_num  # the row's first line in the file
        name = (row.get("run") or "").strip()
        if None in row:
            raise ConfigError(
                f"config error at runs: {path} line {line_no} has more cells than the header; "
                "separate columns with single tabs"
            )
        if name in runs:
            raise ConfigError(
                f"config error at runs: run {name!r} appears twice in {path}; run names must be unique"
            )
        where = f"runs[{name}]"
        runs[name] = {
            key: _coerce_cell(value, key, run_props[key], where)
            for key, value in row.items()
            if key != "run" and value is not None and value.strip() != ""
        }
    if not runs:
        raise ConfigError(f"config error at runs: {path} has no rows; add one line per run below the header")
    return runs


def load_experiment(
    config: dict[str, Any],
    schema_path: str | os.PathLike = SCHEMA_PATH,
    environ: dict[str, str] | None = None,
    config_files: Iterable[str | os.PathLike] = (),
) -> Experiment:
    """Validate ``config`` and resolve every run. Raises ConfigError with a one-line message.

    ``config_files`` are the files ``config`` was read from (Snakemake's ``workflow.configfiles``):
    they are read again by :func:`read_config_file`, which refuses what Snakemake's loader lets
    through (a key written twice, whose first value YAML silently drops)."""
    environ = os.environ if environ is None else environ
    for config_file in config_files:
        read_config_file(config_file)
    schema = load_schema(schema_path)
    config = _with_defaults(config, schema)
    config_fix = "fix it in config/config.yaml (see config/README.md)"
    for key in ("datasets", "mlflow"):
        _check_finite(config.get(key), key, config_fix)
    _validate(config, schema, "", config_fix)
    run_schema = schema["$defs"]["run"]
    run_props = run_schema["properties"]
    defaults = _with_defaults(config["run_defaults"], run_schema)
    _check_finite(defaults, "run_defaults", "fix it in config/config.yaml")
    _validate(defaults, run_schema, "run_defaults", "fix it in config/config.yaml")

    table = config["runs"]
    rows = read_runs_table(table, run_props) if isinstance(table, str) else table
    fix = f"fix that cell in {table}" if isinstance(table, str) else "fix it in the runs mapping"
    for name in config["datasets"]:
        if not RUN_NAME.fullmatch(str(name)):
            raise ConfigError(
                f"config error at datasets: dataset name {name!r} is not allowed; use letters, digits, "
                "'_', '.', '-' (it becomes a directory name)"
            )
    datasets = {
        name: _dataset_with_defaults(name, spec, schema["$defs"]["dataset"])
        for name, spec in config["datasets"].items()
    }
    runs: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        name = str(name)
        if not RUN_NAME.fullmatch(name):
            raise ConfigError(
                f"config error at runs: run name {name!r} is not allowed; use letters, digits, "
                "'_', '.', '-' (it becomes a directory name)"
            )
        if row is None or not isinstance(row, dict):
            raise ConfigError(f"config error at runs[{name}]: expected a mapping of run keys; {fix}")
        resolved = {**defaults, **row}
        _check_finite(resolved, f"runs[{name}]", fix)
        _validate(resolved, run_schema, f"runs[{name}]", fix)
        _check_run(name, resolved, datasets, fix)
        _check_model(name, resolved, datasets)
        _check_training_loop(name, resolved, datasets)
        runs[name] = resolved
    _resolve_init_sources(runs)

    mlflow_cfg = _with_defaults(config["mlflow"], schema["properties"]["mlflow"])
    tracking_uri = mlflow_cfg["tracking_uri"] or environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    return Experiment(
        runs,
        datasets,
        tracking_uri,
        mlflow_cfg["experiment"],
        mlflow_cfg["registered_model"],
        mlflow_cfg["live"],
    )


def _dataset_with_defaults(name: str, spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults only for keys the dataset's source uses (class_sep is synthetic's alone)."""
    filled = _with_defaults(spec, schema)
    task = filled.get("task") or DEFAULT_TASKS.get(filled["source"], "classification")
    if task != "classification":
        filled["task"] = task  # classification stays implicit: older dataset specs keep their params
    if (filled["source"] != "synthetic" or task != "classification") and "class_sep" not in spec:
        del filled["class_sep"]
    _check_dataset_task(name, filled, task)
    if filled["test_fraction"] + filled["val_fraction"] >= 1:
        raise ConfigError(
            f"config error at datasets.{name}: test_fraction + val_fraction = "
            f"{filled['test_fraction'] + filled['val_fraction']:g} leaves no training rows; "
            "make their sum < 1"
        )
    return filled


def dataset_task(dataset: dict[str, Any]) -> str:
    return dataset.get("task", "classification")


def _check_dataset_task(name: str, spec: dict[str, Any], task: str) -> None:
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
    other_task = {"classification": "regression", "regression": "classification"}.get(task)
    stray = [key for key in needs.get((source, other_task), ()) if key in spec and other_task]
    stray += ["classes"] if "classes" in spec and task != "classification" else []
    if stray:
        raise ConfigError(
            f"{where}.{stray[0]}: only {other_task or 'classification'} datasets use it but task is "
            f"{task}; remove it or set task: {other_task or 'classification'}"
        )


def _check_model(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
    """The model reference imports, its code is fingerprinted, the loss fits the task; sets code_digest."""
    where = f"config error at runs[{name}]"
    task = dataset_task(datasets[run["dataset"]])
    if run["loss"] != "mse" and task != "regression":
        raise ConfigError(
            f"{where}.loss: {run['loss']} is a regression loss but dataset {run['dataset']!r} is "
            f"{task}; remove loss or use a regression dataset"
        )
    try:
        fingerprint = code_fingerprint(run["model"], run["code_paths"])
        if not is_builtin(run["model"]):
            load_factory(run["model"], run["code_paths"])
    except UserError as exc:
        raise ConfigError(f"{where}.model: {exc}") from None
    if fingerprint is not None:
        run["code_digest"] = fingerprint["digest"]
    init_from = run["init_from"]
    if init_from is not None and not init_from.startswith("run:"):
        if not Path(init_from).is_file():
            raise ConfigError(
                f"{where}.init_from: {init_from} is not a file; give a safetensors checkpoint or "
                "run:NAME (the merged model of run NAME)"
            )
        run["init_source"] = {"file": init_from}


def _resolve_init_sources(runs: dict[str, dict[str, Any]]) -> None:
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


def _check_run(name: str, run: dict[str, Any], datasets: dict[str, Any], fix: str) -> None:
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


def _check_training_loop(name: str, run: dict[str, Any], datasets: dict[str, Any]) -> None:
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


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """A config file (YAML or JSON) as a mapping, read strictly: a key written twice in one mapping
    (at any depth) and a tag such as ``!!python/object`` are errors naming the file, the key or tag
    and the line. Snakemake's own loader keeps the last of two equal keys without a word."""
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except FileNotFoundError:
        raise ConfigError(f"config file {path} does not exist; pass --configfile PATH") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"cannot read config file {path} ({exc}); check the file") from None
    try:
        root = yaml.compose(text, Loader=yaml.SafeLoader)
        if root is not None:
            _check_nodes(root, path)
        config = yaml.safe_load(text) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        reason = getattr(exc, "problem", None) or str(exc).splitlines()[0]
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(f"config file {path}{where} is not valid YAML ({reason}); fix the syntax") from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"config file {path} holds a {type(config).__name__}, not a mapping of keys; see config/README.md"
        )
    return config


def _check_nodes(root: yaml.Node, path: str | os.PathLike) -> None:
    """Refuse a key that appears twice in one mapping and any tag the safe loader cannot build."""
    known = (set(yaml.SafeLoader.yaml_constructors) - {None}) | {"tag:yaml.org,2002:merge"}  # <<
    seen: set[int] = set()
    stack: list[tuple[yaml.Node, str]] = [(root, "")]
    while stack:
        node, where = stack.pop()
        if id(node) in seen:  # an alias shares its anchor's node
            continue
        seen.add(id(node))
        line = node.start_mark.line + 1
        if node.tag not in known:
            tag = node.tag.replace("tag:yaml.org,2002:", "!!")
            raise ConfigError(
                f"config file {path} line {line} uses the YAML tag {tag}, which is not allowed; plain "
                "YAML only (mappings, lists, strings, numbers, true/false, null)"
            )
        if isinstance(node, yaml.MappingNode):
            first_lines: dict[tuple[str, str], int] = {}
            for key_node, value_node in node.value:
                key_line = key_node.start_mark.line + 1
                if isinstance(key_node, yaml.ScalarNode) and key_node.tag != "tag:yaml.org,2002:merge":
                    key = (key_node.tag, key_node.value)
                    if key in first_lines:
                        inside = f" under {where}" if where else " at the top level"
                        raise ConfigError(
                            f"config file {path} line {key_line}: key {key_node.value!r} appears twice"
                            f"{inside} (first on line {first_lines[key]}); YAML would silently "
                            "keep only the second: merge them into one"
                        )
                    first_lines[key] = key_line
                child = f"{where}.{key_node.value}" if where else str(key_node.value)
                stack += [(key_node, where), (value_node, child)]
        elif isinstance(node, yaml.SequenceNode):
            stack += [(item, f"{where}[{index}]") for index, item in enumerate(node.value)]


def run_config_for_tracking(experiment: Experiment, run: str) -> dict[str, Any]:
    """The run's full resolved config, including its dataset's spec, as the tracker logs it."""
    cfg = dict(experiment.runs[run])
    return {"run": run, **cfg, "dataset_spec": experiment.datasets[cfg["dataset"]]}


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.config", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configfile", default="config/config.yaml", help="YAML config (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    experiment = load_experiment(read_config_file(args.configfile))
    trainings = {run: experiment.training(run) for run in experiment.runs}
    print(
        json.dumps(
            {"tracking_uri": experiment.tracking_uri, "runs": experiment.runs, "trainings": trainings},
            indent=2,
        )
    )


if __name__ == "__main__":
    run_cli(main)
