rule evaluate:
    input:
        test=test_split_of_run,
        gather=gather_of_run,
        merged=rules.merge.output.weights,
        # non-iid shard sets: each rank scored on its local test distribution too
        local=local_shards_of_run,
        # a domains dataset: every model scored on each part too
        domains=domain_record_of_run,
    output:
        record="results/runs/{run}/eval.json",
    log:
        "logs/evaluate/{run}.log",
    benchmark:
        "benchmarks/evaluate/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        batch_size=eval_batch_size_of_run,
        local=local_set_args,
    shell:
        "python -m shardfuse.evaluate --run {wildcards.run} --test {input.test} --gather {input.gather}"
        " --merged {input.merged}{params.local} --batch-size {params.batch_size}"
        " --out {output.record} > {log} 2>&1"
