rule prepare_dataset:
    input:
        source=dataset_source_files,
    output:
        train="results/datasets/{dataset}/train.parquet",
        val="results/datasets/{dataset}/val.parquet",
        test="results/datasets/{dataset}/test.parquet",
        info="results/datasets/{dataset}/dataset.json",
    log:
        "logs/prepare_dataset/{dataset}.log",
    benchmark:
        "benchmarks/prepare_dataset/{dataset}.tsv"
    conda:
        "../../envs/data.yaml"
    resources:
        # One slot of a SLURM job group (profiles/slurm: groups, group_slots).
        group_slots=1,
    params:
        spec=dataset_spec_json,
        content=dataset_content_digest,
    shell:
        "python -m shardfuse.prepare --name {wildcards.dataset} --spec-json {params.spec:q}"
        " --out-dir results/datasets/{wildcards.dataset} > {log} 2>&1"
