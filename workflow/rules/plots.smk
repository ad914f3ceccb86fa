rule plots:
    input:
        ranks=ranks_of_run,
        evaluation=rules.evaluate.output.record,
        ddp_baseline=ddp_baseline_of_run,
        shards=shard_dir_of,
    output:
        loss=report(
            "results/runs/{run}/plots/loss.png",
            caption="../report/loss.rst",
            category="Runs",
            subcategory="{run}",
        ),
        throughput=report(
            "results/runs/{run}/plots/throughput.png",
            caption="../report/throughput.rst",
            category="Runs",
            subcategory="{run}",
        ),
        fusion=report(
            "results/runs/{run}/plots/fusion.png",
            caption="../report/fusion.rst",
            category="Runs",
            subcategory="{run}",
        ),
        shards=report(
            "results/runs/{run}/plots/shards.png",
            caption="../report/shards.rst",
            category="Runs",
            subcategory="{run}",
        ),
    log:
        "logs/plots/{run}.log",
    benchmark:
        "benchmarks/plots/{run}.tsv"
    conda:
        "../../envs/tracking.yaml"
    shell:
        "python -m shardfuse.plots --run-dir results/runs/{wildcards.run} --train-dir {input.ranks}"
        " --ddp-baseline {input.ddp_baseline:q} --manifest {input.shards:q}/manifest.json"
        " --out-dir results/runs/{wildcards.run}/plots > {log} 2>&1"


rule compare_merge_methods:
    input:
        summary=rules.summary.output.csv,
    output:
        png=report(
            f"{EXPERIMENT.results_dir}/plots/merge_methods.png",
            caption="../report/merge_methods.rst",
            category="Summary",
        ),
    log:
        "logs/plots/merge_methods.log",
    conda:
        "../../envs/tracking.yaml"
    shell:
        "python -m shardfuse.plots compare --summary {input.summary} --out {output.png} > {log} 2>&1"


rule compare_communication:
    input:
        summary=rules.summary.output.csv,
    output:
        png=report(
            f"{EXPERIMENT.results_dir}/plots/communication.png",
            caption="../report/communication.rst",
            category="Summary",
        ),
    log:
        "logs/plots/communication.log",
    conda:
        "../../envs/tracking.yaml"
    shell:
        "python -m shardfuse.plots communication --summary {input.summary} --out {output.png} > {log} 2>&1"


rule compare_heterogeneity:
    input:
        summary=rules.summary.output.csv,
    output:
        png=report(
            f"{EXPERIMENT.results_dir}/plots/heterogeneity.png",
            caption="../report/heterogeneity.rst",
            category="Summary",
        ),
    log:
        "logs/plots/heterogeneity.log",
    conda:
        "../../envs/tracking.yaml"
    shell:
        "python -m shardfuse.plots heterogeneity --summary {input.summary} --out {output.png} > {log} 2>&1"
