"""Nothing non-finite is published (issue 54): weights whose sum overflows are normalised by the largest
first; a merged tensor with inf or NaN (parameters that overflow, an input that holds them) stops the merge
before merged.safetensors or merge.json exist; karcher's iterations are bounded and a tensor where its
tol leaves no rank is an error."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from shardfuse.checkpoints.stream import DTYPES, all_finite, encode_float
from shardfuse.checkpoints.weights import load_weights
from shardfuse.fusion.methods.plan import normalised, normalised_list
from shardfuse.fusion.methods.registry import rank_weights, resolve_params
from shardfuse.io import UserError
from shardfuse.merge import merge
from tests.support.fusion import gather_to, make_run, random_rank_tensors


def merged_run(tmp_path, tensors=None, base=None):
    tensors = tensors or random_rank_tensors(2)
    train_dir = make_run(tmp_path, tensors, [10, 10], base=base)
    return gather_to(tmp_path, train_dir, len(tensors)), tensors


def outputs(tmp_path):
    return tmp_path / "merged.safetensors", tmp_path / "merge.json"


def test_weights_near_the_float_limit_are_normalised_not_zeroed(tmp_path):
    gather_path, tensors = merged_run(tmp_path)
    weights, record_path = outputs(tmp_path)
    merge(gather_path, "weighted", weights, record_path, {"weights": [1.0e308, 1.0e308]})
    merged, _ = load_weights(weights)
    expected = (tensors[0]["b"].double() + tensors[1]["b"].double()) / 2
    assert torch.equal(merged["b"], expected.float())
    assert normalised_list([1.0e308, 1.0e308, 1.0e308]) == [1 / 3] * 3
    assert normalised([1.0e308, 5.0e307]).tolist() == pytest.approx([2 / 3, 1 / 3])


def test_ordinary_weights_are_normalised_bit_for_bit_as_before():
    weights = [0.1, 0.7, 0.3, 1e-3, 2.5, 0.2, 0.9, 1.1, 0.05]  # 9 ranks: numpy would sum pairwise
    total = sum(weights)
    assert normalised_list(weights) == [w / total for w in weights]
    params = resolve_params("weighted", {"weights": weights}, [1] * 9)
    assert rank_weights("weighted", params, [1] * 9) == [w / total for w in weights]


@pytest.mark.parametrize(
    ("method", "params"),
    [("task_arithmetic", {"scale": 1.0e300}), ("ties", {"density": 1.0, "scale": 1.0e300})],
)
def test_a_merge_that_overflows_is_one_line_and_writes_nothing(tmp_path, method, params):
    base = {name: torch.zeros_like(t) for name, t in random_rank_tensors(1)[0].items()}
    gather_path, _ = merged_run(tmp_path, base=base)
    weights, record_path = outputs(tmp_path)
    with pytest.raises(UserError, match=r"merged tensor \S+ holds inf or NaN \(method " + method) as refused:
        merge(gather_path, method, weights, record_path, params)
    assert str(refused.value).startswith("merged tensor a.bias holds inf or NaN")
    assert not weights.exists() and not record_path.exists()
    assert not list(tmp_path.glob(".merged.safetensors.tmp-*"))


def test_an_input_with_nan_is_not_averaged_into_a_published_model(tmp_path):
    tensors = random_rank_tensors(2)
    tensors[1]["a.bias"][2] = float("nan")
    gather_path, _ = merged_run(tmp_path, tensors)
    weights, record_path = outputs(tmp_path)
    with pytest.raises(UserError, match=r"merged tensor a\.bias holds inf or NaN .*every input checkpoint"):
        merge(gather_path, "uniform", weights, record_path)
    assert not weights.exists() and not record_path.exists()


def test_karcher_refuses_a_tol_that_leaves_every_rank_out(tmp_path):
    gather_path, _ = merged_run(tmp_path)
    weights, record_path = outputs(tmp_path)
    with pytest.raises(
        UserError, match=r"karcher: every rank's \S+ is shorter than tol 1000 .*lower merge_tol"
    ):
        merge(gather_path, "karcher", weights, record_path, {"tol": 1000.0})
    assert not weights.exists()


def test_karcher_keeps_a_tensor_that_is_zero_in_every_rank(tmp_path):
    tensors = random_rank_tensors(2)
    for rank in tensors:
        rank["a.bias"] = torch.zeros(5)
    gather_path, _ = merged_run(tmp_path, tensors)
    weights, record_path = outputs(tmp_path)
    merge(gather_path, "karcher", weights, record_path)
    merged, _ = load_weights(weights)
    assert torch.equal(merged["a.bias"], torch.zeros(5))


def test_karcher_iterations_are_bounded():
    with pytest.raises(UserError, match=r"'max_iter' must be an integer from 1 to 10000, got 1000000000"):
        resolve_params("karcher", {"max_iter": 1_000_000_000, "tol": 1e-20}, [1, 1])


@pytest.mark.parametrize("name", ["F16", "BF16", "F32", "F64"])
def test_all_finite_sees_every_inf_and_nan_of_every_float_dtype(name):
    dtype = DTYPES[name]
    values = np.linspace(-3, 3, 1001)
    out = np.empty(len(values) * dtype.itemsize, np.uint8)
    assert all_finite(encode_float(values, dtype, out), dtype)
    for bad in (np.inf, -np.inf, np.nan):
        broken = values.copy()
        broken[517] = bad
        assert not all_finite(encode_float(broken, dtype, out.copy()), dtype), bad
    if name == "F64":  # finite values whose sum overflows: the exact test decides
        assert all_finite(np.array([1.7e308, 1.7e308]).view(np.uint8), dtype)


def test_a_cast_to_a_narrower_out_dtype_that_overflows_writes_nothing(tmp_path):
    import struct

    from shardfuse.checkpoints.stream import SafetensorsWriter, TensorInfo
    from shardfuse.fusion.folders import CastSink

    source = {"w": TensorInfo("w", DTYPES["F32"], (3,), 0, 12)}
    path = tmp_path / "model.safetensors"  # --mergekit stages it in a folder it removes on the error
    writer = SafetensorsWriter(path, {"w": ("F16", [3])}, {"format": "pt"})
    with pytest.raises(UserError) as refused:
        CastSink(writer, source, {"w": "F16"}).write(
            "w", np.array([1.0, 7.0e4, 2.0], np.float32).view(np.uint8)
        )
    writer.discard()
    assert str(refused.value) == (
        "merged tensor w overflows out_dtype F16 (a value beyond its range became inf); nothing was written: "
        "use a wider out_dtype"
    )
    header = struct.unpack("<Q", path.read_bytes()[:8])[0]
    assert path.stat().st_size == 8 + header  # no tensor byte reached the file
