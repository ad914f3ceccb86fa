# One job pushes every run (one MLflow writer process per invocation: MLflow is imported and the
# store opened once; an unchanged run costs one search). It waits for every run, like the summary.
rule track:
    input:
        unpack(tracking_inputs),
        merges=expand(rules.merge.output.record, run=RUNS),
        merged=expand(rules.merge.output.weights, run=RUNS),
        evaluations=expand(rules.evaluate.output.record, run=RUNS),
        plots=expand(rules.plots.output, run=RUNS),
    output:
        records=expand("results/runs/{run}/mlflow.json", run=RUNS),
    log:
        "logs/track/runs.log",
    benchmark:
        "benchmarks/track/runs.tsv"
    conda:
        "../../envs/tracking.yaml"
    params:
        runs_file=tracking_runs_file,
        tracking_uri=EXPERIMENT.tracking_uri,
        experiment=EXPERIMENT.mlflow_experiment,
        registered_model=registered_model_args,
        snakefile=workflow.main_snakefile,
    shell:
        "python -m shardfuse.tracking --runs-json @{params.runs_file:q}"
        " --tracking-uri {params.tracking_uri:q} --experiment {params.experiment:q}"
        " {params.registered_model} --snakefile {params.snakefile:q} > {log} 2>&1"


rule track_comparison:
    input:
        png=rules.compare_merge_methods.output.png,
        communication=rules.compare_communication.output.png,
        heterogeneity=heterogeneity_plot,
        summary=rules.summary.output.csv,
        records=rules.track.output.records,
    output:
        record=f"{EXPERIMENT.results_dir}/plots/comparison.mlflow.json",
    log:
        "logs/track/comparison.log",
    conda:
        "../../envs/tracking.yaml"
    params:
        heterogeneity=lambda wildcards, input: "".join(
            f" {png}" for png in input.heterogeneity
        ),
    shell:
        "python -m shardfuse.comparison --png {input.png} {input.communication}{params.heterogeneity}"
        " --summary {input.summary} --records {input.records} --out {output.record} > {log} 2>&1"
