"""Load and validate the experiment configuration before any job starts.

The Snakefile calls :func:`load_experiment`; by hand::

    python -m shardfuse.config --configfile config/config.yaml        # prints every resolved run

A run is ``run_defaults`` overlaid with its row of the runs table, filled with schema defaults and then
validated, so a typo, a wrong type or an impossible value is one error that names the key.
"""

from __future__ import annotations

import copy
import csv
import difflib
import hashlib
import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema
import yaml

from shardfuse.io import StageParser, UserError, run_cli

SCHEMA_PATH = Path(__file__).resolve().parents[2] / "workflow" / "schemas" / "config.schema.yaml"
RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
DEFAULT_TRACKING_URI = "sqlite:///mlflow.db"
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
# What each merge method reads from the run config (config key -> merge param); other keys do not
# reach the merge rule, so changing them does not re-run it.
MERGE_PARAMS = {
    "consolidate": {"merge_tolerance": "tolerance"},
    "weighted": {"merge_weights": "weights"},
    "task_arithmetic": {"merge_scale": "scale"},
    "ties": {"merge_density": "density", "merge_scale": "scale"},
    "dare": {
        "merge_density": "density",
        "merge_seed": "seed",
        "merge_sign_election": "sign_election",
        "merge_scale": "scale",
    },
    "slerp": {"merge_t": "t"},
}
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
        same = [k for k in TRAINING_KEYS if k not in ("strategy", "sync_every")]
        for other, other_cfg in self.runs.items():
            if other_cfg["strategy"] == "ddp" and all(other_cfg[k] == cfg[k] for k in same):
                return other
        return None


def merge_params(run_cfg: dict[str, Any]) -> dict[str, Any]:
    """The params of the run's merge method (null values mean the method's own default)."""
    mapping = MERGE_PARAMS.get(run_cfg["merge_method"], {})
    return {param: run_cfg[key] for key, param in mapping.items() if run_cfg[key] is not None}


def training_name(run_cfg: dict[str, Any]) -> str:
    """A readable, content-addressed name: results/trainings/<name>/ holds the trained ranks."""
    identity = json.dumps({key: run_cfg[key] for key in TRAINING_KEYS}, sort_keys=True)
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
    return error.message


def _validate(instance: Any, schema: dict[str, Any], where: str, fix: str) -> None:
    validator = jsonschema.Draft202012Validator(schema)
    errors = sorted(validator.iter_errors(instance), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        # The deepest error is the most specific one (if/then and oneOf report on the parent first).
        error = max(errors, key=lambda e: len(e.absolute_path))
        location = _where(error)
        prefix = where if location == "(top level)" else f"{where}.{location}" if where else location
        raise ConfigError(f"config error at {prefix}: {_describe(error)}; {fix}")


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
        if kind == "array":
            if text.startswith("["):
                return json.loads(text)
            item = int if prop.get("items", {}).get("type") == "integer" else float
            return [item(part) for part in re.split(r"[,\s]+", text) if part]
    except (ValueError, json.JSONDecodeError):
        raise ConfigError(
            f"config error at {where}.{key}: {text!r} is not a valid {kind}; "
            f"write e.g. {_example(kind)} in that cell"
        ) from None
    return text


def _example(kind: str | None) -> str:
    return {"integer": "2", "number": "0.05", "boolean": "true", "array": "64,32"}.get(kind or "", "a word")


def read_runs_table(path: str | os.PathLike, run_props: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Read the TSV experiment table: a `run` column plus any run keys; empty cells take the default."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(
            f"config error at runs: runs table {path} does not exist; create it or point "
            "`runs:` at your TSV (paths are relative to the working directory)"
        )
    with open(path, newline="") as fh:
        lines = [line for line in fh if line.strip() and not line.lstrip().startswith("#")]
    reader = csv.DictReader(lines, delimiter="\t")
    header = reader.fieldnames or []
    if "run" not in header:
        raise ConfigError(
            f"config error at runs: {path} has no `run` column; the first header cell must be "
            "`run` (columns are tab-separated)"
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
    for line_no, row in enumerate(reader, start=2):
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
) -> Experiment:
    """Validate ``config`` and resolve every run. Raises ConfigError with a one-line message."""
    environ = os.environ if environ is None else environ
    schema = load_schema(schema_path)
    config = _with_defaults(config, schema)
    _validate(config, schema, "", "fix it in config/config.yaml (see config/README.md)")
    run_schema = schema["$defs"]["run"]
    run_props = run_schema["properties"]
    defaults = _with_defaults(config["run_defaults"], run_schema)
    _validate(defaults, run_schema, "run_defaults", "fix it in config/config.yaml")

    table = config["runs"]
    rows = read_runs_table(table, run_props) if isinstance(table, str) else table
    fix = f"fix that cell in {table}" if isinstance(table, str) else "fix it in the runs mapping"
    datasets = {
        name: _dataset_with_defaults(name, spec, schema["$defs"]["dataset"])
        for name, spec in config["datasets"].items()
    }
    runs: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        name = str(name)
        if not RUN_NAME.match(name):
            raise ConfigError(
                f"config error at runs: run name {name!r} is not allowed; use letters, digits, "
                "'_', '.', '-' (it becomes a directory name)"
            )
        if row is None or not isinstance(row, dict):
            raise ConfigError(f"config error at runs[{name}]: expected a mapping of run keys; {fix}")
        resolved = {**defaults, **row}
        _validate(resolved, run_schema, f"runs[{name}]", fix)
        _check_run(name, resolved, datasets, fix)
        runs[name] = resolved

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
    if filled["source"] != "synthetic" and "class_sep" not in spec:
        del filled["class_sep"]
    if filled["test_fraction"] + filled["val_fraction"] >= 1:
        raise ConfigError(
            f"config error at datasets.{name}: test_fraction + val_fraction = "
            f"{filled['test_fraction'] + filled['val_fraction']:g} leaves no training rows; "
            "make their sum < 1"
        )
    return filled


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
    if run["merge_weights"] is not None and method != "weighted":
        raise ConfigError(
            f"{where}.merge_weights: only merge_method weighted uses weights; remove them or "
            "set merge_method weighted"
        )
    if method == "greedy_soup" and datasets[run["dataset"]].get("val_fraction", 0.1) == 0:
        raise ConfigError(
            f"{where}.merge_method: greedy_soup needs a validation split but dataset "
            f"{run['dataset']!r} has val_fraction 0; set val_fraction > 0"
        )
    if method == "consolidate" and run["strategy"] != "ddp":
        raise ConfigError(
            f"{where}.merge_method: consolidate needs identical ranks (strategy ddp) but "
            f"strategy is {run['strategy']}; use merge_method uniform or weighted"
        )
    if run["strategy"] == "ddp" and run["sync_every"] != 0:
        raise ConfigError(
            f"{where}.sync_every: only localsgd syncs every N steps (ddp syncs gradients every "
            "step); remove sync_every or set strategy localsgd"
        )


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
    try:
        with open(args.configfile) as fh:
            config = yaml.safe_load(fh) or {}
    except FileNotFoundError:
        raise UserError(f"config file {args.configfile} does not exist; pass --configfile PATH") from None
    except yaml.YAMLError as exc:
        raise UserError(
            f"config file {args.configfile} is not valid YAML ({str(exc).splitlines()[0]}); fix the syntax"
        ) from None
    experiment = load_experiment(config)
    print(json.dumps({"tracking_uri": experiment.tracking_uri, "runs": experiment.runs}, indent=2))


if __name__ == "__main__":
    run_cli(main)
