"""The peer of bench/partition.py --skew: Flower Datasets' DirichletPartitioner as a user would run it
to get shards on disk (run with the Python of a venv that has flwr-datasets; torch is not needed).

    $FLWR_PYTHON bench/flwr_partition.py IN.parquet OUT_DIR W ALPHA SEED CACHE_DIR [--no-write]

Loads the Parquet file with ``datasets.load_dataset`` (converted into an Arrow cache in CACHE_DIR, which
the caller empties between runs), partitions it by ``label`` (min_partition_size 10, no self-balancing,
as shardfuse's defaults), writes each partition with ``Dataset.to_parquet`` (not with --no-write: the
partitions only loaded, as a simulation's clients use them) and prints the partition sizes as JSON.
"""

from __future__ import annotations

import json
import os
import sys
import warnings


def main() -> None:
    source, out_dir, world_size, alpha, seed, cache_dir = sys.argv[1:7]
    write = "--no-write" not in sys.argv[7:]
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    warnings.filterwarnings("ignore")
    from datasets import disable_progress_bars, load_dataset
    from flwr_datasets.partitioner import DirichletPartitioner

    disable_progress_bars()
    dataset = load_dataset("parquet", data_files=source, split="train", cache_dir=cache_dir)
    partitioner = DirichletPartitioner(
        num_partitions=int(world_size), partition_by="label", alpha=float(alpha), seed=int(seed)
    )
    partitioner.dataset = dataset
    os.makedirs(out_dir, exist_ok=True)
    sizes = []
    for rank in range(int(world_size)):
        part = partitioner.load_partition(rank)
        if write:
            part.to_parquet(os.path.join(out_dir, f"shard-{rank}.parquet"))
        sizes.append(len(part))
    print(json.dumps(sizes))


if __name__ == "__main__":
    main()
