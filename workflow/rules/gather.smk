rule gather:
    input:
        train=rules.train.output.train,
    output:
        record="results/runs/{run}/gather.json",
    log:
        "logs/gather/{run}.log",
    conda:
        "../../envs/train.yaml"
    params:
        world_size=world_size_of_run,
    shell:
        "python -m shardfuse.gather --train-dir {input.train} --world-size {params.world_size}"
        " --out {output.record} > {log} 2>&1"
