"""shardfuse: partition data into per-rank shards, train with torchrun, fuse the ranks, track in MLflow."""

__version__ = "0.1.0"
