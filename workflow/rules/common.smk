# Wiring only: config validation, the run table, wildcard constraints and named input functions.
import json
import os
import re
import shlex
import sys
from pathlib import Path

from snakemake.exceptions import WorkflowError
from snakemake.iocontainers import Wildcards

SRC_DIR = str(Path(workflow.basedir) / "src")
if SRC_DIR not in sys.path:
    sys.path.insert(0, SRC_DIR)
# Jobs (local, or re-executed on a SLURM node) import shardfuse from this checkout even when the
# environment has only the dependencies installed (e.g. the per-rule conda envs).
# SHARDFUSE_ERRORS_AT_END: the onerror handler prints each failed job's one-line errors last, so a
# stage run as a job does not echo them on the console as well (shardfuse.launch).
# SHARDFUSE_QUIET: under --quiet the trainings do not echo their progress on the console (shardfuse.launch).
# SHARDFUSE_CONSOLE_FD: descriptor 9 is the job's console (its stderr before the rule sends it to the
# log), named with its device and inode: long stages print how far they are there (shardfuse.console.progress).
_QUIET = {
    str(level).lower()
    for level in (getattr(workflow.output_settings, "quiet", None) or ())
}
shell.prefix(
    f"set -euo pipefail; export PYTHONPATH={shlex.quote(SRC_DIR)}${{{{PYTHONPATH:+:$PYTHONPATH}}}}; "
    "export SHARDFUSE_ERRORS_AT_END=1; "
    + (
        "export SHARDFUSE_QUIET=1; "
        if _QUIET & {"all", "progress"}
        else 'exec 9>&2; export SHARDFUSE_CONSOLE_FD="9:$(stat -L -c %d:%i /dev/fd/9 2>/dev/null)"; '
    )
)

from shardfuse.checkpoints.init_weights import weight_files  # noqa: E402
from shardfuse.cluster.slurm import (  # noqa: E402
    CpuRequest,
    cpus_per_node,
    oversized_cpu_requests,
    partition_cpus,
)
from shardfuse.cluster.torchrun import Geometry, job_resources  # noqa: E402
from shardfuse.data.provenance import (  # noqa: E402
    dataset_files,
    files_digest,
    init_files_digest,
)
from shardfuse.data.sources.registry import find_source  # noqa: E402
from shardfuse.experiment.keys import (  # noqa: E402
    merge_align_args,
    merge_params,
    partition_args,
    shardset_identity,
    scores_locally,
    is_checkpoint_run,
    shard_config,
    shardset_name,
    train_config,
)
from shardfuse.experiment.load import (  # noqa: E402
    check_run_folders,
    load_experiment,
    run_config_for_tracking,
)
from shardfuse.experiment.schema import ConfigError  # noqa: E402
from shardfuse.io import UserError, write_json  # noqa: E402
from shardfuse.io import check_content_name, content_name, read_json  # noqa: E402
from shardfuse.models.catalog import exports_hf  # noqa: E402

try:
    EXPERIMENT = load_experiment(
        config,
        schema_path=Path(workflow.basedir)
        / "workflow"
        / "schemas"
        / "config.schema.yaml",
        # Read again, refusing duplicate keys (Snakemake's loader keeps the last silently); in the
        # order they override each other: the Snakefile's config/config.yaml, then each --configfile.
        config_files=[
            *(
                f
                for f in workflow.configfiles
                if f not in workflow.overwrite_configfiles
            ),
            *workflow.overwrite_configfiles,
        ],
    )
    check_run_folders(EXPERIMENT)
except ConfigError as exc:
    raise WorkflowError(str(exc)) from None

RUNS = EXPERIMENT.runs
# Runs that differ only in merge keys share a training (see shardfuse.experiment.keys.training_name).
TRAININGS = EXPERIMENT.trainings
# Every shard set a run uses ("dataset/name") -> the partition command's options.
SHARDSETS = {
    f"{cfg['dataset']}/{shardset_name(shard_config(cfg))}": partition_args(
        shard_config(cfg)
    )
    for cfg in RUNS.values()
}
# Trainings made by the train rule, and the runs over checkpoints' collections (the collect rule).
COLLECTED = [name for name, cfg in TRAININGS.items() if is_checkpoint_run(cfg)]
TRAINED = [name for name in TRAININGS if name not in COLLECTED]


wildcard_constraints:
    run="|".join(re.escape(run) for run in RUNS),
    training="|".join(re.escape(name) for name in TRAININGS),
    dataset="|".join(re.escape(name) for name in EXPERIMENT.datasets),
    shardset="|".join(re.escape(key.partition("/")[2]) for key in SHARDSETS),


def print_failed_job_errors(snakemake_logs):
    """onerror: each failed job's one-line error, after Snakemake's own messages (``log`` is the
    Snakemake log's path, or a list of them)."""
    from shardfuse.console.failures import (
        baseline_warnings,
        failed_job_errors,
        failed_jobs,
    )

    paths = (
        [snakemake_logs] if isinstance(snakemake_logs, (str, Path)) else snakemake_logs
    )
    baselines = {
        run: (baseline, EXPERIMENT.training(baseline))
        for run in RUNS
        if (baseline := EXPERIMENT.ddp_baseline(run)) is not None
    }
    for path in paths:
        for line in failed_job_errors(Path(path)):
            print(line, file=sys.stderr)
        logs = [log for _, job_logs in failed_jobs(Path(path)) for log in job_logs]
        for line in baseline_warnings(logs, baselines):
            print(line, file=sys.stderr)


def _failed_upstream(job, failed_jobs):
    """The failed jobs among ``job`` and everything it depends on, nearest first."""
    seen, queue, found = {job}, [job], []
    while queue:
        current = queue.pop(0)
        if current in failed_jobs:
            found.append(current)
        for dependency in workflow.dag.dependencies[current]:
            if dependency not in seen:
                seen.add(dependency)
                queue.append(dependency)
    return found


def _failure_of(job):
    from shardfuse.console.failures import stage_errors
    from shardfuse.experiment.outcome import failure_line

    logs = [Path(log) for log in job.log]
    return failure_line(
        job.rule.name, logs, [error for log in logs for error in stage_errors(log)]
    )


def report_finished_runs():
    """onerror: when runs failed, run the report's jobs (summary, figures, MLflow) for the runs that
    finished, the failed ones marked (shardfuse.experiment.outcome); not after Ctrl-C or a failed
    report job. Each prints a line; a report job that fails says so and ends the report.
    """
    from subprocess import CalledProcessError

    from snakemake.shell import shell as run_shell

    from shardfuse.experiment.outcome import (
        FAILED_RUNS_ENV,
        NEED_FINISHED,
        REPORT_RULES,
        date_partial,
        report_line,
        write_failed_runs,
    )

    scheduler = getattr(workflow, "scheduler", None)
    failed_jobs = set(getattr(scheduler, "failed", None) or ())
    if not failed_jobs or getattr(scheduler, "_user_kill", None):
        return
    dag = workflow.dag
    pending = {
        job.rule.name: job
        for job in dag.needrun_jobs()
        if job.rule.name in REPORT_RULES
    }
    if "summary" not in pending or any(
        job.rule.name in REPORT_RULES for job in failed_jobs
    ):
        return
    evaluations = {
        job.wildcards.run: job for job in dag.jobs if job.rule.name == "evaluate"
    }
    finished, failed = [], {}
    for run in RUNS:
        if dag.noneedrun_finished(evaluations[run]):
            finished.append(run)
        else:
            upstream = _failed_upstream(evaluations[run], failed_jobs)
            failed[run] = (
                _failure_of(upstream[0])
                if upstream
                else "not run: a job it needs failed"
            )
    path = write_failed_runs(Path(".snakemake/shardfuse/failed-runs.json"), failed)
    os.environ[FAILED_RUNS_ENV] = str(path.resolve())
    try:
        for name in REPORT_RULES:
            job = pending.get(name)
            if job is None or (name in NEED_FINISHED and not finished):
                continue
            for made in (*job.output, *job.log):
                Path(made).parent.mkdir(parents=True, exist_ok=True)
            try:
                # The command is formatted already: shell() formats it again, so its braces are escaped.
                run_shell(job.shellcmd.replace("{", "{{").replace("}", "}}"))
            except CalledProcessError:
                print(
                    f"shardfuse: the report's {name} job failed too; see {', '.join(job.log)}",
                    file=sys.stderr,
                )
                return
            finally:
                date_partial(job.output)
    finally:
        del os.environ[FAILED_RUNS_ENV]
    print(report_line(finished, failed, pending["summary"].output[0]), file=sys.stderr)


def fail_multi_node_runs_without_slurm():
    """Several nodes need an allocation: say so before any local job starts, not at train time."""
    multi_node = sorted(run for run, cfg in RUNS.items() if cfg["nodes"] > 1)
    if multi_node and workflow.local_exec and not workflow.dryrun:
        raise WorkflowError(
            f"run(s) {', '.join(multi_node)} ask for several nodes, which needs a SLURM allocation; "
            "run with --profile profiles/slurm or set nodes to 1"
        )


def fail_train_jobs_larger_than_their_partition():
    """On SLURM: a train job that asks for more CPUs per node than its partition's largest node would
    be rejected by sbatch only when its turn comes; say so, with the run and the knob, before any job.
    """
    if workflow.local_exec or workflow.dryrun:
        return
    cluster = partition_cpus()
    if cluster is None:
        return
    requests = []
    for job in workflow.dag.needrun_jobs():
        if job.rule.name != "train":
            continue
        resources = dict(job.resources.items())
        found = cpus_per_node(job.threads, resources)
        if found is None:
            continue
        training = job.wildcards.training
        runs = tuple(run for run in RUNS if EXPERIMENT.training(run) == training)
        partition = resources.get("slurm_partition") or None
        requests.append(CpuRequest(training, runs, found[0], partition, found[1]))
    errors = oversized_cpu_requests(requests, *cluster)
    if errors:
        raise WorkflowError("\n".join(errors))


def _json(obj):
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _cfg(wildcards):
    """The config behind a job: its run's, or (train, gather) its training's."""
    if "run" in wildcards.keys():
        return RUNS[wildcards.run]
    return TRAININGS[wildcards.training]


# prepare_dataset, partition
def dataset_spec_json(wildcards):
    return _json(EXPERIMENT.datasets[wildcards.dataset])


def dataset_source_files(wildcards):
    """Every file the dataset is built from (shardfuse.data.provenance): edit, add or remove one and
    prepare runs again."""
    return dataset_files(EXPERIMENT.datasets[wildcards.dataset])


def dataset_content_digest(wildcards):
    """A params trigger on the inputs' contents, for a file replaced under an older mtime (cp -p, a
    restored backup). Per-file digests are cached by stat signature, so a DAG build reads only new files.
    """
    try:
        return files_digest(
            dataset_source_files(wildcards),
            Path(".snakemake/shardfuse/inputs") / f"{wildcards.dataset}.json",
        )
    # a FIFO or a device among the files: one line, before any job
    except UserError as exc:
        raise WorkflowError(f"dataset {wildcards.dataset}: {exc}") from None


def partition_args_of(wildcards):
    """The partition command's options: the shard set's identity from the config of the runs that use
    it (shardfuse.experiment.keys.partition_args), never parsed back from its directory name.
    """
    key = f"{wildcards.dataset}/{wildcards.shardset}"
    if key not in SHARDSETS:
        raise WorkflowError(
            f"no run uses the shard set results/shards/{key}; ask for one that a run of the config "
            "uses (a shard set is made from its run's keys, not from its directory name)"
        )
    return SHARDSETS[key]


# train, gather (wildcard: training)
def shard_dir_of(wildcards):
    cfg = shard_config(_cfg(wildcards))
    return f"results/shards/{cfg['dataset']}/{shardset_name(cfg)}"


# collect (wildcard: training; a run over checkpoints)
def _checkpoint_paths(source):
    """The files of one checkpoint entry the collect rule reads (another run's merged model or its
    training's ranks: a DAG edge)."""
    if "rank" in source:
        return [f"results/trainings/{EXPERIMENT.training(source['run'])}/gather.json"]
    if "run" in source:
        return [f"results/runs/{source['run']}/merged.safetensors"]
    if "folder" in source:
        return [str(file) for file in weight_files(source["folder"]).paths]
    return [source["file"]]


def checkpoint_files_of(wildcards):
    """Every file the run's checkpoints and base are read from: editing one re-collects this run."""
    cfg = _cfg(wildcards)
    sources = [
        *cfg["checkpoint_sources"],
        *([cfg["base_source"]] if cfg["base_source"] else []),
    ]
    return [path for source in sources for path in _checkpoint_paths(source)]


def _source_arg(source):
    if "rank" in source:
        training = EXPERIMENT.training(source["run"])
        return f"results/trainings/{training}/ranks/rank-{source['rank']}.safetensors"
    if "run" in source:
        return f"results/runs/{source['run']}/merged.safetensors"
    return source.get("file") or source["folder"]


def collect_sources_args(wildcards):
    cfg = _cfg(wildcards)
    args = [
        f"--checkpoint {shlex.quote(_source_arg(s))}" for s in cfg["checkpoint_sources"]
    ]
    if cfg["base_source"]:
        args.append(f"--base {shlex.quote(_source_arg(cfg['base_source']))}")
    return " ".join(args)


def dataset_dir_of(wildcards):
    return f"results/datasets/{_cfg(wildcards)['dataset']}"


def dataset_info_of(wildcards):
    return f"{dataset_dir_of(wildcards)}/dataset.json"


def world_size_of(wildcards):
    return _cfg(wildcards)["world_size"]


def nodes_of(wildcards):
    return _cfg(wildcards)["nodes"]


def nproc_per_node_of(wildcards):
    return _cfg(wildcards)["nproc_per_node"]


def max_restarts_of(wildcards):
    return _cfg(wildcards)["max_restarts"]


def min_ranks_args(wildcards):
    """--min-ranks for a training that may go on without a rank lost for good (none by default, so the
    command of every other training is unchanged)."""
    cfg = _cfg(wildcards)
    if cfg.get("min_ranks") is None:
        return ""
    timeout = f"--node-timeout {cfg['node_timeout']} " if cfg["nodes"] > 1 else ""
    return f"--min-ranks {cfg['min_ranks']} {timeout}"


def train_config_json(wildcards):
    return _json(train_config(_cfg(wildcards)))


def init_path_of(wildcards):
    """init_from's weights: a file, a save_pretrained folder, or another run's merged model (a DAG
    edge: that run's merge runs first, and re-running it re-trains this one)."""
    source = _cfg(wildcards).get("init_source")
    if source is None:
        return None
    if "run" in source:
        return f"results/runs/{source['run']}/merged.safetensors"
    return source.get("file") or source["folder"]


def init_weights_of(wildcards):
    """The files init_from's weights are read from (a folder's index and shards)."""
    path = init_path_of(wildcards)
    if path is None:
        return []
    if "folder" in _cfg(wildcards)["init_source"]:
        return [str(file) for file in weight_files(path).paths]
    return [path]


def init_from_args(wildcards):
    """--init-from PATH, and for a file or folder the digest of its weights' contents (--init-sha256):
    weights replaced under an older mtime (cp -p) change the job's params and re-train it (another run's
    merged model is a DAG edge instead)."""
    path = init_path_of(wildcards)
    if not path:
        return ""
    if "run" in _cfg(wildcards)["init_source"]:
        return f"--init-from {shlex.quote(path)}"
    cache = Path(".snakemake/shardfuse/inputs") / f"init-{wildcards.training}.json"
    return f"--init-from {shlex.quote(path)} --init-sha256 {init_files_digest(path, cache)}"


def train_job_resource(name):
    """A resource function for the train rule, from shardfuse.cluster.torchrun.job_resources."""

    def resource(wildcards):
        cfg = _cfg(wildcards)
        return job_resources(
            Geometry(cfg["nodes"], cfg["nproc_per_node"]), cfg.get("min_ranks")
        )[name]

    resource.__name__ = f"train_{name}_of"
    return resource


# merge, evaluate, track, summary (wildcard: run)
def training_dir_of_run(wildcards):
    return f"results/trainings/{EXPERIMENT.training(wildcards.run)}"


def ranks_of_run(wildcards):
    return f"{training_dir_of_run(wildcards)}/ranks"


def gather_of_run(wildcards):
    return f"{training_dir_of_run(wildcards)}/gather.json"


def val_split_of_run(wildcards):
    return f"{dataset_dir_of(wildcards)}/val.parquet"


def test_split_of_run(wildcards):
    return f"{dataset_dir_of(wildcards)}/test.parquet"


def merge_method_of_run(wildcards):
    return RUNS[wildcards.run]["merge_method"]


def merge_params_json(wildcards):
    return _json(merge_params(RUNS[wildcards.run]))


def merge_search_args(wildcards):
    """--search-json and --search-db for a run with merge_search (the study beside the run, resumed by a
    re-run: not an output, so a failed merge does not remove it); nothing otherwise."""
    search = RUNS[wildcards.run].get("merge_search")
    if search is None:
        return ""
    db = f"results/runs/{wildcards.run}/search.db"
    return f"--search-json {shlex.quote(_json(search))} --search-db {shlex.quote(db)}"


def merge_align_of_run(wildcards):
    return merge_align_args(RUNS[wildcards.run])


def local_shards_of_run(wildcards):
    """The run's shard set, when evaluate scores each rank on its local test distribution (every
    partitioner but iid: shardfuse.experiment.keys.scores_locally); none otherwise."""
    return [shard_dir_of(wildcards)] if scores_locally(RUNS[wildcards.run]) else []


def domain_record_of_run(wildcards):
    """The run's dataset.json when its dataset is made of parts (a domains dataset) and its shards are
    iid (evaluate then scores every model on each part); none otherwise: a run with local sets is scored
    on its ranks' own data instead (partition: domain, part r on rank r: the local sets are the parts),
    and evaluate takes one kind of set over the test split's rows."""
    dataset = RUNS[wildcards.run]["dataset"]
    spec = EXPERIMENT.datasets[dataset]
    made_of_parts = find_source(spec["source"]).parts(spec)
    if not made_of_parts or scores_locally(RUNS[wildcards.run]):
        return []
    return [f"results/datasets/{dataset}/dataset.json"]


def local_set_args(wildcards):
    """evaluate's --set local=<shard set>/manifest.json and --set domain=<dataset.json>, or nothing
    (iid runs of other datasets keep their command)."""
    paths = [f"local={path}/manifest.json" for path in local_shards_of_run(wildcards)]
    paths += [f"domain={path}" for path in domain_record_of_run(wildcards)]
    return "".join(f" --set {path}" for path in paths)


def eval_batch_size_of_run(wildcards):
    return RUNS[wildcards.run]["eval_batch_size"]


def ddp_baseline_of_run(wildcards):
    """The eval.json of the ddp run trained like this one, if any (a ddp run is its own baseline)."""
    baseline = EXPERIMENT.ddp_baseline(wildcards.run)
    if baseline is None or baseline == wildcards.run:
        return []
    return [f"results/runs/{baseline}/eval.json"]


def hf_export_of_run(wildcards):
    """The run's transformers folder (model hf only): exported, then logged with the MLflow model."""
    return (
        [f"results/runs/{wildcards.run}/hf"]
        if exports_hf(RUNS[wildcards.run]["model"])
        else []
    )


def adapter_export_of_run(wildcards):
    """The run's fused LoRA update as a PEFT adapter folder (merge_adapter svd or cat only)."""
    return (
        [f"results/runs/{wildcards.run}/adapter"]
        if RUNS[wildcards.run].get("merge_adapter", "none") != "none"
        else []
    )


def base_hf_of_run(wildcards):
    """The training's base as a transformers folder (model hf with an adapter exported): the
    base_model_name_or_path of the run's PEFT adapter, so AutoPeftModel loads both."""
    run = RUNS[wildcards.run]
    if not exports_hf(run["model"]) or run.get("merge_adapter", "none") == "none":
        return []
    return [f"{training_dir_of_run(wildcards)}/base-hf"]


def base_ref_args(wildcards):
    return " ".join(f"--base-ref {path}" for path in base_hf_of_run(wildcards))


def _run_wildcards(run):
    return Wildcards(fromdict={"run": run})


def tracking_inputs(wildcards):
    """Every run's training, shards, ddp baseline and transformers export (the track job's inputs)."""
    runs = [_run_wildcards(run) for run in RUNS]
    return {
        "ranks": sorted({ranks_of_run(w) for w in runs}),
        "gathers": sorted({gather_of_run(w) for w in runs}),
        "shards": sorted({shard_dir_of(w) for w in runs}),
        "ddp_baselines": sorted({p for w in runs for p in ddp_baseline_of_run(w)}),
        "hf": [p for w in runs for p in hf_export_of_run(w)],
        "adapters": [p for w in runs for p in adapter_export_of_run(w)],
    }


def tracking_runs(wildcards):
    """The track job's runs: per run, its files and its full resolved config."""
    entries = []
    for run in RUNS:
        w = _run_wildcards(run)
        entry = {
            "run": run,
            "run_dir": f"results/runs/{run}",
            "train_dir": ranks_of_run(w),
            "gather": gather_of_run(w),
            "manifest": f"{shard_dir_of(w)}/manifest.json",
            "config": run_config_for_tracking(EXPERIMENT, run),
            "plots_dir": f"results/runs/{run}/plots",
            "out": f"results/runs/{run}/mlflow.json",
        }
        entry.update({"ddp_baseline": path for path in ddp_baseline_of_run(w)})
        entry.update({"hf_dir": path for path in hf_export_of_run(w)})
        entry.update({"adapter_dir": path for path in adapter_export_of_run(w)})
        entries.append(entry)
    return entries


def tracking_runs_file(wildcards):
    """The track job's --runs-json @FILE, named by its content under .snakemake/shardfuse/track-runs/ (a
    command line holds at most 128 KiB, a sweep's configs more). As the job's param, a changed run
    changes the name, so the job runs again."""
    runs = tracking_runs(wildcards)
    path = Path(".snakemake/shardfuse/track-runs") / content_name(runs)
    # Missing, or edited since: written again (the track job checks it once more).
    try:
        check_content_name(path, read_json(path), "track runs file")
    except UserError:
        write_json(path, runs)
    return str(path)


def live_logging_args(wildcards):
    """Extra train arguments when mlflow.live is on (rank 0 logs while training)."""
    if not EXPERIMENT.live:
        return ""
    return (
        f"--live-tracking-uri {shlex.quote(EXPERIMENT.tracking_uri)}"
        f" --live-experiment {shlex.quote(EXPERIMENT.mlflow_experiment)}"
    )


def registered_model_args(wildcards):
    if EXPERIMENT.registered_model is None:
        return ""
    return f"--registered-model {shlex.quote(EXPERIMENT.registered_model)}"


def summary_shard_dirs(wildcards):
    """Every run's shard set when some run is not iid (summary.csv's heterogeneity columns); none for
    an all-iid experiment, whose summary keeps its inputs, params and bytes."""
    if not any(shardset_identity(cfg) for cfg in RUNS.values()):
        return []
    return sorted({shard_dir_of(_run_wildcards(run)) for run in RUNS})


def heterogeneity_plot(wildcards):
    """The merged score against label skew (<results_dir>/plots/heterogeneity.png) when some run is not iid;
    nothing for an all-iid experiment, whose comparison keeps its command."""
    png = f"{EXPERIMENT.results_dir}/plots/heterogeneity.png"
    return [png] if summary_shard_dirs(wildcards) else []


def summary_runs_json(wildcards):
    keys = ("dataset", "world_size", "strategy", "sync_every")
    with_manifests = bool(summary_shard_dirs(wildcards))
    rows = {
        run: {
            **{key: cfg[key] for key in keys},
            "training": EXPERIMENT.training(run),
            "ddp_baseline": EXPERIMENT.ddp_baseline(run),
            **(
                {"manifest": f"{shard_dir_of(_run_wildcards(run))}/manifest.json"}
                if with_manifests
                else {}
            ),
        }
        for run, cfg in RUNS.items()
    }
    return json.dumps(
        rows, separators=(",", ":")
    )  # unsorted: the summary keeps the table's order
