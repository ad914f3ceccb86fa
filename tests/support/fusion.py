"""Helpers of the fusion tests: hand-made rank checkpoints in a train directory, gathered."""

from __future__ import annotations

import torch

from shardfuse.checkpoints.weights import save_weights
from shardfuse.fusion.engine import merge_arrays
from shardfuse.fusion.methods.registry import resolve_params
from shardfuse.gather import gather
from shardfuse.io import write_json
from tests.support.helpers import write_train_dir

MLP_SPEC = {
    "type": "mlp",
    "num_features": 4,
    "num_classes": 3,
    "hidden_sizes": [5],
    "activation": "relu",
    "dropout": 0.0,
}


def make_run(tmp_path, tensors_per_rank, rows, run="r", base=None, spec=MLP_SPEC):
    """A train directory as the train stage writes it: base, rank files, train.json."""
    train_dir = tmp_path / run / "train"
    meta = {"run": run, "world_size": len(tensors_per_rank), "strategy": "localsgd", "model": spec}
    save_weights(train_dir / "base.safetensors", base or tensors_per_rank[0], {**meta, "rank": None})
    for rank, tensors in enumerate(tensors_per_rank):
        save_weights(
            train_dir / f"rank-{rank}.safetensors",
            tensors,
            {**meta, "rank": rank, "rows": rows[rank], "num_steps": 7},
        )
    write_json(train_dir / "train.json", {**meta, "num_steps": 7})
    return train_dir


def random_rank_tensors(num_ranks, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [
        {
            "a.weight": torch.randn(5, 4, generator=gen),
            "a.bias": torch.randn(5, generator=gen),
            "b": torch.randn(3, 5, generator=gen),
        }
        for _ in range(num_ranks)
    ]


def gather_to(tmp_path, train_dir, world_size):
    path = tmp_path / "gather.json"
    write_json(path, gather(train_dir, world_size).to_json())
    return path


NEW_METHODS = ("breadcrumbs", "breadcrumbs_ties", "della", "sce", "nuslerp", "multislerp", "karcher")


CASES = {
    "breadcrumbs": (3, {"density": 0.6, "gamma": 0.1}),
    "breadcrumbs_ties": (3, {"density": 0.6, "gamma": 0.1}),
    "della": (3, {"density": 0.5, "epsilon": 0.2, "seed": 4}),
    "sce": (3, {"topk": 0.5}),
    "nuslerp": (2, {"t": 0.3}),
    "multislerp": (3, {"weights": [1.0, 2.0, 3.0]}),
    "karcher": (3, {"max_iter": 20}),
}


def train_dir(tmp_path, num_ranks):
    gen = torch.Generator().manual_seed(1)
    base = {"net.0.weight": torch.randn(3, 4, generator=gen), "net.0.bias": torch.randn(3, generator=gen)}
    per_rank = [
        {k: v + torch.randn(v.shape, generator=gen) for k, v in base.items()} for _ in range(num_ranks)
    ]
    out = write_train_dir(tmp_path / "train", base, num_ranks, lambda rank: per_rank[rank])
    path = tmp_path / "gather.json"
    write_json(path, gather(out, num_ranks).to_json())
    return base, per_rank, path


def expected_of(method, given, base, per_rank, name):
    p = resolve_params(method, given, [5] * len(per_rank))
    return merge_arrays(method, p, [r[name].numpy() for r in per_rank], base[name].numpy(), name)[0]


def ranks_for(method: str, wanted: int = 2) -> int:
    """``wanted`` ranks, or 1 for a method whose check keeps one model (none)."""
    from shardfuse.fusion.methods.registry import resolve_params
    from shardfuse.io import UserError

    try:
        resolve_params(method, {"tolerance": 100.0} if method == "consolidate" else {}, [1] * wanted)
    except UserError:
        return 1
    return wanted


# A two-feature logistic regression of the MLP spec: greedy soup's and merge search's tiny classifiers.
LOGISTIC = {**MLP_SPEC, "num_features": 2, "num_classes": 2, "hidden_sizes": []}


def classifier(weight):
    """Logistic regression whose class-1 logit minus class-0 logit is 2 * (weight . x)."""
    import torch

    weight = torch.tensor(weight, dtype=torch.float32)
    return {
        "net.0.weight": torch.stack([-weight, weight]),
        "net.0.bias": torch.zeros(2),
        "input_mean": torch.zeros(2),
        "input_scale": torch.ones(2),
    }


def write_split(path, features, labels):
    """A split of columns x0, x1 and label, as prepare writes one."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"x0": features[:, 0], "x1": features[:, 1], "label": labels.astype(np.int64)})
    pq.write_table(table, path)
