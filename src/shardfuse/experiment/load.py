"""The experiment: every run resolved (run_defaults, its row, schema defaults) and checked before any
job starts. The Snakefile calls :func:`load_experiment`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shardfuse.data.sources.registry import find_source
from shardfuse.experiment.checkpoint_runs import (
    apply_mergekit_config,
    check_checkpoints,
    resolve_checkpoint_runs,
)
from shardfuse.experiment.checks import check_dataset_task, check_run, check_training_loop, dataset_task
from shardfuse.experiment.keys import (
    DEFAULT_TRACKING_URI,
    LONGEST_FILE_OF_NAME,
    MAX_NAME_LENGTH,
    NAME_MAX,
    RUN_NAME,
    training_identity,
    training_name,
)
from shardfuse.experiment.model_checks import (
    check_adapter,
    check_fsdp,
    check_model,
    check_registered_model,
    resolve_init_sources,
)
from shardfuse.experiment.partition_check import check_partition
from shardfuse.experiment.runs_table import read_runs_table
from shardfuse.experiment.schema import (
    SCHEMA_PATH,
    ConfigError,
    check_finite,
    load_schema,
    read_config_file,
    validate,
    with_defaults,
)
from shardfuse.models.tasks import spec_task_entry
from shardfuse.strategies.registry import find_strategy, identity_keys

DEFAULT_EXPERIMENT = "shardfuse"  # the schema's default mlflow.experiment (config/config.yaml's)


def experiment_folder(name: str) -> str:
    """The folder name of an MLflow experiment's outputs: the name itself when it is a run-like name
    (letters, digits, '_', '.', '-'; ``shardfuse-disjoint``), else those characters with every other
    one as '_' and 8 hex digits of the name's digest (``/Users/me/exp`` -> ``_Users_me_exp-1f3a...``),
    so two names never share a folder."""
    if RUN_NAME.fullmatch(name) and len(name) <= MAX_NAME_LENGTH:
        return name
    digest = hashlib.sha256(name.encode()).hexdigest()[:8]
    return f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)[: MAX_NAME_LENGTH - 9]}-{digest}"


def results_dir_of(experiment: str) -> str:
    """``results`` for the default experiment, ``results/experiments/<folder>`` for every other."""
    if experiment == DEFAULT_EXPERIMENT:
        return "results"
    return f"results/experiments/{experiment_folder(experiment)}"


def check_run_folders(experiment: Experiment, runs_dir: str | os.PathLike = "results/runs") -> None:
    """A run's folder (``results/runs/<run>``) is shared by every experiment of the checkout: one that
    another experiment tracked (its mlflow.json names that experiment) is refused before any job, as
    re-running it here would replace that experiment's merged model and scores."""
    for run in experiment.runs:
        record = Path(runs_dir) / run / "mlflow.json"
        if not record.is_file():
            continue
        try:
            owner = json.loads(record.read_text(encoding="utf-8")).get("experiment_name")
        except (OSError, ValueError, AttributeError):
            continue  # the track stage says what is wrong with it
        if isinstance(owner, str) and owner != experiment.mlflow_experiment:
            raise ConfigError(
                f"config error at runs[{run}]: {Path(runs_dir) / run} holds run {run!r} of experiment "
                f"{owner!r} (its mlflow.json), and re-running it for experiment "
                f"{experiment.mlflow_experiment!r} would replace that one's results; give the run another "
                f"name here, or delete {Path(runs_dir) / run} to let this experiment have it"
            )


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
    def results_dir(self) -> str:
        """Where the experiment's own outputs go (summary.csv, plots/ with the comparison figures and
        their MLflow record): ``results`` for the default experiment (``mlflow.experiment:
        shardfuse``), ``results/experiments/<experiment>`` for every other, so a second configfile
        run in the same checkout never replaces the first one's."""
        return results_dir_of(self.mlflow_experiment)

    @property
    def trainings(self) -> dict[str, dict[str, Any]]:
        """Training name -> the config of the first run that uses it (identical training keys)."""
        found: dict[str, dict[str, Any]] = {}
        for cfg in self.runs.values():
            found.setdefault(training_name(cfg), cfg)
        return found

    def ddp_baseline(self, run: str) -> str | None:
        """The run trained like ``run`` in every other respect with the baseline strategy (ddp), if the
        experiment has one."""
        cfg = self.runs[run]
        strategy_keys = identity_keys()  # what a strategy choice sets: the baseline may differ in them

        def rest(run_cfg: dict[str, Any]) -> dict[str, Any]:
            identity = training_identity(run_cfg)
            if isinstance(identity.get("adapter"), dict):  # adapter.init is a strategy choice too
                identity["adapter"] = {k: v for k, v in identity["adapter"].items() if k != "init"}
            return {k: v for k, v in identity.items() if k not in strategy_keys}

        for other, other_cfg in self.runs.items():
            if find_strategy(other_cfg["strategy"]).baseline and rest(other_cfg) == rest(cfg):
                return other
        return None


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
    sources = [(str(path), read_config_file(path)) for path in config_files]
    try:
        return _load(config, schema_path, environ)
    except ConfigError as exc:
        raise ConfigError(name_the_source(str(exc), sources)) from None


DEFAULT_CONFIG = "config/config.yaml"
_LOCATION = re.compile(r"^config error at ([^:]+?)(: |$)")


def _key_path(location: str) -> list[str]:
    """``runs[r].lr`` -> ["runs", "r", "lr"]; ``datasets.d.seed`` -> ["datasets", "d", "seed"]."""
    return [part for part in re.split(r"[.\[\]]+", location) if part]


def _defines(config: Any, keys: list[str]) -> bool:
    for key in keys:
        if not isinstance(config, dict) or key not in config:
            return False
        config = config[key]
    return True


def source_of(location: str, sources: list[tuple[str, dict[str, Any]]]) -> str | None:
    """The config file the key at ``location`` came from: the last of ``sources`` (Snakemake's order:
    the Snakefile's config/config.yaml, then each --configfile, each overriding the ones before) that
    holds it, or the longest part of its path it holds (a run's key may come from run_defaults)."""
    keys = _key_path(location)
    wanted = [keys]  # whole keys first: a run's own key, then run_defaults' (its default)
    if keys[:1] == ["runs"] and len(keys) > 2:
        wanted.append(["run_defaults", *keys[2:]])
    wanted += [keys[:length] for length in range(len(keys) - 1, 0, -1)]  # then the nearest parent
    for candidate in wanted:
        for path, config in reversed(sources):
            if _defines(config, candidate):
                return path
    return None


def name_the_source(message: str, sources: list[tuple[str, dict[str, Any]]]) -> str:
    """A config error naming the file its key came from: its "fix it in config/config.yaml" points at
    that file, and where the workflow read several files the location says which
    (``config error at runs[r].lr (in FILE)``)."""
    match = _LOCATION.match(message)
    if match is None or not sources or "fix that cell in " in message:  # a runs table names itself
        return message
    path = source_of(match.group(1), sources)
    if path is None:
        return message
    message = message.replace(f"fix it in {DEFAULT_CONFIG}", f"fix it in {path}")
    if len(sources) == 1:
        return message
    return f"{message[: match.end(1)]} (in {path}){message[match.end(1) :]}"


def _load(config: dict[str, Any], schema_path: str | os.PathLike, environ: Any) -> Experiment:
    """:func:`load_experiment` once the files are read."""
    schema = load_schema(schema_path)
    config = with_defaults(config, schema)
    config_fix = "fix it in config/config.yaml (see config/README.md)"
    check_names(config)
    for key in ("datasets", "mlflow"):
        check_finite(config.get(key), key, config_fix)
    validate(config, schema, "", config_fix)
    check_registered_model(config["mlflow"].get("registered_model"))
    run_schema = schema["$defs"]["run"]
    run_props = run_schema["properties"]
    defaults = with_defaults(config["run_defaults"], run_schema)
    check_finite(defaults, "run_defaults", "fix it in config/config.yaml")
    validate(defaults, run_schema, "run_defaults", "fix it in config/config.yaml")

    table = config["runs"]
    rows = read_runs_table(table, run_props) if isinstance(table, str) else table
    fix = f"fix that cell in {table}" if isinstance(table, str) else "fix it in the runs mapping"
    datasets = {
        name: _dataset_with_defaults(name, spec, schema["$defs"]["dataset"])
        for name, spec in config["datasets"].items()
    }
    resolve_domains(datasets, config["datasets"])
    runs: dict[str, dict[str, Any]] = {}
    for name, row in rows.items():
        check_name("run", name)
        if row is None or not isinstance(row, dict):
            raise ConfigError(f"config error at runs[{name}]: expected a mapping of run keys; {fix}")
        resolved = {**defaults, **row}
        check_finite(resolved, f"runs[{name}]", fix)
        validate(resolved, run_schema, f"runs[{name}]", fix)
        apply_mergekit_config(name, resolved, row)
        check_checkpoints(name, resolved)
        check_run(name, resolved, datasets, fix)
        check_partition(name, resolved, datasets)
        check_model(name, resolved, datasets)
        check_training_loop(name, resolved, datasets)
        check_adapter(name, resolved, datasets)
        check_fsdp(name, resolved, datasets)
        check_training_name(name, resolved)
        runs[name] = resolved
    resolve_init_sources(runs)
    resolve_checkpoint_runs(runs)

    mlflow_cfg = with_defaults(config["mlflow"], schema["properties"]["mlflow"])
    tracking_uri = mlflow_cfg["tracking_uri"] or environ.get("MLFLOW_TRACKING_URI") or DEFAULT_TRACKING_URI
    return Experiment(
        runs,
        datasets,
        tracking_uri,
        mlflow_cfg["experiment"],
        mlflow_cfg["registered_model"],
        mlflow_cfg["live"],
    )


def check_names(config: dict[str, Any]) -> None:
    """The names of an inline runs mapping and of the datasets, before the schema sees them (an empty
    runs mapping is said so here: the schema's oneOf can only say what runs may be)."""
    if config.get("runs") == {}:
        raise ConfigError(
            "config error at runs: the runs mapping is empty; add a run such as `runs: {r1: {}}` (each "
            "run's keys override run_defaults), or point runs at a TSV table such as config/runs.tsv"
        )
    for kind, names in (("run", config.get("runs")), ("dataset", config.get("datasets"))):
        for name in names if isinstance(names, dict) else ():
            check_name(kind, name)


def check_name(kind: str, name: Any) -> None:
    """A run or dataset name becomes a directory and file names: a string (YAML 1.1 reads unquoted
    010, yes, ~ as 8, True, None), of RUN_NAME's characters, at most MAX_NAME_LENGTH long."""
    where = f"config error at {kind}s: {kind} name"
    if not isinstance(name, str):
        raise ConfigError(
            f"{where} {name!r} is not a string: YAML reads unquoted names such as 010, yes, on, ~ or "
            "2024 as numbers, booleans or null; quote it (e.g. '010')"
        )
    if not RUN_NAME.fullmatch(name):
        raise ConfigError(
            f"{where} {name!r} is not allowed; use letters, digits, '_', '.', '-' (it becomes a "
            "directory name)"
        )
    if len(name) > MAX_NAME_LENGTH:
        raise ConfigError(
            f"{where} {name[:12]!r}... is {len(name)} characters long; at most {MAX_NAME_LENGTH} fit "
            f"(a file name holds {NAME_MAX} bytes and the workflow writes {LONGEST_FILE_OF_NAME}); "
            "shorten it"
        )


def check_training_name(name: str, run: dict[str, Any]) -> None:
    """The training's name (the dataset's, then world size, strategy and digest) names files too."""
    training = training_name(run)
    if len(training) > MAX_NAME_LENGTH:
        limit = MAX_NAME_LENGTH - (len(training) - len(run["dataset"]))
        raise ConfigError(
            f"config error at runs[{name}].dataset: its training name {training[:12]!r}... is "
            f"{len(training)} characters long; at most {MAX_NAME_LENGTH} fit (a file name holds "
            f"{NAME_MAX} bytes and the workflow writes {LONGEST_FILE_OF_NAME}); shorten the dataset's "
            f"name to at most {limit} characters"
        )


def resolve_domains(datasets: dict[str, dict[str, Any]], given: dict[str, Any]) -> None:
    """A domains dataset's parts are other datasets of the config, none a domains dataset, all of one
    task, which becomes the domains dataset's task (unless it says its own, which must be the same)."""
    for name, spec in datasets.items():
        parts = find_source(spec["source"]).parts(spec)
        if not parts:
            continue
        where = f"config error at datasets.{name}.parts"
        for part in parts:
            if part not in datasets:
                raise ConfigError(
                    f"{where}: unknown dataset {part!r}; define it under `datasets:` (defined: "
                    f"{', '.join(sorted(n for n in datasets if n != name))})"
                )
            if find_source(datasets[part]["source"]).parts(datasets[part]):
                raise ConfigError(f"{where}: {part!r} is a domains dataset itself; name its parts instead")
        tasks = {part: dataset_task(datasets[part]) for part in parts}
        if len(set(tasks.values())) > 1:
            shown = ", ".join(f"{part} {task}" for part, task in tasks.items())
            raise ConfigError(f"{where}: the parts are of different tasks ({shown}); give them one task")
        task = next(iter(tasks.values()))
        if "task" in given[name] and given[name]["task"] != task:
            raise ConfigError(
                f"config error at datasets.{name}.task: {given[name]['task']} but its parts are {task} "
                "datasets; drop task (it comes from the parts)"
            )
        spec.pop("task", None)
        spec.update(spec_task_entry(task))


def _dataset_with_defaults(name: str, spec: dict[str, Any], schema: dict[str, Any]) -> dict[str, Any]:
    """Fill defaults only for keys the dataset's source takes for its task (class_sep is synthetic
    classification's alone)."""
    filled = with_defaults(spec, schema)
    source = find_source(filled["source"])
    task = filled.get("task") or source.default_task()
    filled.update(spec_task_entry(task))  # the implicit task stays so: older dataset specs keep their params
    accepted = source.accepted(task)
    for key in [key for key in filled if key not in spec and key not in accepted]:
        del filled[key]
    check_dataset_task(name, filled, task)
    if filled["test_fraction"] + filled["val_fraction"] >= 1:
        raise ConfigError(
            f"config error at datasets.{name}: test_fraction + val_fraction = "
            f"{filled['test_fraction'] + filled['val_fraction']:g} leaves no training rows; "
            "make their sum < 1"
        )
    return filled


def run_config_for_tracking(experiment: Experiment, run: str) -> dict[str, Any]:
    """The run's full resolved config, including its dataset's spec, as the tracker logs it."""
    cfg = dict(experiment.runs[run])
    return {"run": run, **cfg, "dataset_spec": experiment.datasets[cfg["dataset"]]}
