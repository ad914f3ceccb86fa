rule train:
    input:
        shards=shard_dir_of,
        info=dataset_info_of,
        init=init_weights_of,
    output:
        ranks=directory("results/trainings/{training}/ranks"),
    log:
        "logs/train/{training}.log",
    benchmark:
        "benchmarks/train/{training}.tsv"
    wildcard_constraints:
        training="|".join(re.escape(name) for name in TRAINED) or "(?!)",
    conda:
        "../../envs/train.yaml"
    threads: nproc_per_node_of
    resources:
        # Defaults for this rule; a profile's set-resources (train: ...) overrides them key by key.
        # Partition, account and GPUs (gres) come from the cluster profile.
        mem_mb=4000,
        runtime=120,
        # Launch geometry from the run's nodes (shardfuse.cluster.torchrun.job_resources): one SLURM task
        # per node.
        nodes=train_job_resource("nodes"),
        tasks=train_job_resource("tasks"),
        tasks_per_gpu=train_job_resource("tasks_per_gpu"),
        mpi=train_job_resource("mpi"),
        slurm_extra=train_job_resource("slurm_extra"),
    params:
        nodes=nodes_of,
        nproc_per_node=nproc_per_node_of,
        max_restarts=max_restarts_of,
        min_ranks=min_ranks_args,
        dataset_dir=dataset_dir_of,
        config=train_config_json,
        live=live_logging_args,
        init=init_from_args,
    shell:
        "python -m shardfuse.launch --nodes {params.nodes} --nproc-per-node {params.nproc_per_node}"
        " --max-restarts {params.max_restarts} {params.min_ranks}--out-dir {output.ranks} --log {log} --"
        " --run-name {wildcards.training} --shard-dir {input.shards}"
        " --dataset-dir {params.dataset_dir} --config-json {params.config:q} {params.init} {params.live}"


rule collect:
    input:
        checkpoints=checkpoint_files_of,
        info=dataset_info_of,
        shards=shard_dir_of,
    output:
        ranks=directory("results/trainings/{training}/ranks"),
    log:
        "logs/collect/{training}.log",
    benchmark:
        "benchmarks/collect/{training}.tsv"
    wildcard_constraints:
        training="|".join(re.escape(name) for name in COLLECTED) or "(?!)",
    conda:
        "../../envs/train.yaml"
    params:
        dataset_dir=dataset_dir_of,
        config=train_config_json,
        sources=collect_sources_args,
    shell:
        "python -m shardfuse.collect --run-name {wildcards.training} --shard-dir {input.shards}"
        " --dataset-dir {params.dataset_dir} --config-json {params.config:q} {params.sources}"
        " --out-dir {output.ranks} > {log} 2>&1"
