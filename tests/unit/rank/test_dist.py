"""Device, backend and step precision chosen for a rank: GPU (NCCL, bf16 where supported) or CPU (gloo)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardfuse.io import UserError
from shardfuse.rank.dist import (
    JOIN_TIMEOUT_ENV,
    RanksDidNotJoin,
    autocast,
    join_timeout,
    select_device,
    step_dtype,
)
from shardfuse.rank.failure import JOIN_FAILURE, did_not_join, rank_failure, record_failure

CPU = torch.device("cpu")
GPU = torch.device("cuda", 1)


def test_without_cuda_every_rank_runs_on_the_cpu_with_gloo():
    assert select_device(0, cuda_available=False, gpu_count=0) == (CPU, "gloo")
    assert select_device(7, cuda_available=False, gpu_count=0) == (CPU, "gloo")


def test_with_cuda_each_local_rank_takes_its_own_gpu_with_nccl():
    assert select_device(0, cuda_available=True, gpu_count=8) == (torch.device("cuda", 0), "nccl")
    assert select_device(7, cuda_available=True, gpu_count=8) == (torch.device("cuda", 7), "nccl")


def test_more_ranks_than_gpus_on_a_node_is_one_clear_error():
    with pytest.raises(UserError, match=r"local rank 2 has no GPU: this node shows 2 GPU\(s\).*gres=gpu:N"):
        select_device(2, cuda_available=True, gpu_count=2)


@pytest.mark.parametrize(
    ("precision", "device", "bf16", "expected"),
    [
        ("auto", CPU, False, None),  # CPU: fp32 (bitwise-reproducible runs, faster for small models)
        ("auto", GPU, True, torch.bfloat16),
        ("auto", GPU, False, None),  # a GPU without bf16: fp32, no error
        ("fp32", GPU, True, None),
        ("fp32", CPU, False, None),
        ("bf16", GPU, True, torch.bfloat16),
    ],
)
def test_step_dtype_follows_the_precision_setting_and_the_device(precision, device, bf16, expected):
    assert step_dtype(precision, device, bf16_supported=bf16) is expected


@pytest.mark.parametrize(("device", "where"), [(CPU, "on cpu;"), (GPU, "on cuda without it;")])
def test_bf16_where_unsupported_is_one_clear_error(device, where):
    with pytest.raises(
        UserError, match=rf"precision bf16 needs a GPU with bf16 support, this rank runs {where}"
    ) as error:
        step_dtype("bf16", device, bf16_supported=False)
    assert str(error.value).endswith("; set precision: auto or fp32")


def test_unknown_precision_is_rejected():
    with pytest.raises(UserError, match="unknown precision 'fp8'"):
        step_dtype("fp8", GPU, bf16_supported=True)


def test_fp32_steps_run_outside_autocast_and_bf16_steps_inside_it():
    layer = torch.nn.Linear(4, 3)
    inputs = torch.randn(2, 4)
    with autocast(CPU, None) as region:
        assert layer(inputs).dtype == torch.float32
    assert region is None or isinstance(region, contextlib.nullcontext)
    # The autocast path itself, exercised on the CPU (the GPU uses the same call with device_type cuda).
    with autocast(CPU, torch.bfloat16):
        assert layer(inputs).dtype == torch.bfloat16
    assert layer.weight.dtype == torch.float32  # weights stay fp32


def test_the_join_timeout_is_three_minutes_unless_the_environment_says_and_its_record_is_named():
    assert join_timeout({}) == 180.0 and join_timeout({JOIN_TIMEOUT_ENV: "20"}) == 20.0
    with pytest.raises(UserError, match="SHARDFUSE_RANK_JOIN_TIMEOUT='soon' is not a positive number"):
        join_timeout({JOIN_TIMEOUT_ENV: "soon"})
    for bad in ("0", "-5"):
        with pytest.raises(
            UserError, match=f"{JOIN_TIMEOUT_ENV}='{bad}' is not a positive number of seconds"
        ):
            join_timeout({JOIN_TIMEOUT_ENV: bad})
    assert rank_failure(0, RanksDidNotJoin("x"), 0).exception == JOIN_FAILURE  # the launcher reads this name


def test_the_launcher_starts_again_only_after_a_rank_did_not_join(tmp_path):
    assert not did_not_join(tmp_path, 0)
    record_failure(tmp_path, rank_failure(0, RuntimeError("boom"), 0))
    assert not did_not_join(tmp_path, 0)
    record_failure(tmp_path, rank_failure(1, RanksDidNotJoin("not every rank joined"), 1))
    assert did_not_join(tmp_path, 1)
