"""A sharded checkpoint as torch.distributed.checkpoint writes it with Hugging Face's storage writer
(``save_distributed=True``): each rank's safetensors file holds its chunk of every tensor, with the
chunk's offsets in the header's ``DCP_SHARDING_INFO``. :class:`ShardedCheckpoint` reads the whole tensors
back through the streaming reader (shardfuse.checkpoints.stream), block by block, with no torch: the
merge stage's consolidate of an fsdp run. No command line; by hand::

    python -c "from shardfuse.checkpoints.dcp import ShardedCheckpoint as S; \
        print(list(S('results/trainings/T/ranks/dcp').tensors)[:3])"
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from shardfuse.checkpoints.stream import DTYPES, SafetensorsReader, TensorInfo
from shardfuse.io import UserError

DCP_SHARDING_KEY = "DCP_SHARDING_INFO"
DCP_FIX = (
    "save it with torch.distributed.checkpoint.save(state_dict, storage_writer="
    "HuggingFaceStorageWriter(DIR, save_distributed=True))"
)


@dataclass(frozen=True)
class Chunk:
    reader: SafetensorsReader
    info: TensorInfo
    offsets: tuple[int, ...]

    def box(self) -> tuple[tuple[int, int], ...]:
        return tuple((o, o + s) for o, s in zip(self.offsets, self.info.shape, strict=True))


def _overlap(a: tuple[tuple[int, int], ...], b: tuple[tuple[int, int], ...]) -> bool:
    return all(lo1 < hi2 and lo2 < hi1 for (lo1, hi1), (lo2, hi2) in zip(a, b, strict=True))


class ShardedCheckpoint:
    """A torch.distributed.checkpoint directory in DCP's safetensors format, read without pickle.

    DCP's default format (FileSystemWriter) keeps its index in ``.metadata``, a pickle, and each tensor
    as a torch.save record; reading either means unpickling, which shardfuse never does, so such a
    directory is refused. ``HuggingFaceStorageWriter(save_distributed=True)`` writes one safetensors file
    per rank whose header says where each local chunk sits in the full tensor (DCP_SHARDING_INFO, JSON):
    everything needed to reassemble the full tensors, one at a time."""

    def __init__(self, directory: str | os.PathLike) -> None:
        directory = Path(directory)
        if not directory.is_dir():
            raise UserError(
                f"DCP checkpoint directory {directory} does not exist; pass the directory dcp.save wrote"
            )
        if (directory / ".metadata").exists():
            raise UserError(
                f"{directory} is a DCP checkpoint in the default format, whose index (.metadata) and "
                f"tensors are pickles, and shardfuse never unpickles; {DCP_FIX}"
            )
        files = sorted(directory.glob("*.safetensors")) or sorted(
            (directory / "sharded").glob("*.safetensors")
        )
        if not files:
            raise UserError(f"{directory} holds no .safetensors shards; {DCP_FIX}")
        self.readers = [SafetensorsReader(path) for path in files]
        self.chunks: dict[str, list[Chunk]] = {}
        for reader in self.readers:
            try:
                sharding = json.loads(reader.metadata.get(DCP_SHARDING_KEY, "{}"))
            except json.JSONDecodeError:
                sharding = None
            if not isinstance(sharding, dict):
                raise UserError(f"{reader.path} has an unreadable {DCP_SHARDING_KEY} entry; {DCP_FIX}")
            for name, info in reader.tensors.items():
                offsets = (sharding.get(name) or {}).get("saved_offsets", [0] * len(info.shape))
                if not (
                    isinstance(offsets, list)
                    and len(offsets) == len(info.shape)
                    and all(isinstance(o, int) and o >= 0 for o in offsets)
                ):
                    raise UserError(f"{reader.path}: tensor {name!r} has malformed saved_offsets; {DCP_FIX}")
                self.chunks.setdefault(name, []).append(Chunk(reader, info, tuple(offsets)))
        self.shapes: dict[str, tuple[str, list[int]]] = {}
        for name, chunks in self.chunks.items():
            dtypes = {chunk.info.dtype.name for chunk in chunks}
            if len(dtypes) != 1:
                raise UserError(f"{directory}: the shards of {name!r} have different dtypes {sorted(dtypes)}")
            shape = [max(hi for _, hi in dims) for dims in zip(*(c.box() for c in chunks), strict=True)]
            self.shapes[name] = (dtypes.pop(), shape)

    def assemble(self, name: str) -> np.ndarray:
        """The full tensor ``name``, after checking its chunks tile it exactly (no gap, no overlap;
        a chunk saved twice must be saved identically)."""
        dtype_name, shape = self.shapes[name]
        dtype = DTYPES[dtype_name]
        full = np.empty(shape, dtype=dtype.holder)
        placed: dict[tuple, np.ndarray] = {}
        for chunk in self.chunks[name]:
            box, values = chunk.box(), chunk.reader.read_array(chunk.info)
            if box in placed:
                if not np.array_equal(placed[box].view(np.uint8), values.view(np.uint8)):
                    raise UserError(
                        f"tensor {name!r} is saved twice with different values; re-save the checkpoint"
                    )
                continue
            if any(_overlap(box, other) for other in placed):
                raise UserError(f"tensor {name!r} has overlapping shards; re-save the checkpoint")
            placed[box] = values
            full[tuple(slice(lo, hi) for lo, hi in box)] = values
        if sum(values.size for values in placed.values()) != math.prod(shape):
            raise UserError(f"the shards of tensor {name!r} do not cover it; is a rank's file missing?")
        return full

    def close(self) -> None:
        for reader in self.readers:
            reader.close()

    def __enter__(self) -> ShardedCheckpoint:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
