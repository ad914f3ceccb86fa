"""Read and write safetensors files a block of one tensor at a time: no mmap, no pickle, no torch.

No command line; used by shardfuse.merge, e.g.

    python -c "from shardfuse.checkpoints.stream import SafetensorsReader as R; \
        print(R('results/runs/R/merged.safetensors').header())"

Why not ``safetensors.safe_open``: it memory-maps the file, and every page a merge touches stays mapped,
and is counted in the process's RSS, until the handle closes. A merge of N ranks touches N models, so
a safe_open-based merge shows an RSS that grows with N (bench/merge.py measures it, its "mmap" column).
Explicit ``os.preadv`` reads into a few reused buffers keep RSS flat, and cost nothing extra: safe_open
copies out of the mapping anyway. Not importing torch matters too: ``import torch`` alone takes more
RSS than the whole merge engine needs for a model of a hundred megabytes.

The reader hashes the bytes it reads (sha256 or BLAKE3, ``hash_algorithm``) while they stream past in
file order, so a merge checks its inputs against their recorded checksums without a second pass over the
files; the merge engine reads in several threads and feeds the hash itself, in file order
(``read_into(..., extend_hash=False)``, then ``extend_hash``).

The writer computes the header up front (names, dtypes, shapes, offsets, metadata), then takes the
tensor bytes in file order, in as many chunks as the caller likes. Its output is byte-identical to
``safetensors.torch.save_file`` for the same tensors and metadata: tensors ordered by dtype (the
safetensors Dtype enum, largest first) then name, compact JSON, header padded with spaces to 8 bytes.
(With several metadata keys save_file orders them like a Rust HashMap, randomly per process; this
writer sorts them. shardfuse files have the single key "shardfuse", so the bytes agree.)
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.io import UserError, new_hash

MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


@dataclass(frozen=True)
class DType:
    name: str  # as in the safetensors header
    itemsize: int
    order: int  # position in safetensors' Dtype enum; files list higher ones first
    holder: str  # numpy dtype holding the values (the raw bit pattern where numpy lacks the type)
    is_float: bool  # merged in float64; every other dtype is copied and must agree across ranks


# Ascending enum order, as safetensors 0.4-0.8 write it (checked by a test against save_file).
DTYPES: dict[str, DType] = {
    d.name: d
    for d in (
        DType("BOOL", 1, 0, "|b1", False),
        DType("U8", 1, 1, "|u1", False),
        DType("I8", 1, 2, "|i1", False),
        DType("F8_E5M2", 1, 3, "|u1", False),
        DType("F8_E4M3", 1, 4, "|u1", False),
        DType("F8_E8M0", 1, 5, "|u1", False),
        DType("F8_E4M3FNUZ", 1, 6, "|u1", False),
        DType("F8_E5M2FNUZ", 1, 7, "|u1", False),
        DType("I16", 2, 8, "<i2", False),
        DType("U16", 2, 9, "<u2", False),
        DType("F16", 2, 10, "<f2", True),
        DType("BF16", 2, 11, "<u2", True),
        DType("I32", 4, 12, "<i4", False),
        DType("U32", 4, 13, "<u4", False),
        DType("F32", 4, 14, "<f4", True),
        DType("C64", 8, 15, "<c8", False),
        DType("F64", 8, 16, "<f8", True),
        DType("I64", 8, 17, "<i8", False),
        DType("U64", 8, 18, "<u8", False),
    )
}
TORCH_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "F8_E5M2": "float8_e5m2", "F8_E4M3": "float8_e4m3fn",
    "F8_E8M0": "float8_e8m0fnu", "F8_E4M3FNUZ": "float8_e4m3fnuz", "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "I16": "int16", "U16": "uint16", "F16": "float16", "BF16": "bfloat16", "I32": "int32",
    "U32": "uint32", "F32": "float32", "C64": "complex64", "F64": "float64", "I64": "int64",
    "U64": "uint64",
}  # fmt: skip


@dataclass(frozen=True)
class TensorInfo:
    name: str
    dtype: DType
    shape: tuple[int, ...]
    begin: int  # absolute byte offsets in the file
    end: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


class InvalidSafetensors(UserError):
    """A file that is not valid safetensors; ``reason`` says why, for callers that word their own error
    (shardfuse.checkpoints.trust: a gather.json entry pointing at a file that is no checkpoint at all)."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(f"{path} is not a valid safetensors file ({reason}); re-run the stage that wrote it")
        self.reason = reason


def _invalid(path: Path, reason: str) -> UserError:
    return InvalidSafetensors(path, reason)


def _parse_header(path: Path, raw: bytes, data_start: int, file_size: int) -> tuple[dict, dict[str, str]]:
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise _invalid(path, "header is not UTF-8 JSON") from None
    if not isinstance(header, dict):
        raise _invalid(path, "header is not a JSON object")
    metadata = header.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
    ):
        raise _invalid(path, "__metadata__ is not a map of strings")
    tensors = []
    for name, entry in header.items():
        dtype = DTYPES.get(entry.get("dtype")) if isinstance(entry, dict) else None
        if dtype is None:
            raise _invalid(path, f"tensor {name!r} has an unknown or missing dtype")
        shape, offsets = entry.get("shape"), entry.get("data_offsets")
        if not (
            isinstance(shape, list)
            and all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
            and isinstance(offsets, list)
            and len(offsets) == 2
            and all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise _invalid(path, f"tensor {name!r} has a malformed shape or data_offsets")
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise _invalid(path, f"tensor {name!r} has {offsets[1] - offsets[0]} bytes for shape {shape}")
        tensors.append(
            TensorInfo(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])
        )
    tensors.sort(key=lambda t: (t.begin, t.end))
    position = data_start
    for info in tensors:
        if info.begin != position:
            raise _invalid(path, f"tensor {info.name!r} does not start where the previous one ends")
        position = info.end
    if position != file_size:
        raise _invalid(path, f"the tensors cover {position} bytes but the file has {file_size}")
    return {t.name: t for t in tensors}, metadata


class SafetensorsReader:
    """One safetensors file, opened for explicit reads. Tensors are listed in file order."""

    def __init__(
        self, path: str | os.PathLike, *, hash_reads: bool = True, hash_algorithm: str = "sha256"
    ) -> None:
        self.path = Path(path)
        self.hash_reads = hash_reads  # False only to measure what hashing costs (bench/merge.py)
        self.hash_algorithm = hash_algorithm
        try:
            self._fd = os.open(self.path, os.O_RDONLY)
        except OSError as exc:
            raise UserError(
                f"cannot open {self.path} ({exc.strerror}); re-run the stage that writes it"
            ) from None
        try:
            self.size = os.fstat(self._fd).st_size
            prefix = os.pread(self._fd, 8, 0)
            if len(prefix) < 8:
                raise _invalid(self.path, "shorter than 8 bytes")
            (header_len,) = struct.unpack("<Q", prefix)
            if header_len > min(MAX_HEADER_BYTES, self.size - 8):
                raise _invalid(self.path, f"header length {header_len} exceeds the file")
            raw = os.pread(self._fd, header_len, 8)
            self.data_start = 8 + header_len
            self.tensors, self.metadata = _parse_header(self.path, raw, self.data_start, self.size)
        except BaseException:
            os.close(self._fd)
            raise
        self._digest = new_hash(hash_algorithm)
        self._digest.update(prefix + raw)
        self._hashed_upto = self.data_start

    def read_into(
        self, info: TensorInfo, start: int, count: int, out: np.ndarray, *, extend_hash: bool = True
    ) -> np.ndarray:
        """Read elements [start, start + count) of ``info`` into the uint8 buffer ``out``; returns the
        filled prefix. Bytes read at the point up to which the file has been hashed extend the hash,
        unless ``extend_hash`` is false: then the caller passes them to :meth:`extend_hash` itself."""
        view = out[: count * info.dtype.itemsize]
        self._pread(view, info.begin + start * info.dtype.itemsize)
        if extend_hash:
            self.extend_hash(info, start, view)
        return view

    def extend_hash(self, info: TensorInfo, start: int, view: np.ndarray) -> None:
        """Hash ``view``, the bytes of ``info`` from element ``start`` on, if they begin where the
        hashed prefix of the file ends (bytes read again, or out of order, are not hashed). Not
        thread-safe: callers that read in several threads call it in file order (the merge engine)."""
        offset = info.begin + start * info.dtype.itemsize
        if offset == self._hashed_upto and self.hash_reads:
            self._digest.update(view)
            self._hashed_upto += len(view)

    def read_array(self, info: TensorInfo) -> np.ndarray:
        """The whole tensor as a new array of its holder dtype and shape."""
        raw = np.empty(info.nbytes, dtype=np.uint8)
        self.read_into(info, 0, info.numel, raw)
        return raw.view(info.dtype.holder).reshape(info.shape)

    def _pread(self, view: np.ndarray, offset: int) -> None:
        done, total = 0, len(view)
        while done < total:
            got = os.preadv(self._fd, [view[done:]], offset + done)
            if got <= 0:
                raise UserError(f"{self.path} ended early (truncated while reading?); re-run the stage")
            done += got

    def sha256(self) -> str:
        """:meth:`hexdigest` of a reader opened with the default ``hash_algorithm="sha256"``."""
        if self.hash_algorithm != "sha256":
            raise ValueError(f"{self.path} is hashed with {self.hash_algorithm}, not sha256")
        return self.hexdigest()

    def hexdigest(self) -> str:
        """The whole file's digest (``hash_algorithm``): the bytes hashed while streaming, plus a read
        of whatever was not."""
        buffer = np.empty(1 << 20, dtype=np.uint8)
        while self._hashed_upto < self.size:
            view = buffer[: min(len(buffer), self.size - self._hashed_upto)]
            self._pread(view, self._hashed_upto)
            self._digest.update(view)
            self._hashed_upto += len(view)
        return self._digest.hexdigest()

    def header(self) -> dict[str, dict[str, Any]]:
        """Tensor name -> {shape, dtype}, the form gather.json records."""
        return {name: {"shape": list(t.shape), "dtype": t.dtype.name} for name, t in self.tensors.items()}

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> SafetensorsReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def file_order(entries: dict[str, tuple[str, list[int]]]) -> list[str]:
    """The order safetensors writes tensors in: dtype (enum order, largest first), then name."""
    return sorted(entries, key=lambda name: (-DTYPES[entries[name][0]].order, name))


class SafetensorsWriter:
    """Write a safetensors file whose header is known up front; tensor bytes then arrive in file order.

    ``entries`` maps name -> (dtype name, shape). ``write(name, data)`` appends bytes of ``name``, which
    must be the tensor being written or the next one in ``self.names``; ``close`` checks completeness.
    """

    def __init__(
        self,
        path: str | os.PathLike,
        entries: dict[str, tuple[str, list[int]]],
        metadata: dict[str, str] | None = None,
    ) -> None:
        self.names = file_order(entries)
        header: dict[str, Any] = {}
        if metadata is not None:
            header["__metadata__"] = dict(sorted(metadata.items()))
        self.sizes: dict[str, int] = {}
        position = 0
        for name in self.names:
            dtype, shape = entries[name]
            size = math.prod(shape) * DTYPES[dtype].itemsize
            header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [position, position + size]}
            self.sizes[name] = size
            position += size
        raw = json.dumps(header, ensure_ascii=False, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        self._file = open(path, "wb")  # noqa: SIM115 (closed by close())
        self._digest = hashlib.sha256()
        self._emit(struct.pack("<Q", len(raw)) + raw)
        self._index = 0  # tensor being written
        self._written = 0  # its bytes so far

    def _emit(self, data) -> None:
        self._file.write(data)
        self._digest.update(data)

    def _advance(self) -> None:
        while self._index < len(self.names) and self._written == self.sizes[self.names[self._index]]:
            self._index, self._written = self._index + 1, 0

    def write(self, name: str, data) -> None:
        data = memoryview(data).cast("B")
        if not len(data):
            return
        self._advance()
        if self._index >= len(self.names) or self.names[self._index] != name:
            expected = self.names[self._index] if self._index < len(self.names) else "nothing"
            raise RuntimeError(f"safetensors writer: got bytes of {name!r}, expected {expected!r}")
        if self._written + len(data) > self.sizes[name]:
            raise RuntimeError(f"safetensors writer: too many bytes for {name!r}")
        self._emit(data)
        self._written += len(data)

    def discard(self) -> None:
        """Close without the completeness check (the caller is failing anyway)."""
        self._file.close()

    def close(self) -> str:
        """Finish the file; returns its sha256. Raises if a tensor is incomplete."""
        self._file.close()
        self._advance()
        if self._index != len(self.names):
            raise RuntimeError(f"safetensors writer: {self.names[self._index]!r} was not fully written")
        return self._digest.hexdigest()


# ---------------------------------------------------------------- float codecs


def decode_float(raw: np.ndarray, dtype: DType, out: np.ndarray) -> np.ndarray:
    """Raw little-endian bytes of a float dtype -> float64 values in ``out`` (exact for every dtype)."""
    count = len(raw) // dtype.itemsize
    target = out[:count]
    if dtype.name == "BF16":  # bfloat16 is the top half of a float32
        wide = raw.view("<u2").astype(np.uint32)
        wide <<= 16
        np.copyto(target, wide.view(np.float32))
    else:
        np.copyto(target, raw.view(dtype.holder))
    return target


def decode_narrow(raw: np.ndarray, dtype: DType, out: np.ndarray) -> np.ndarray:
    """Raw little-endian bytes of a float dtype -> its values in the narrowest numpy float type that
    holds each of them exactly: F32 and F64 as views of ``raw`` (no copy), F16 and BF16 as float32 in
    the uint8 buffer ``out``. Numpy's cast of the result to float64 gives :func:`decode_float`'s values,
    so float64 arithmetic on these (``dtype=np.float64``) is bit for bit that on decoded values, and
    reads half the bytes."""
    if dtype.name in ("F32", "F64"):
        return raw.view(dtype.holder)
    target = out[: len(raw) // dtype.itemsize * 4].view(np.float32)
    if dtype.name == "BF16":  # bfloat16 is the top half of a float32
        bits = target.view(np.uint32)
        np.copyto(bits, raw.view("<u2"))
        bits <<= 16
    else:
        np.copyto(target, raw.view(dtype.holder))
    return target


def encode_float(values: np.ndarray, dtype: DType, out: np.ndarray) -> np.ndarray:
    """float64 values -> raw bytes of ``dtype`` in the uint8 buffer ``out``, rounding to nearest even.

    F16 and BF16 round via float32, exactly as torch's ``.to(dtype)`` does (so a torch reference
    matches bit for bit); a BF16 NaN becomes the canonical quiet NaN 0x7FC0."""
    raw = out[: len(values) * dtype.itemsize]
    with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf, as in torch
        if dtype.name == "BF16":
            bits = values.astype(np.float32).view(np.uint32)
            bits += np.uint32(0x7FFF) + ((bits >> np.uint32(16)) & np.uint32(1))
            bits >>= np.uint32(16)
            bits[np.isnan(values)] = 0x7FC0
            np.copyto(raw.view("<u2"), bits, casting="unsafe")
        elif dtype.name == "F16":
            np.copyto(raw.view(dtype.holder), values.astype(np.float32), casting="unsafe")
        else:
            np.copyto(raw.view(dtype.holder), values, casting="unsafe")
    return raw


def all_finite(raw: np.ndarray, dtype: DType) -> bool:
    """Whether every value in the raw bytes ``raw`` of float ``dtype`` is finite (no inf, no NaN).

    One reduction pass: a float64 sum of F16/F32 values cannot overflow, so a finite sum means finite
    values; only a non-finite sum (or F64 values whose sum overflows) takes the exact element test.
    BF16 by its exponent bits (all ones: inf or NaN)."""
    if not dtype.is_float or not len(raw):
        return True
    if dtype.name == "BF16":
        bits = raw.view("<u2")
        return not bool(np.any(np.bitwise_and(bits, 0x7F80) == 0x7F80))
    values = raw.view(dtype.holder)
    with np.errstate(over="ignore", invalid="ignore"):
        if math.isfinite(float(np.add.reduce(values, dtype=np.float64))):
            return True
    return bool(np.isfinite(values).all())


def to_torch(array: np.ndarray, dtype: DType):
    """A numpy array of ``dtype``'s holder type as a torch tensor of ``dtype`` (shares memory)."""
    import torch  # deferred: only greedy soup scores models, and importing torch costs much RSS

    tensor = torch.from_numpy(np.ascontiguousarray(array))
    target = getattr(torch, TORCH_NAMES[dtype.name])
    return tensor if tensor.dtype == target else tensor.view(target)
