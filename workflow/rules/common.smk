# Wiring only: config validation, the run table, wildcard constraints and named input functions.
import json
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError

SRC_DIR = str(Path(workflow.basedir) / "src")
if SRC_DIR not in sys.path:
    sys.path.insert(0, SRC_DIR)
# Jobs (local, or re-executed on a SLURM node) import shardfuse from this checkout even when the
# environment has only the dependencies installed (e.g. the per-rule conda envs).
shell.prefix(
    f"set -euo pipefail; export PYTHONPATH={shlex.quote(SRC_DIR)}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
)

from shardfuse.launch import Geometry, job_resources  # noqa: E402
from shardfuse.config import (  # noqa: E402
    TRAIN_KEYS,
    ConfigError,
    load_experiment,
    run_config_for_tracking,
)

try:
    EXPERIMENT = load_experiment(
        config,
        schema_path=Path(workflow.basedir)
        / "workflow"
        / "schemas"
        / "config.schema.yaml",
    )
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

RUNS = EXPERIMENT.runs


wildcard_constraints:
    run="|".join(re.escape(run) for run in RUNS),
    dataset="|".join(re.escape(name) for name in EXPERIMENT.datasets),
    shardset=r"w\d+-seed\d+(-drop)?",


def fail_multi_node_runs_without_slurm():
    """Several nodes need an allocation: say so before any local job starts, not at train time."""
    multi_node = sorted(run for run, cfg in RUNS.items() if cfg["nodes"] > 1)
    if multi_node and workflow.local_exec and not workflow.dryrun:
        raise WorkflowError(
            f"run(s) {', '.join(multi_node)} ask for several nodes, which needs a SLURM allocation; "
            "run with --profile profiles/slurm or set nodes to 1"
        )


def _json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def dataset_spec_json(wildcards):
    return _json(EXPERIMENT.datasets[wildcards.dataset])


def dataset_source_files(wildcards):
    spec = EXPERIMENT.datasets[wildcards.dataset]
    return [spec["path"]] if "path" in spec else []


def shardset_args(wildcards):
    match = re.fullmatch(r"w(\d+)-seed(\d+)(-drop)?", wildcards.shardset)
    drop = " --drop-remainder" if match.group(3) else ""
    return f"--world-size {match.group(1)} --seed {match.group(2)}{drop}"


def shard_dir_of_run(wildcards):
    return EXPERIMENT.shard_dir(wildcards.run)


def dataset_dir_of_run(wildcards):
    return f"results/datasets/{RUNS[wildcards.run]['dataset']}"


def dataset_info_of_run(wildcards):
    return f"{dataset_dir_of_run(wildcards)}/dataset.json"


def test_split_of_run(wildcards):
    return f"{dataset_dir_of_run(wildcards)}/test.parquet"


def world_size_of_run(wildcards):
    return RUNS[wildcards.run]["world_size"]


def nodes_of_run(wildcards):
    return RUNS[wildcards.run]["nodes"]


def nproc_per_node_of_run(wildcards):
    return RUNS[wildcards.run]["nproc_per_node"]


def geometry_of_run(wildcards):
    cfg = RUNS[wildcards.run]
    return Geometry(cfg["nodes"], cfg["nproc_per_node"])


def train_job_resource(name):
    """A resource function for the train rule, from shardfuse.launch.job_resources."""

    def resource(wildcards):
        return job_resources(geometry_of_run(wildcards))[name]

    resource.__name__ = f"train_{name}_of_run"
    return resource


def train_config_json(wildcards):
    return _json({key: RUNS[wildcards.run][key] for key in TRAIN_KEYS})


def merge_method_of_run(wildcards):
    return RUNS[wildcards.run]["merge_method"]


def merge_tolerance_of_run(wildcards):
    return RUNS[wildcards.run]["merge_tolerance"]


def eval_batch_size_of_run(wildcards):
    return RUNS[wildcards.run]["eval_batch_size"]


def tracking_config_json(wildcards):
    return _json(run_config_for_tracking(EXPERIMENT, wildcards.run))


def summary_runs_json(wildcards):
    return _json(RUNS)
