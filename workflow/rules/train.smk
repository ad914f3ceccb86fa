rule train:
    input:
        shards=shard_dir_of_run,
        info=dataset_info_of_run,
    output:
        train=directory("results/runs/{run}/train"),
    log:
        "logs/train/{run}.log",
    benchmark:
        "benchmarks/train/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    threads: world_size_of_run
    params:
        world_size=world_size_of_run,
        dataset_dir=dataset_dir_of_run,
        config=train_config_json,
    shell:
        "python -m shardfuse.launch --world-size {params.world_size} --out-dir {output.train} --"
        " --run-name {wildcards.run} --shard-dir {input.shards} --dataset-dir {params.dataset_dir}"
        " --config-json {params.config:q} > {log} 2>&1"
