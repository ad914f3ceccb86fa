"""The merge engine's worker path: a plain mean merged in the worker threads from the raw bytes
(mean_block) must be bit for bit the consumer's decode -> merge_block -> encode, spread included; the
workers feed every file's digest in file order; a failure on either side stops the merge promptly."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from shardfuse.checkpoints.stream import DTYPES, SafetensorsReader, decode_float, encode_float
from shardfuse.fusion.engine import (
    Engine,
    HashTurns,
    MeanScratch,
    max_abs_diff,
    mean_block,
    merge_block,
)
from shardfuse.fusion.methods.plan import TensorJob
from shardfuse.fusion.methods.registry import make_plan
from shardfuse.io import file_digests

TORCH_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def raw_bytes(values: torch.Tensor) -> np.ndarray:
    """A tensor's little-endian bytes as a uint8 array (what the engine reads from a file)."""
    bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[values.element_size()]
    return values.contiguous().view(bits).numpy().view(np.uint8).copy()


def awkward_values(gen: torch.Generator, count: int, dtype: torch.dtype, specials: bool) -> torch.Tensor:
    """Normal values spread over many binades (so float64 sums round), and optionally the specials."""
    info = torch.finfo(dtype)
    exponents = torch.randint(-40, 40, (count,), generator=gen).double()
    values = torch.randn(count, generator=gen, dtype=torch.float64) * torch.exp2(exponents)
    values = values.clamp(-info.max, info.max).to(dtype)
    if specials and count >= 6:
        values[:6] = torch.tensor([0.0, -0.0, float("inf"), float("-inf"), float("nan"), info.tiny]).to(dtype)
    return values


def consumer_path(raws: list[np.ndarray], dtype_name: str) -> tuple[bytes, float]:
    """What the engine's consumer does for any plan: decode to float64, merge_block, encode."""
    dtype = DTYPES[dtype_name]
    count = len(raws[0]) // dtype.itemsize
    blocks = [decode_float(raw, dtype, np.empty(count)) for raw in raws]
    plan = make_plan("uniform", {}, TensorJob("w", count, list(range(len(raws)))))
    merged = merge_block(plan, 0, blocks, None)
    return bytes(encode_float(merged, dtype, np.empty(count * 8, dtype=np.uint8))), plan.max_abs_diff


@pytest.mark.parametrize("dtype_name", list(TORCH_DTYPES))
@pytest.mark.parametrize("num_ranks", [1, 2, 3, 8])
@pytest.mark.parametrize("specials", [False, True], ids=["finite", "specials"])
def test_a_plain_mean_in_the_workers_is_bit_for_bit_the_consumers_merge(dtype_name, num_ranks, specials):
    gen = torch.Generator().manual_seed(num_ranks)
    count = 517
    raws = [
        raw_bytes(awkward_values(gen, count, TORCH_DTYPES[dtype_name], specials and rank == num_ranks - 1))
        for rank in range(num_ranks)
    ]
    expected, expected_spread = consumer_path(raws, dtype_name)
    out = np.empty(count * 8, dtype=np.uint8)
    merged, spread = mean_block(raws, DTYPES[dtype_name], out, MeanScratch(num_ranks, count))
    assert bytes(merged) == expected
    assert spread == expected_spread or (np.isnan(spread) and np.isnan(expected_spread))


@pytest.mark.parametrize(
    ("first", "others", "expected"),
    [
        ([1.0, 2.0], [[1.0, np.nan]], np.inf),  # a NaN against a number
        ([1.0, 2.0], [[1.0, 2.0], [np.nan, 2.0]], np.inf),
        ([1.0, np.nan], [[1.5, np.nan]], 0.5),  # NaN == NaN: the other entry decides
        ([np.inf, 2.0], [[np.inf, 2.0]], 0.0),  # inf - inf, same infinity
        ([1.0, 2.0], [[np.inf, 2.0], [-3.0, 2.0]], np.inf),
    ],
)
def test_the_spread_from_extremes_keeps_max_abs_diffs_nan_rules(first, others, expected):
    raws = [np.array(values, dtype=np.float32).view(np.uint8) for values in [first, *others]]
    _, spread = mean_block(raws, DTYPES["F32"], np.empty(16, dtype=np.uint8), MeanScratch(len(raws), 2))
    reference = max_abs_diff([raw.view(np.float32).astype(np.float64) for raw in raws])
    assert spread == reference == expected


def write_ranks(tmp_path, num_ranks: int) -> list[str]:
    from safetensors.numpy import save_file

    paths = []
    for rank in range(num_ranks):
        gen = np.random.default_rng(rank)
        tensors = {
            "a": gen.standard_normal(3001, dtype=np.float32),
            "b": gen.standard_normal((40, 7)).astype(np.float16),
            "steps": np.array([5], dtype=np.int64),
        }
        path = tmp_path / f"rank-{rank}.safetensors"
        save_file(tensors, str(path))
        paths.append(str(path))
    return paths


class ListSink:
    def __init__(self, fail_after: int | None = None) -> None:
        self.writes: list[tuple[str, bytes]] = []
        self.fail_after = fail_after

    def write(self, name: str, data) -> None:
        if self.fail_after is not None and len(self.writes) == self.fail_after:
            raise RuntimeError("sink failed")
        self.writes.append((name, bytes(data)))


@pytest.mark.parametrize("block_bytes", [64, 8 * 3 * 100, 1 << 20])
def test_the_workers_hash_every_file_in_file_order_whatever_the_block_size(tmp_path, block_bytes):
    paths = write_ranks(tmp_path, 3)
    readers = [SafetensorsReader(path, hash_algorithm="blake3") for path in paths]
    engine = Engine(readers, None, "uniform", {}, [0, 1, 2], block_bytes=block_bytes)
    sink = ListSink()
    names = list(readers[0].tensors)
    stats = engine.run(names, sink)
    for reader, path in zip(readers, paths, strict=True):
        assert reader.hexdigest() == file_digests(path, ("blake3",))["blake3"]
    assert [name for name, _ in sink.writes][-1] == names[-1] and set(stats) == set(names)
    merged = b"".join(data for name, data in sink.writes if name == "a")
    expected = (sum(np.random.default_rng(r).standard_normal(3001, dtype=np.float32).astype(np.float64)
                    for r in range(3)) / 3).astype(np.float32)  # fmt: skip
    assert merged == expected.tobytes()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("fail_after", [0, 5])
def test_a_failing_sink_stops_the_workers_instead_of_hanging(tmp_path, fail_after):
    paths = write_ranks(tmp_path, 4)
    readers = [SafetensorsReader(path, hash_algorithm="blake3") for path in paths]
    engine = Engine(readers, None, "uniform", {}, [0, 1, 2, 3], block_bytes=64)
    before = threading.active_count()
    with pytest.raises(RuntimeError, match="sink failed"):
        engine.run(list(readers[0].tensors), ListSink(fail_after=fail_after))
    assert threading.active_count() == before  # every worker joined


@pytest.mark.timeout(30)
def test_a_worker_waiting_for_its_turn_to_hash_is_released_when_the_merge_stops():
    turns = HashTurns()
    errors: list[BaseException] = []

    def late_job() -> None:
        try:
            with turns.turn(1):  # job 0 never hashes: its turn never comes
                pass
        except RuntimeError as exc:
            errors.append(exc)

    worker = threading.Thread(target=late_job)
    worker.start()
    worker.join(0.2)
    assert worker.is_alive()  # waiting, as it must
    turns.stop()
    worker.join(10)
    assert not worker.is_alive() and "stopped" in str(errors[0])
