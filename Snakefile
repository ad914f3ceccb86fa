# shardfuse: partition → torchrun → gather → merge → evaluate → MLflow. See README.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


# Run on the submit host, never as cluster jobs: track and track_comparison are the one MLflow
# writer (compute nodes often cannot reach a tracking server, and SQLite locks under many writers);
# summary, plots and the compare_* figures are cheap (small CSV/Parquet/JSON files).
localrules:
    track,
    track_comparison,
    summary,
    plots,
    compare_merge_methods,
    compare_communication,
    compare_heterogeneity,


# A SLURM job group's own pool (profiles/slurm: groups, resources: group_slots=N), not the workflow's.
resource_scopes:
    group_slots="local",


include: "workflow/rules/common.smk"
include: "workflow/rules/prepare.smk"
include: "workflow/rules/partition.smk"
include: "workflow/rules/train.smk"
include: "workflow/rules/gather.smk"
include: "workflow/rules/merge.smk"
include: "workflow/rules/evaluate.smk"
include: "workflow/rules/summary.smk"
include: "workflow/rules/plots.smk"
include: "workflow/rules/track.smk"


onstart:
    fail_multi_node_runs_without_slurm()
    fail_train_jobs_larger_than_their_partition()


# Runs that failed leave the others reported: the summary, figures and MLflow (README "When a run
# fails"); then each failed job's own one-line error (in its log) is the last thing printed.
onerror:
    report_finished_runs()
    print_failed_job_errors(log)


rule all:
    default_target: True
    input:
        rules.summary.output.csv,
        rules.track.output.records,
        rules.track_comparison.output.record,
