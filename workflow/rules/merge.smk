rule merge:
    input:
        gather=rules.gather.output.record,
    output:
        weights="results/runs/{run}/merged.safetensors",
        record="results/runs/{run}/merge.json",
    log:
        "logs/merge/{run}.log",
    benchmark:
        "benchmarks/merge/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    params:
        method=merge_method_of_run,
        tolerance=merge_tolerance_of_run,
    shell:
        "python -m shardfuse.merge --gather {input.gather} --method {params.method}"
        " --tolerance {params.tolerance} --out-weights {output.weights} --out-json {output.record}"
        " > {log} 2>&1"
