rule merge:
    input:
        gather=gather_of_run,
        val=val_split_of_run,
    output:
        weights="results/runs/{run}/merged.safetensors",
        record="results/runs/{run}/merge.json",
    log:
        "logs/merge/{run}.log",
    benchmark:
        "benchmarks/merge/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        method=merge_method_of_run,
        merge_params=merge_params_json,
        align=merge_align_of_run,
        batch_size=eval_batch_size_of_run,
        search=merge_search_args,
    shell:
        "python -m shardfuse.merge --run {wildcards.run} --gather {input.gather} --method {params.method}"
        " --params-json {params.merge_params:q} --val-split {input.val} --batch-size {params.batch_size}"
        " {params.align} {params.search} --out-weights {output.weights} --out-json {output.record} > {log} 2>&1"


rule export_adapter:
    input:
        gather=gather_of_run,
        record=rules.merge.output.record,
        base_hf=base_hf_of_run,
    output:
        folder=directory("results/runs/{run}/adapter"),
    log:
        "logs/export_adapter/{run}.log",
    benchmark:
        "benchmarks/export_adapter/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        mode=lambda wildcards: RUNS[wildcards.run]["merge_adapter"],
        base_ref=base_ref_args,
    shell:
        "python -m shardfuse.export_adapter --gather {input.gather} --merge-json {input.record}"
        " --mode {params.mode} {params.base_ref} --out {output.folder} > {log} 2>&1"


rule export_base_hf:
    input:
        ranks="results/trainings/{training}/ranks",
    output:
        folder=directory("results/trainings/{training}/base-hf"),
    log:
        "logs/export/{training}-base.log",
    benchmark:
        "benchmarks/export/{training}-base.tsv"
    conda:
        "../../envs/train.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    shell:
        "python -m shardfuse.export --weights {input.ranks}/base.safetensors --out {output.folder} > {log} 2>&1"


rule export_hf:
    input:
        weights=rules.merge.output.weights,
    output:
        folder=directory("results/runs/{run}/hf"),
    log:
        "logs/export/{run}.log",
    benchmark:
        "benchmarks/export/{run}.tsv"
    conda:
        "../../envs/train.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    shell:
        "python -m shardfuse.export --weights {input.weights} --out {output.folder} > {log} 2>&1"
