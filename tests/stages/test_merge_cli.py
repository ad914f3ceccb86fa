"""The merge stage's command line: one-line errors that write nothing, the weights and record it writes,
the newer methods by name, and consolidation of a sharded DCP checkpoint saved by two real ranks."""

from __future__ import annotations

import json
import socket
import subprocess
import sys

import numpy as np
import pytest
import torch

from shardfuse.checkpoints.weights import load_weights
from shardfuse.fusion.methods.registry import uses_base
from shardfuse.merge import merge
from tests.support.fusion import (
    CASES,
    MLP_SPEC,
    NEW_METHODS,
    expected_of,
    gather_to,
    make_run,
    random_rank_tensors,
    train_dir,
)
from tests.support.helpers import call_stage, subprocess_env


def test_merge_cli_error_is_one_line_and_writes_nothing(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(2), [1, 1]), 2)
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


def test_consolidate_assembles_a_sharded_dcp_checkpoint_saved_by_two_ranks(tmp_path):
    import torch.multiprocessing as mp

    ranks = random_rank_tensors(2)
    gather_path = gather_to(tmp_path, make_run(tmp_path, ranks, [1, 1]), 2)
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    mp.spawn(save_sharded_checkpoint, args=(port, str(tmp_path / "dcp"), ranks[0]), nprocs=2)
    assert len(list((tmp_path / "dcp").glob("shard-*.safetensors"))) == 2
    record = merge(
        gather_path, "consolidate", tmp_path / "m.safetensors", tmp_path / "m.json", dcp_dir=tmp_path / "dcp"
    )
    merged, meta = load_weights(tmp_path / "m.safetensors")
    assert merged.keys() == ranks[0].keys() and all(torch.equal(merged[n], t) for n, t in ranks[0].items())
    assert meta["merge_method"] == "consolidate" and meta["model"] == MLP_SPEC
    assert record.dcp["skipped_tensors"] == ["optim.step"] and len(record.dcp["files"]) == 2


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--method", "greedy_soup"],
            "greedy_soup ranks the ranks by their held-out score and needs --val-split",
        ),
        (
            ["--method", "ties", "--params-json", '{"density": 2}'],
            "parameter 'density' must be a number in (0, 1]",
        ),
        (["--method", "ties", "--params-json", "{density: 2}"], "--params-json is not valid JSON"),
        (["--method", "mean"], "argument --method: invalid choice: 'mean'"),
    ],
)
def test_merge_cli_errors_are_one_line_and_write_nothing(tmp_path, args, fragment):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(2), [1, 1]), 2)
    proc = call_stage(
        "merge",
        "--gather",
        gather_path,
        *args,
        "--out-weights",
        tmp_path / "m.safetensors",
        "--out-json",
        tmp_path / "m.json",
    )
    assert proc.returncode == 2
    assert proc.stderr.count("\n") == 1 and proc.stderr.startswith("shardfuse.merge: error: ")
    assert fragment in proc.stderr
    assert not list(tmp_path.glob("*m.*"))


def test_merge_cli_writes_weights_and_record(tmp_path):
    gather_path = gather_to(tmp_path, make_run(tmp_path, random_rank_tensors(3), [1, 2, 3]), 3)
    proc = call_stage(
        "merge",
        "--gather",
        gather_path,
        "--method",
        "dare",
        "--params-json",
        '{"density": 0.9}',
        "--val-split",
        tmp_path / "unused.parquet",
        "--run",
        "cli",
        "--out-weights",
        tmp_path / "m.safetensors",
        "--out-json",
        tmp_path / "m.json",
    )
    assert proc.returncode == 0, proc.stderr
    record = json.loads((tmp_path / "m.json").read_text())
    assert record["run"] == "cli" and record["params"]["density"] == 0.9
    assert "merged 3 ranks with dare" in proc.stdout


@pytest.mark.parametrize("method", NEW_METHODS)
def test_merge_cli_runs_each_new_method(tmp_path, method):
    num_ranks, given = CASES[method]
    base, per_rank, gather_path = train_dir(tmp_path, num_ranks)
    out = tmp_path / "merged.safetensors"
    proc = call_stage(
        "merge",
        "--gather",
        gather_path,
        "--method",
        method,
        "--params-json",
        json.dumps(given),
        "--out-weights",
        out,
        "--out-json",
        tmp_path / "merge.json",
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    from shardfuse.checkpoints.weights import load_weights

    merged, _ = load_weights(out)
    record = json.loads((tmp_path / "merge.json").read_text())
    assert record["method"] == method and (record["base"] is not None) == uses_base(method)
    for name in base:
        np.testing.assert_allclose(
            merged[name].numpy(), expected_of(method, given, base, per_rank, name), rtol=1e-6, atol=1e-7
        )


def test_merge_cli_refuses_nuslerp_of_three_ranks_before_writing(tmp_path):
    _, _, gather_path = train_dir(tmp_path, 3)
    out = tmp_path / "merged.safetensors"
    proc = call_stage(
        "merge",
        "--gather",
        gather_path,
        "--method",
        "nuslerp",
        "--out-weights",
        out,
        "--out-json",
        tmp_path / "m.json",
    )
    assert proc.returncode == 2 and not out.exists()
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "nuslerp interpolates exactly 2 models but the run has 3 ranks" in lines[0]


def save_sharded_checkpoint(rank, port, path, tensors):
    """One of two ranks saving DTensor shards with DCP's safetensors writer (run by mp.spawn)."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        state = {
            name: distribute_tensor(t, mesh, [Shard(0) if t.dim() and t.shape[0] > 1 else Replicate()])
            for name, t in tensors.items()
        }
        state["optim.step"] = distribute_tensor(torch.tensor([3]), mesh, [Replicate()])  # not a model tensor
        dcp.save(state, storage_writer=HuggingFaceStorageWriter(path, save_distributed=True))
    finally:
        dist.destroy_process_group()
