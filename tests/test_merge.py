"""Gather and merge against a direct reference computation, on small hand-made checkpoints."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from shardfuse.checkpoint import load_weights, save_weights
from shardfuse.gather import gather
from shardfuse.io import UserError, write_json
from shardfuse.merge import merge
from tests.conftest import subprocess_env

SPEC = {
    "type": "mlp",
    "num_features": 4,
    "num_classes": 3,
    "hidden_sizes": [5],
    "activation": "relu",
    "dropout": 0.0,
}


def make_run(tmp_path, tensors_per_rank, rows, run="r"):
    """A train directory as the train stage writes it: base, rank files, train.json."""
    train_dir = tmp_path / run / "train"
    meta = {"run": run, "world_size": len(tensors_per_rank), "strategy": "localsgd", "model": SPEC}
    save_weights(train_dir / "base.safetensors", tensors_per_rank[0], {**meta, "rank": None})
    for rank, tensors in enumerate(tensors_per_rank):
        save_weights(
            train_dir / f"rank-{rank}.safetensors",
            tensors,
            {**meta, "rank": rank, "rows": rows[rank], "num_steps": 7},
        )
    write_json(train_dir / "train.json", {**meta, "num_steps": 7})
    return train_dir


def random_ranks(num_ranks, seed=0):
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
    write_json(path, gather(train_dir, world_size))
    return path


@pytest.mark.parametrize("method", ["uniform", "weighted"])
def test_averaging_methods_match_reference(tmp_path, method):
    ranks, rows = random_ranks(3), [10, 30, 60]
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, rows), 3)
    record = merge(gather_path, method, 0.0, tmp_path / "merged.safetensors", tmp_path / "merge.json")
    merged, meta = load_weights(tmp_path / "merged.safetensors")
    weights = [1 / 3] * 3 if method == "uniform" else [r / sum(rows) for r in rows]
    for name in ranks[0]:
        reference = sum(w * ranks[i][name].double() for i, w in enumerate(weights)).float()
        torch.testing.assert_close(merged[name], reference, rtol=0, atol=1e-6)
    assert record["weights"] == pytest.approx(weights)
    assert meta["merge_method"] == method and meta["model"] == SPEC
    assert json.loads((tmp_path / "merge.json").read_text())["sha256"] == record["sha256"]


def test_consolidate_keeps_identical_ranks_and_rejects_drift(tmp_path):
    same = random_ranks(1)[0]
    gather_path = gather_to(tmp_path, make_run(tmp_path, [same, same], [5, 5]), 2)
    record = merge(gather_path, "consolidate", 0.0, tmp_path / "m.safetensors", tmp_path / "m.json")
    merged, _ = load_weights(tmp_path / "m.safetensors")
    assert all(torch.equal(merged[n], same[n]) for n in same)
    assert record["max_abs_diff_between_ranks"] == 0.0

    drifted = {**same, "b": same["b"] + 1e-3}
    gather_path = gather_to(tmp_path / "x", make_run(tmp_path / "x", [same, drifted], [5, 5]), 2)
    with pytest.raises(UserError, match=r"tensor 'b' differs between ranks by up to 0.001"):
        merge(gather_path, "consolidate", 1e-6, tmp_path / "n.safetensors", tmp_path / "n.json")
    assert not (tmp_path / "n.safetensors").exists()


def test_gather_names_the_missing_rank(tmp_path):
    train_dir = make_run(tmp_path, random_ranks(3), [1, 1, 1])
    (train_dir / "rank-2.safetensors").unlink()
    with pytest.raises(UserError, match=r"^rank 2: checkpoint .*rank-2.safetensors is missing"):
        gather(train_dir, 3)


def test_gather_names_the_rank_with_a_wrong_shape(tmp_path):
    ranks = random_ranks(2)
    ranks[1]["b"] = torch.zeros(3, 6)
    train_dir = make_run(tmp_path, ranks, [1, 1])
    with pytest.raises(
        UserError, match=r"^rank 1: tensor 'b' is F32\[3, 6\] but the base model has F32\[3, 5\]"
    ):
        gather(train_dir, 2)


def test_gather_rejects_a_rank_file_that_is_not_safetensors(tmp_path):
    train_dir = make_run(tmp_path, random_ranks(2), [1, 1])
    (train_dir / "rank-1.safetensors").write_bytes(b"\x80\x04 not a checkpoint")
    with pytest.raises(UserError, match=r"rank-1.safetensors is not a readable safetensors file"):
        gather(train_dir, 2)


def test_gather_detects_a_file_changed_after_training(tmp_path):
    ranks = random_ranks(2)
    train_dir = make_run(tmp_path, ranks, [1, 1])
    sidecar = json.loads((train_dir / "rank-0.json").read_text())
    save_weights(
        train_dir / "rank-0.safetensors",
        ranks[1],
        {k: v for k, v in sidecar.items() if k not in ("sha256", "bytes")},
        sidecar=False,
    )
    with pytest.raises(UserError, match=r"^rank 0: .* does not match the sha256"):
        gather(train_dir, 2)


def test_gather_records_checksums_and_rows(tmp_path):
    record = gather(make_run(tmp_path, random_ranks(2), [3, 4]), 2)
    assert [r["rows"] for r in record["ranks"]] == [3, 4]
    assert all(len(r["sha256"]) == 64 for r in record["ranks"])
    assert record["tensors"]["a.weight"] == {"shape": [5, 4], "dtype": "F32"}


def test_merge_cli_error_is_one_line_and_writes_nothing(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_ranks(2), [1, 1]), 2)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shardfuse.merge",
            "--gather",
            str(gather_path),
            "--method",
            "consolidate",
            "--out-weights",
            str(tmp_path / "m.safetensors"),
            "--out-json",
            str(tmp_path / "m.json"),
        ],
        capture_output=True,
        text=True,
        env=subprocess_env(),
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and "differs between ranks" in proc.stderr
    assert not list(tmp_path.glob("m.*")) and not list(tmp_path.glob(".m.*"))
