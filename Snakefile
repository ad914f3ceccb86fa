# shardfuse: partition → torchrun → gather → merge → evaluate → MLflow. See README.md.
from snakemake.utils import min_version

min_version("9.0")


configfile: "config/config.yaml"


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


rule all:
    default_target: True
    input:
        rules.summary.output.csv,
        expand(rules.track.output.record, run=RUNS),
        rules.track_comparison.output.record,
