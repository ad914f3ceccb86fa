rule track:
    input:
        ranks=ranks_of_run,
        shards=shard_dir_of,
        gather=gather_of_run,
        merge=rules.merge.output.record,
        merged=rules.merge.output.weights,
        evaluation=rules.evaluate.output.record,
        ddp_baseline=ddp_baseline_of_run,
        plots=rules.plots.output,
        hf=hf_export_of_run,
    output:
        record="results/runs/{run}/mlflow.json",
    log:
        "logs/track/{run}.log",
    benchmark:
        "benchmarks/track/{run}.tsv"
    conda:
        "../../envs/tracking.yaml"
    params:
        config=tracking_config_json,
        tracking_uri=EXPERIMENT.tracking_uri,
        experiment=EXPERIMENT.mlflow_experiment,
        registered_model=registered_model_args,
        hf=hf_export_args,
        snakefile=workflow.main_snakefile,
    shell:
        "python -m shardfuse.tracking --run {wildcards.run} --run-dir results/runs/{wildcards.run}"
        " --train-dir {input.ranks} --gather {input.gather}"
        " --manifest {input.shards}/manifest.json --config-json {params.config:q}"
        " --tracking-uri {params.tracking_uri:q} --experiment {params.experiment:q}"
        " {params.registered_model} {params.hf} --ddp-baseline {input.ddp_baseline:q}"
        " --plots-dir results/runs/{wildcards.run}/plots --snakefile {params.snakefile:q}"
        " --out {output.record} > {log} 2>&1"


rule track_comparison:
    input:
        png=rules.compare_merge_methods.output.png,
        communication=rules.compare_communication.output.png,
        summary=rules.summary.output.csv,
        records=expand(rules.track.output.record, run=RUNS),
    output:
        record="results/plots/comparison.mlflow.json",
    log:
        "logs/track/comparison.log",
    conda:
        "../../envs/tracking.yaml"
    shell:
        "python -m shardfuse.comparison --png {input.png} {input.communication}"
        " --summary {input.summary} --records {input.records} --out {output.record} > {log} 2>&1"
