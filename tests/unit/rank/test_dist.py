"""Device, backend and step precision chosen for a rank: GPU (NCCL, bf16 where supported) or CPU (gloo)."""

from __future__ import annotations

import contextlib

import pytest
import torch

from shardfuse.io import UserError
from shardfuse.rank.dist import autocast, select_device, step_dtype

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
