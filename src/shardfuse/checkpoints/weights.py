"""Checkpoint IO: safetensors weights + JSON metadata, written atomically, never unpickled.

The metadata (model spec, run, rank, ...) is stored twice on purpose: inside the safetensors header
(so a weights file is self-describing) and as a sidecar ``.json`` (so humans and tools can read it
without a safetensors reader).

Reading headers and metadata needs no torch (gather, track and the launcher stay light); torch is
imported only to save or load tensors.
"""

from __future__ import annotations

import errno
import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from safetensors import SafetensorError, safe_open

from shardfuse.io import UserError, atomic_path, sha256_file, write_json

if TYPE_CHECKING:
    import torch

METADATA_KEY = "shardfuse"


# safetensors reports a failed write as "I/O error: No space left on device (os error 28)".
OS_ERROR = re.compile(r"\(os error (\d+)\)")


def write_safetensors(
    tensors: dict[str, torch.Tensor] | dict[str, Any],
    path: str | os.PathLike,
    metadata: dict[str, str] | None = None,
) -> None:
    """``save_file``, but a failed or short write is an OSError naming ``path`` (disk full, read-only,
    ...), as a Python write's would be: safetensors raises its own error for a failed write, and a
    small file's last buffer can fail to reach the disk silently, so the file is read back once (its
    header and its size, not its tensors). Torch tensors, or numpy arrays (no torch import)."""
    if tensors and all(type(t).__module__ == "numpy" for t in tensors.values()):
        from safetensors.numpy import save_file
    else:
        from safetensors.torch import save_file

    try:
        save_file(tensors, str(path), metadata=metadata)
    except SafetensorError as exc:
        code = OS_ERROR.search(str(exc))
        if code is None:
            raise
        number = int(code.group(1))
        raise OSError(number, os.strerror(number), str(path)) from None
    try:
        with safe_open(str(path), framework="numpy"):
            pass
    except (SafetensorError, OSError) as exc:
        raise OSError(
            errno.EIO, f"written incompletely ({exc}); is its filesystem full?", str(path)
        ) from None


def save_weights(
    path: str | os.PathLike, tensors: dict[str, torch.Tensor], metadata: dict[str, Any], sidecar: bool = True
) -> str:
    """Write ``tensors`` (contiguous CPU copies) atomically; returns the file's sha256."""
    path = Path(path)
    cpu = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    with atomic_path(path) as tmp:
        write_safetensors(cpu, tmp, {METADATA_KEY: json.dumps(metadata, sort_keys=True)})
    digest = sha256_file(path)
    if sidecar:
        write_json(path.with_suffix(".json"), {**metadata, "sha256": digest, "bytes": path.stat().st_size})
    return digest


def _open(path: Path, framework: str = "numpy"):
    """A safetensors handle; "numpy" (headers, metadata) needs no torch, "pt" loads torch tensors."""
    if not path.is_file():
        raise UserError(f"checkpoint {path} does not exist; re-run the stage that writes it")
    try:
        return safe_open(str(path), framework=framework, device="cpu")
    except (SafetensorError, OSError, ValueError) as exc:
        raise UserError(
            f"checkpoint {path} is not a readable safetensors file ({exc}); re-run the stage that "
            "writes it, or point at a checkpoint it wrote"
        ) from None


def read_metadata(path: str | os.PathLike) -> dict[str, Any]:
    with _open(Path(path)) as fh:
        raw = (fh.metadata() or {}).get(METADATA_KEY)
    if raw is None:
        raise UserError(
            f"checkpoint {path} has no shardfuse metadata; it was not written by shardfuse — "
            "point at a shardfuse checkpoint"
        )
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise UserError(
            f"checkpoint {path} has malformed shardfuse metadata ({exc}); re-run the stage that writes it"
        ) from None


def read_header(path: str | os.PathLike) -> dict[str, dict[str, Any]]:
    """Tensor name -> {shape, dtype} without loading any tensor data."""
    with _open(Path(path)) as fh:
        header = {}
        for name in fh.keys():
            piece = fh.get_slice(name)
            header[name] = {"shape": list(piece.get_shape()), "dtype": piece.get_dtype()}
    return header


def load_weights(path: str | os.PathLike) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    path = Path(path)
    with _open(path, framework="pt") as fh:
        tensors = {name: fh.get_tensor(name) for name in fh.keys()}
    return tensors, read_metadata(path)
