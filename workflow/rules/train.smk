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
    threads: nproc_per_node_of_run
    resources:
        # Launch geometry from the run's nodes (shardfuse.launch.job_resources): one SLURM task
        # per node. Partition, account, memory, runtime and GPUs (gres) come from the profile.
        nodes=train_job_resource("nodes"),
        tasks=train_job_resource("tasks"),
        tasks_per_gpu=train_job_resource("tasks_per_gpu"),
        mpi=train_job_resource("mpi"),
    params:
        nodes=nodes_of_run,
        nproc_per_node=nproc_per_node_of_run,
        dataset_dir=dataset_dir_of_run,
        config=train_config_json,
    shell:
        "python -m shardfuse.launch --nodes {params.nodes} --nproc-per-node {params.nproc_per_node}"
        " --out-dir {output.train} --"
        " --run-name {wildcards.run} --shard-dir {input.shards} --dataset-dir {params.dataset_dir}"
        " --config-json {params.config:q} > {log} 2>&1"
