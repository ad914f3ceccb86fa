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
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        world_size=world_size_of,
    shell:
        "python -m shardfuse.gather --train-dir {input.ranks} --world-size {params.world_size}"
        " --out {output.record} > {log} 2>&1"
