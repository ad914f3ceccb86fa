rule partition:
    input:
        train=rules.prepare_dataset.output.train,
    output:
        shards=directory("results/shards/{dataset}/{shardset}"),
    log:
        "logs/partition/{dataset}/{shardset}.log",
    benchmark:
        "benchmarks/partition/{dataset}/{shardset}.tsv"
    conda:
        "../../envs/data.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        layout=partition_args_of,
    shell:
        "python -m shardfuse.partition --input {input.train} {params.layout}"
        " --out-dir {output.shards} > {log} 2>&1"
