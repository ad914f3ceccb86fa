"""The weights a run's ``init_from`` names, read through safetensors only (nothing is ever unpickled):
a checkpoint shardfuse wrote, any other safetensors file (a Hugging Face ``model.safetensors``), or a
Hugging Face ``save_pretrained`` folder (its ``model.safetensors``, or the shards its
``model.safetensors.index.json`` lists in ``weight_map``).

Names, dtypes and shapes come from the files' headers without torch: the config check lists a folder's
files in the Snakefile's process, and ``python -m shardfuse.check_init`` matches the names against the
model built on the meta device. torch is imported only to load tensors (the train stage). Both go
through :func:`match_names`, so a file that changed after the config check fails at train time with
the same line. Its rules:

- ``init_from_prefix`` ({file prefix: model prefix}) renames the file's tensors first: the longest file
  prefix a name starts with is replaced by its model prefix (``{"model.": ""}`` unwraps a wrapper's
  names, ``{"": "transformer."}`` adds one); a prefix mapped to null leaves those tensors out.
- A tied tensor (GPT-2's ``lm_head.weight`` is ``transformer.wte.weight``; the model's ties come from
  :func:`shardfuse.models.adapter.ties_of`) may be stored under either of its names, or under both if
  the two hold the same values (compared when loading, by :func:`shardfuse.models.adapter.expand_ties`).
- Every tensor the model stores must be there with its shape; a tensor left over is an error too, so
  nothing is loaded by name guessing or partially. The first missing tensor (in the model's order) or
  the first unexpected one (sorted) is named.
- dtypes: a shardfuse checkpoint must have the model's own (it was written by this model). A foreign
  file's floating-point tensors are cast to the model's floating-point dtype (fp32, bf16, fp16, fp64),
  as transformers' from_pretrained does: a pretrained file's dtype is how it was stored, not part of
  the architecture. Any other dtype difference is an error.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from safetensors import SafetensorError, safe_open

from shardfuse.io import UserError

if TYPE_CHECKING:
    import torch

METADATA_KEY = "shardfuse"  # as shardfuse.checkpoints.weights writes it
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
PICKLED = ("pytorch_model.bin", "pytorch_model.bin.index.json")
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit

# The header's dtype names, spelt as torch prints them (the messages name torch dtypes, as the model's).
DTYPES = {
    "F64": "torch.float64",
    "F32": "torch.float32",
    "F16": "torch.float16",
    "BF16": "torch.bfloat16",
    "F8_E4M3": "torch.float8_e4m3fn",
    "F8_E5M2": "torch.float8_e5m2",
    "I64": "torch.int64",
    "I32": "torch.int32",
    "I16": "torch.int16",
    "I8": "torch.int8",
    "U64": "torch.uint64",
    "U32": "torch.uint32",
    "U16": "torch.uint16",
    "U8": "torch.uint8",
    "BOOL": "torch.bool",
}
CASTABLE = frozenset({"torch.float64", "torch.float32", "torch.float16", "torch.bfloat16"})

SHARDFUSE_FIX = "start from a checkpoint of the same model"
FOREIGN_FIX = (
    "start from weights of this architecture (model, model_args), or map the file's names onto the "
    "model's with init_from_prefix"
)


class WeightFiles(NamedTuple):
    """The safetensors files of an init_from path, and a folder's index (None for one file)."""

    shards: tuple[Path, ...]
    index: Path | None = None
    weight_map: dict[str, str] | None = None  # tensor name -> shard file name (the index's)

    @property
    def paths(self) -> list[Path]:
        """Every file the weights are read from (the index first): the train rule's inputs."""
        return [*([self.index] if self.index else []), *self.shards]


@dataclass(frozen=True)
class HeldTensor:
    dtype: str  # torch's spelling, e.g. "torch.float32"
    shape: tuple[int, ...]
    file: Path


@dataclass(frozen=True)
class InitWeights:
    """What an init_from path holds, from its headers only."""

    path: Path
    tensors: dict[str, HeldTensor]  # the names as stored
    metadata: dict[str, Any] | None  # a shardfuse checkpoint's header record; None for a foreign file

    @property
    def foreign(self) -> bool:
        return self.metadata is None

    @property
    def source(self) -> str:
        return f"init_from {self.path}"


def weight_files(path: str | os.PathLike) -> WeightFiles:
    """A file is itself; a save_pretrained folder is its model.safetensors, or the shards its index
    lists (a shard must be a file of the folder itself). Reads no tensor and imports no torch."""
    path = Path(path)
    if path.is_file():
        return WeightFiles((path,))
    if not path.is_dir():
        raise UserError(
            f"init_from {path} is not a file or folder; give a safetensors file, a save_pretrained "
            "folder or run:NAME (the merged model of run NAME)"
        )
    if (path / SINGLE_FILE).is_file():
        return WeightFiles((path / SINGLE_FILE,))
    if (path / INDEX_FILE).is_file():
        return _sharded(path)
    if any((path / name).exists() for name in PICKLED) or any(path.glob("pytorch_model-*.bin")):
        raise UserError(
            f"init_from {path} holds pytorch_model.bin but no {SINGLE_FILE}: shardfuse reads safetensors "
            "only (a pickle runs code when loaded); re-save the model as safetensors (save_pretrained "
            "writes model.safetensors)"
        )
    raise UserError(
        f"init_from {path} is a folder without {SINGLE_FILE} or {INDEX_FILE}; give a safetensors file or "
        "a folder written by save_pretrained"
    )


def _sharded(folder: Path) -> WeightFiles:
    index = folder / INDEX_FILE
    fix = "re-save the folder with save_pretrained"
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, AttributeError) as exc:
        raise UserError(f"init_from {index} is not a readable index ({exc}); {fix}") from None
    if not isinstance(weight_map, dict) or not weight_map:
        raise UserError(f"init_from {index} has no weight_map (tensor name -> shard file); {fix}")
    shards = []
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or Path(shard).name != shard or shard in ("", ".", ".."):
            raise UserError(
                f"init_from {index} puts tensor {name!r} in {shard!r}, not a file of the folder; {fix}"
            )
        if not (folder / shard).is_file():
            raise UserError(f"init_from {index} lists shard {shard}, which {folder} lacks; {fix}")
        if folder / shard not in shards:
            shards.append(folder / shard)
    return WeightFiles(tuple(sorted(shards)), index, dict(weight_map))


def _open(path: Path, framework: str = "numpy"):
    """A safetensors handle; "numpy" (header only) needs no torch."""
    try:
        return safe_open(str(path), framework=framework, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(
            f"init_from {path} is not a readable safetensors file ({exc}); give a safetensors file or a "
            "save_pretrained folder"
        ) from None


def read_init_weights(path: str | os.PathLike) -> InitWeights:
    """The names, dtypes and shapes an init_from path holds (headers only), and a shardfuse
    checkpoint's record."""
    files = weight_files(path)
    tensors: dict[str, HeldTensor] = {}
    metadata = None
    for shard in files.shards:
        with _open(shard) as fh:
            for name in fh.keys():
                piece = fh.get_slice(name)  # numpy has no bf16: the dtype comes from the header
                dtype = piece.get_dtype()
                tensors[name] = HeldTensor(DTYPES.get(dtype, dtype), tuple(piece.get_shape()), shard)
            raw = (fh.metadata() or {}).get(METADATA_KEY)
    if files.weight_map is not None:
        for name, shard in files.weight_map.items():
            if tensors.get(name) is None or tensors[name].file.name != shard:
                raise UserError(
                    f"init_from {files.index} puts tensor {name!r} in {shard}, which does not hold it; "
                    "re-save the folder with save_pretrained"
                )
        tensors = {name: tensors[name] for name in files.weight_map}  # the index decides
    elif raw is not None:  # one file written by shardfuse
        try:
            metadata = json.loads(raw)
        except json.JSONDecodeError:
            metadata = None
    return InitWeights(Path(path), tensors, metadata if isinstance(metadata, dict) else None)


def header_digest(path: str | os.PathLike) -> str:
    """sha256 of everything the name check reads: the index and each file's header (its names, dtypes,
    shapes and metadata), not the tensor data."""
    files = weight_files(path)
    digest = hashlib.sha256()
    if files.index is not None:
        digest.update(files.index.read_bytes())
    for shard in files.shards:
        digest.update(shard.name.encode() + b"\0" + _header_bytes(shard))
    return digest.hexdigest()


def _header_bytes(path: Path) -> bytes:
    with open(path, "rb") as fh:
        head = fh.read(8)
        size = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
        if not 0 < size <= min(MAX_HEADER_BYTES, path.stat().st_size - 8):
            raise UserError(
                f"init_from {path} is not a readable safetensors file (no header); give a safetensors "
                "file or a save_pretrained folder"
            )
        return head + fh.read(size)


def renamed(name: str, prefix_map: Mapping[str, str | None]) -> str | None:
    """``name`` under the longest file prefix of ``prefix_map`` it starts with (None: left out)."""
    matches = [prefix for prefix in prefix_map if name.startswith(prefix)]
    if not matches:
        return name
    prefix = max(matches, key=len)
    target = prefix_map[prefix]
    return None if target is None else target + name[len(prefix) :]


Expected = Mapping[str, tuple[str, tuple[int, ...]]]  # model name -> (torch dtype as str, shape)


def expected_of(state: Mapping[str, Any]) -> dict[str, tuple[str, tuple[int, ...]]]:
    """(dtype, shape) of each tensor of a state dict (any device, meta too)."""
    return {name: (str(tensor.dtype), tuple(tensor.shape)) for name, tensor in state.items()}


def match_names(
    weights: InitWeights,
    expected: Expected,
    ties: Mapping[str, str],
    prefix_map: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """{file name: model name} of every tensor to load, or a UserError naming the first tensor that
    does not fit (see the module docstring). ``expected``: the model's stored state (the aliases of
    tied tensors left out, :func:`shardfuse.models.adapter.storable_state`); ``ties``: {alias: source}."""
    prefix_map = dict(prefix_map or {})
    source = weights.source
    fix = FOREIGN_FIX if weights.foreign else SHARDFUSE_FIX
    held: dict[str, str] = {}  # model name -> file name
    for file_name in weights.tensors:
        model_name = renamed(file_name, prefix_map)
        if model_name is None:
            continue
        if model_name in held:
            raise UserError(
                f"{source}: tensors {held[model_name]!r} and {file_name!r} both become {model_name!r} under "
                "init_from_prefix; map them to different names, or one prefix to null to leave it out"
            )
        held[model_name] = file_name
    for alias, origin in ties.items():  # stored under the alias only: it is the source's tensor
        if origin not in held and alias in held:
            held[origin] = held.pop(alias)

    def shown(model_name: str) -> str:
        file_name = held[model_name]
        return repr(model_name) if file_name == model_name else f"{file_name!r} (as {model_name!r})"

    def check(model_name: str, dtype: str, shape: tuple[int, ...]) -> None:
        found = weights.tensors[held[model_name]]
        cast = weights.foreign and found.dtype in CASTABLE and dtype in CASTABLE
        if found.shape != tuple(shape) or (found.dtype != dtype and not cast):
            raise UserError(
                f"{source}: tensor {shown(model_name)} is {found.dtype} {list(found.shape)} but the model "
                f"needs {dtype} {list(shape)}; {fix}"
            )

    for name, (dtype, shape) in expected.items():
        if name not in held:
            hint = f" (after init_from_prefix {prefix_map})" if prefix_map else ""
            extra_fix = " (same model, model_args and dataset shape)" if not weights.foreign else ""
            raise UserError(f"{source} has no tensor {name!r} that the model needs{hint}; {fix}{extra_fix}")
        check(name, dtype, shape)
    for alias, origin in ties.items():  # stored under both names: the copies' values are compared on load
        if alias in held and origin in expected:
            check(alias, *expected[origin])
    extra = sorted(set(held) - set(expected) - set(ties), key=lambda name: held[name])
    if extra:
        raise UserError(f"{source} has tensor {shown(extra[0])} the model does not have; {fix}")
    return {file_name: model_name for model_name, file_name in held.items()}


def load_tensors(
    weights: InitWeights, plan: Mapping[str, str], dtypes: Mapping[str, torch.dtype]
) -> dict[str, torch.Tensor]:
    """The tensors of ``plan`` ({file name: model name}, :func:`match_names`) under the model's names,
    floating-point ones cast to the model's dtype (``dtypes``, by model name)."""
    by_file: dict[Path, list[str]] = {}
    for file_name in plan:
        by_file.setdefault(weights.tensors[file_name].file, []).append(file_name)
    tensors = {}
    for path, names in by_file.items():
        with _open(path, framework="pt") as fh:
            for file_name in names:
                model_name = plan[file_name]
                tensor = fh.get_tensor(file_name)
                dtype = dtypes.get(model_name, tensor.dtype)
                tensors[model_name] = tensor if tensor.dtype == dtype else tensor.to(dtype)
    return tensors
