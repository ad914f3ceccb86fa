rule gather:
    input:
        ranks=rules.train.output.ranks,
    output:
        record="results/trainings/{training}/gather.json",
    log:
        "logs/gather/{training}.log",
    benchmark:
        "benchmarks/gather/{training}.tsv"
    conda:
        "../../envs/train.yaml"
    params:
        world_size=world_size_of,
    shell:
        "python -m shardfuse.gather --train-dir {input.ranks} --world-size {params.world_size}"
        " --out {output.record} > {log} 2>&1"
