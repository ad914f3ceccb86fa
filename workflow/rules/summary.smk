rule summary:
    input:
        evaluations=expand(rules.evaluate.output.record, run=RUNS),
        merges=expand(rules.merge.output.record, run=RUNS),
        gathers=expand(rules.gather.output.record, training=TRAININGS),
        shards=summary_shard_dirs,
    output:
        csv=report(
            f"{EXPERIMENT.results_dir}/summary.csv",
            caption="../report/summary.rst",
            category="Summary",
        ),
    log:
        "logs/summary/summary.log",
    conda:
        "../../envs/tracking.yaml"
    params:
        runs=summary_runs_json,
    shell:
        "python -m shardfuse.summary --runs-json {params.runs:q} --results-dir results/runs"
        " --out {output.csv} > {log} 2>&1"
