"""LoRA adapters fused in update space: each rank's update ΔW_i = s_i·B_i·A_i, merged over the frozen base.

A LoRA adapter of a module with frozen weight W0 holds A [r, in] and B [out, r]; the fine-tuned weight
is W_i = W0 + ΔW_i with ΔW_i = s_i·B_i·A_i and s_i = alpha / r (:class:`LoraFactors`). Merging A and B
separately is not merging the updates (mean(B)·mean(A) is not mean(B·A): cross terms), so fusion goes
through the products, one adapted module at a time:

  merged W = W0 + M(ΔW_1, ..., ΔW_N)

where M is the merge method run by the merge engine on the updates with an all-zero base. For every
method whose record has no ``not_on_updates`` (registry) that is what the method gives on the dense
models W_i with base W0, to float rounding: the task-vector methods see tau_i = W_i - W0 = ΔW_i either
way (DARE's and della's masks are drawn from the same (seed, rank, tensor name) streams, and W0 comes
back in as ``base + scale·merged``, model_stock's ``t·mean + (1 - t)·base``); uniform and weighted
(weights summing to 1) commute with adding W0; consolidate compares the ranks through their differences,
which are the updates' differences. The spherical methods (angles and norms of the whole weights move
with W0) and greedy_soup (it scores whole models) are refused with their record's one line.

Streaming: :func:`merge_updates` hands each rank's updates to the engine (:class:`UpdateReader`, read as
a checkpoint of float64 tensors) and yields one merged module at a time. Each read forms a block of
ΔW_i straight from the factors (only the rows the block touches); blocks hold at most ``block_bytes``
of float64 over all ranks, so they shrink as ranks are added: no dense model, and no rank's whole ΔW,
is ever held, and memory is one merged module plus a few blocks whatever the number of ranks (besides
the input factors, r·(in + out) per rank and module, and what a plan keeps of a whole tensor, as in
the merge stage: TIES a count per bucket and one bucket's entries, della and sce with topk < 1 every
rank's). :func:`merge_model`
adds the base: every base tensor in order, the adapted ones as W0 + merged ΔW, the others the base's
own array.

Adapters out: :func:`svd_factors` re-factorises a merged ΔW to rank r (the best rank-r approximation,
Eckart-Young) and returns its relative truncation error; :func:`cat_factors` concatenates the ranks'
factors to rank sum_i r_i, exact for the methods linear in the updates (their records'
``update_coefficients``).

No command line; by hand::

    python -c "import numpy as np; from shardfuse.fusion import lora; \\
        f = [lora.LoraFactors(np.ones((1, 3)), np.full((2, 1), float(i)), 0.5) for i in (1, 3)]; \\
        print(next(lora.merge_updates('uniform', {}, [{'w': x} for x in f])).update)"
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from shardfuse.checkpoints.gather_record import GatherRecord
from shardfuse.checkpoints.stream import (
    DTYPES,
    SafetensorsReader,
    TensorInfo,
    decode_float,
    decode_narrow,
    encode_float,
)
from shardfuse.checkpoints.trust import check_listed_digest, check_listed_header, open_listed
from shardfuse.fusion.engine import BLOCK_BYTES, Engine, MemorySink
from shardfuse.fusion.methods import registry
from shardfuse.io import UserError

F64 = DTYPES["F64"]


@dataclass(frozen=True, eq=False)  # arrays: identity, not elementwise ==
class LoraFactors:
    """One rank's adapter of one module: ΔW = scaling·B·A, in the layout of the module's weight.

    ``a`` is [r, in], ``b`` [out, r], ``scaling`` alpha / r. ``fan_in_fan_out`` (PEFT's flag) says the
    weight is stored [in, out], as GPT-2's Conv1D stores it: ΔW is then (B·A)^T. Held in float64."""

    a: np.ndarray
    b: np.ndarray
    scaling: float
    fan_in_fan_out: bool = False

    def __post_init__(self) -> None:
        a, b = np.asarray(self.a, dtype=np.float64), np.asarray(self.b, dtype=np.float64)
        if a.ndim != 2 or b.ndim != 2 or b.shape[1] != a.shape[0]:
            raise ValueError(f"LoRA factors need A [r, in] and B [out, r], got {a.shape} and {b.shape}")
        object.__setattr__(self, "a", a)
        object.__setattr__(self, "b", b)

    @property
    def rank(self) -> int:
        return self.a.shape[0]

    @property
    def shape(self) -> tuple[int, int]:
        """The shape of ΔW, the module weight's."""
        out_features, in_features = self.b.shape[0], self.a.shape[1]
        return (in_features, out_features) if self.fan_in_fan_out else (out_features, in_features)

    def update(self) -> np.ndarray:
        """ΔW, the whole matrix, in float64."""
        return self.update_block(0, math.prod(self.shape)).reshape(self.shape)

    def update_block(self, start: int, count: int) -> np.ndarray:
        """Entries [start, start + count) of ΔW flattened row-major, in float64: only the rows they
        touch are formed (row j of B·A is B[j]·A; row j of (B·A)^T is A[:, j]^T·B^T)."""
        width = self.shape[1]
        if count == 0:
            return np.empty(0)
        first, last = start // width, (start + count - 1) // width + 1
        rows = self.a[:, first:last].T @ self.b.T if self.fan_in_fan_out else self.b[first:last] @ self.a
        rows *= self.scaling
        offset = start - first * width
        return rows.ravel()[offset : offset + count]


class MergedUpdate(NamedTuple):
    """One adapted module's merged update M(ΔW_1..ΔW_N) (float64, the weight's shape) and the engine's
    statistics of it (max_abs_diff between the ranks' updates, the method's own, e.g. kept_fraction)."""

    name: str
    update: np.ndarray
    stats: dict[str, Any]


class ModelTensor(NamedTuple):
    """One tensor of the merged model: the base's own array where no adapter touches it (``merged`` is
    None), else W0 + merged ΔW in the base's dtype, with the merged update it came from."""

    name: str
    weight: np.ndarray
    merged: MergedUpdate | None


class UpdateReader:
    """One rank's updates as the merge engine reads a checkpoint (``tensors``, ``read_into``,
    ``extend_hash``): float64 tensors whose blocks are formed from the factors on each read.
    ``factors=None`` is the all-zero base of the updates."""

    def __init__(self, tensors: dict[str, TensorInfo], factors: Mapping[str, LoraFactors] | None) -> None:
        self.tensors = tensors
        self.factors = factors

    def read_into(
        self, info: TensorInfo, start: int, count: int, out: np.ndarray, *, extend_hash: bool = True
    ) -> np.ndarray:
        view = out[: count * F64.itemsize]
        values = view.view(np.float64)
        if self.factors is None:
            values.fill(0.0)
        else:
            values[:] = self.factors[info.name].update_block(start, count)
        return view

    def extend_hash(self, info: TensorInfo, start: int, view: np.ndarray) -> None:
        """Nothing to hash: the factors are in memory; whoever read them from a file checked them."""


def update_methods() -> tuple[str, ...]:
    """The methods that fuse LoRA updates (their record has no ``not_on_updates``)."""
    return tuple(record.name for record in registry.RECORDS if record.not_on_updates is None)


def refuse_unless_on_updates(method: str) -> None:
    """The one-line refusal of a method that is no function of the updates over the frozen base."""
    reason = registry.method_record(method).not_on_updates
    if reason is not None:
        raise UserError(f"merge method {method} cannot fuse LoRA adapters: it {reason}")


def update_tensors(ranks: Sequence[Mapping[str, LoraFactors]]) -> dict[str, TensorInfo]:
    """The updates every rank holds, as float64 tensors named like the module weights (rank 0's order);
    every rank must adapt the same modules, with updates of the same shape and layout."""
    if not ranks:
        raise ValueError("no adapters to fuse")
    first = ranks[0]
    for index, factors in enumerate(ranks[1:], start=1):
        if set(factors) != set(first):
            odd = sorted(set(factors) ^ set(first))[:3]
            raise UserError(
                f"the adapters of rank {index} and rank 0 adapt different modules ({', '.join(odd)}); "
                "fuse adapters trained with the same target_modules"
            )
        for name, factor in factors.items():
            if (factor.shape, factor.fan_in_fan_out) != (first[name].shape, first[name].fan_in_fan_out):
                raise UserError(
                    f"module {name!r}: the update of rank {index} is {list(factor.shape)} but rank 0's is "
                    f"{list(first[name].shape)} (or its fan_in_fan_out differs); fuse adapters of one model"
                )
    tensors, begin = {}, 0
    for name, factor in first.items():
        end = begin + math.prod(factor.shape) * F64.itemsize
        tensors[name] = TensorInfo(name, F64, factor.shape, begin, end)
        begin = end
    return tensors


def merge_updates(
    method: str,
    params: dict[str, Any],
    ranks: Sequence[Mapping[str, LoraFactors]],
    *,
    rank_numbers: list[int] | None = None,
    weights: list[float] | None = None,
    names: list[str] | None = None,
    block_bytes: int = BLOCK_BYTES,
) -> Iterator[MergedUpdate]:
    """M(ΔW_1..ΔW_N) for each adapted module (``names``, default rank 0's order), one module at a time.

    ``ranks``: each rank's factors by module weight name, in rank order; ``rank_numbers`` their ranks
    (DARE's and della's streams are seeded by them, as in the merge stage; default 0..N-1); ``params``
    from ``resolve_params``; ``weights`` the rank weights the method reads, summing to 1 (``rank_weights``;
    default equal). A
    method that cannot fuse updates, or adapters that disagree, are refused here, before any work."""
    refuse_unless_on_updates(method)
    tensors = update_tensors(ranks)
    rank_numbers = list(range(len(ranks))) if rank_numbers is None else rank_numbers
    weights = registry.default_weights(method, len(ranks), weights)
    readers = [UpdateReader(tensors, factors) for factors in ranks]
    zero_base = UpdateReader(tensors, None) if registry.uses_base(method) else None
    engine = Engine(readers, zero_base, method, params, rank_numbers, weights, block_bytes)
    return _merged_one_by_one(engine, tensors, list(tensors) if names is None else names)


def _merged_one_by_one(
    engine: Engine, tensors: dict[str, TensorInfo], names: list[str]
) -> Iterator[MergedUpdate]:
    for name in names:
        info = tensors[name]
        sink = MemorySink({name: info})
        stats = engine.run([name], sink)[name]
        yield MergedUpdate(name, sink.buffers[name].view(np.float64).reshape(info.shape), stats)


def add_update(base_weight: np.ndarray, update: np.ndarray) -> np.ndarray:
    """W0 + ΔW, summed in float64 and cast back to W0's dtype (as the engine casts every merged tensor).
    ``update`` (float64, the merged update, used once) receives the sum in place: no second buffer."""
    update = np.asarray(update, dtype=np.float64)
    update += base_weight
    return update.astype(base_weight.dtype)


def merge_model(
    method: str,
    params: dict[str, Any],
    base: Mapping[str, np.ndarray],
    ranks: Sequence[Mapping[str, LoraFactors]],
    **options: Any,
) -> Iterator[ModelTensor]:
    """Every tensor of ``base`` in its order: W0 + M(ΔW_1..ΔW_N) where the ranks adapt it, the base's
    own array elsewhere. ``options`` are :func:`merge_updates`'s. ``base`` is read one tensor at a time
    (a lazy mapping keeps only one in memory)."""
    refuse_unless_on_updates(method)
    tensors = update_tensors(ranks)
    for name, info in tensors.items():
        shape = _shape(base, name) if name in base else None
        if shape != info.shape:
            found = "no such tensor" if shape is None else f"shape {list(shape)}"
            raise UserError(
                f"the adapters update {name!r} as {list(info.shape)} but the base has {found}; "
                "fuse adapters over the base they were trained on"
            )
    merged = merge_updates(method, params, ranks, names=[n for n in base if n in tensors], **options)
    return _with_base(base, tensors, merged)


def _shape(base: Mapping[str, np.ndarray], name: str) -> tuple[int, ...]:
    """A base tensor's shape without reading it where the mapping can say (:class:`BaseTensors`)."""
    shape_of = getattr(base, "shape_of", None)
    return tuple(shape_of(name)) if shape_of is not None else tuple(base[name].shape)


def _with_base(
    base: Mapping[str, np.ndarray], tensors: dict[str, TensorInfo], merged: Iterator[MergedUpdate]
) -> Iterator[ModelTensor]:
    for name in base:
        if name not in tensors:
            yield ModelTensor(name, base[name], None)
            continue
        update = next(merged)
        yield ModelTensor(name, add_update(base[name], update.update), update)


# ---------------------------------------------------------------- adapters out


def svd_factors(
    update: np.ndarray, rank: int, scaling: float, fan_in_fan_out: bool = False
) -> tuple[LoraFactors, float]:
    """The best rank-``rank`` adapter of ``update`` (Eckart-Young: the truncated SVD U_r S_r V_r^T) and
    its relative truncation error ||ΔW - ΔW_r||_F / ||ΔW||_F = sqrt(sum_{k>r} s_k^2 / sum_k s_k^2)
    (0 for a zero update).

    Factors for ``scaling`` (alpha / r of the adapter written): B = U_r sqrt(S_r / scaling),
    A = sqrt(S_r / scaling) V_r^T, the singular values split evenly so that neither factor carries the
    whole scale. A rank above min(out, in) pads with zero rows and columns."""
    matrix = update.T if fan_in_fan_out else update  # [out, in]
    left, singular, right = np.linalg.svd(matrix, full_matrices=False)
    kept = min(rank, len(singular))
    root = np.sqrt(singular[:kept] / scaling)
    b = np.zeros((matrix.shape[0], rank))
    a = np.zeros((rank, matrix.shape[1]))
    b[:, :kept] = left[:, :kept] * root
    a[:kept] = root[:, None] * right[:kept]
    return LoraFactors(a, b, scaling, fan_in_fan_out), truncation_error(singular, kept)


def truncation_error(singular: np.ndarray, kept: int) -> float:
    """Relative Frobenius error of keeping the ``kept`` largest of the singular values ``singular``."""
    total = float(np.linalg.norm(singular))
    return float(np.linalg.norm(singular[kept:])) / total if total > 0 else 0.0


def linear_coefficients(
    method: str, params: dict[str, Any], num_ranks: int, weights: list[float] | None = None
) -> list[float]:
    """c_i with merged ΔW = sum_i c_i ΔW_i, from the method's record (uniform 1/N, weighted w_i summing
    to 1, default equal, task_arithmetic scale/N). Methods not linear in the updates: refused."""
    coefficients = registry.method_record(method).update_coefficients
    if coefficients is None:
        raise UserError(
            f"merge_adapter cat is exact only for the methods linear in the updates "
            f"({', '.join(registry.linear_names())}), not {method}; use merge_adapter svd"
        )
    registry.refuse_per_tensor_cat(method, params)
    return coefficients(params, num_ranks, weights)


def cat_factors(factors: Sequence[LoraFactors], coefficients: Sequence[float], scaling: float) -> LoraFactors:
    """One adapter of rank sum_i r_i whose update is sum_i c_i ΔW_i exactly: B' = [B_1 ... B_N] (columns),
    A' = [c_1 s_1/s' A_1; ...; c_N s_N/s' A_N] (rows), s' = ``scaling``, since B'·A' = sum_i B_i·(c_i s_i/s')
    A_i. ``coefficients`` from :func:`linear_coefficients`."""
    a = np.concatenate(
        [(c * f.scaling / scaling) * f.a for c, f in zip(coefficients, factors, strict=True)], axis=0
    )
    b = np.concatenate([f.b for f in factors], axis=1)
    return LoraFactors(a, b, scaling, factors[0].fan_in_fan_out)


# ---------------------------------------------------------------- files


FACTOR_SUFFIXES = (".lora_A.weight", ".lora_B.weight")
RERUN_TRAIN = "re-run training (snakemake -R train)"


def read_factors(reader: SafetensorsReader, adapter: Mapping[str, Any]) -> dict[str, LoraFactors]:
    """One rank's adapter file as {module weight name: factors}: every tensor read once, in file order
    (so the reader's digest covers the bytes used), decoded to float64. ``adapter``: the header's entry
    (r, alpha, targets)."""
    scaling = float(adapter["alpha"]) / int(adapter["r"])
    raw: dict[str, dict[str, np.ndarray]] = {}
    for name, info in reader.tensors.items():
        suffix = next((s for s in FACTOR_SUFFIXES if name.endswith(s)), None)
        if suffix is None or not info.dtype.is_float:
            raise UserError(f"{reader.path}: {name!r} is not a LoRA factor; {RERUN_TRAIN}")
        values = np.empty(info.numel, dtype=np.float64)
        decode_float(reader.read_array(info).reshape(-1).view(np.uint8), info.dtype, values)
        raw.setdefault(name[: -len(suffix)], {})[suffix[6]] = values.reshape(info.shape)
    factors = {}
    for module, pair in raw.items():
        target = adapter["targets"].get(module)
        if set(pair) != {"A", "B"} or not isinstance(target, Mapping):
            raise UserError(
                f"{reader.path}: the adapter of {module!r} is incomplete or not among the training's "
                f"targets; {RERUN_TRAIN}"
            )
        fan_in_fan_out = bool(target.get("fan_in_fan_out"))
        factors[f"{module}.weight"] = LoraFactors(pair["A"], pair["B"], scaling, fan_in_fan_out)
    return factors


class BaseTensors(Mapping):
    """The base checkpoint as a mapping read one tensor at a time, in the order ``names`` gives (the
    output's file order): float tensors in the narrowest numpy type that holds them exactly (F32 and F64
    as read, F16 and BF16 as float32; :func:`encode_tensor` writes them back exactly), others as their
    raw holder arrays. Reads extend the reader's digest when in file order."""

    def __init__(self, reader: SafetensorsReader, names: Sequence[str]) -> None:
        self.reader, self.names = reader, list(names)

    def __getitem__(self, name: str) -> np.ndarray:
        info = self.reader.tensors[name]
        array = self.reader.read_array(info)
        if not info.dtype.is_float or info.dtype.name in ("F32", "F64"):
            return array
        out = np.empty(info.numel * 4, dtype=np.uint8)
        return decode_narrow(array.reshape(-1).view(np.uint8), info.dtype, out).reshape(info.shape)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.reader.tensors

    def shape_of(self, name: str) -> tuple[int, ...]:
        return self.reader.tensors[name].shape


def encode_tensor(values: np.ndarray, dtype_name: str) -> np.ndarray:
    """The bytes of ``values`` (floats, or a raw holder array) in the file dtype ``dtype_name``: as they
    are where they already have its holder type, else rounded as :func:`encode_float` rounds."""
    dtype = DTYPES[dtype_name]
    flat = np.ascontiguousarray(values).reshape(-1)
    if not dtype.is_float or flat.dtype == np.dtype(dtype.holder):
        return flat.view(np.uint8)
    out = np.empty(flat.size * dtype.itemsize, dtype=np.uint8)
    return encode_float(flat.astype(np.float64, copy=False), dtype, out)


def read_rank_factors(gather: GatherRecord) -> list[dict[str, LoraFactors]]:
    """Every rank's factors gather.json lists, each file's size, header and digest checked against it
    (the digest over the very bytes read), as the merge stage checks whole checkpoints."""
    algorithm = gather.checksum_algorithm
    ranks = []
    for entry in gather.ranks:
        what = f"rank {entry.rank}"
        with open_listed(Path(entry.path), entry.bytes, what, algorithm) as reader:
            check_listed_header(reader, gather.tensors, what)
            factors = read_factors(reader, gather.adapter)
            check_listed_digest(reader, entry, what)
        ranks.append(factors)
    return ranks
