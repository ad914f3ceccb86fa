"""Merge model folders as a mergekit YAML describes (``python -m shardfuse.merge --mergekit FILE --out DIR``),
streamed by the merge engine: no training, no dataset, no gather.json.

The YAML is translated by :mod:`shardfuse.fusion.methods.mergekit`. Each model (and the base) is a
save_pretrained folder with one ``model.safetensors`` or a safetensors file; every one must hold the same
tensors, dtypes and shapes (the first that differs is named with its file). The output folder holds
``model.safetensors`` (in ``out_dtype``, else ``dtype``, else the inputs' dtype), the ``config.json`` of
the base (else the first model) with its dtype set, the tokenizer files of ``tokenizer_source`` (else of
the base, else of the first model), the YAML as ``mergekit_config.yml`` and ``merge.json`` (what ran:
shardfuse's method and parameters, mergekit's method, where the two differ, each input's sha256 of the
bytes merged, time and peak memory). It is written beside ``DIR`` and renamed into place; an existing
``DIR`` is replaced only if an earlier ``--mergekit`` merge wrote it.

Memory: the engine's blocks (:data:`shardfuse.fusion.engine.BLOCK_BYTES` of float64 across all inputs),
whatever the model size. Sharded folders (an index and several files) are read by a run with
``mergekit_config`` (the collect stage), not here.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np

from shardfuse.checkpoints.stream import (
    DTYPES,
    SafetensorsReader,
    SafetensorsWriter,
    all_finite,
    decode_float,
    encode_float,
)
from shardfuse.console.progress import StageProgress
from shardfuse.fusion.engine import BLOCK_BYTES, Engine, peak_rss_mb
from shardfuse.fusion.methods import registry
from shardfuse.fusion.methods.mergekit import MergekitConfig
from shardfuse.io import OutputFolder, UserError, replace_dir, staging_dir, write_json

WEIGHTS = "model.safetensors"
RECORD = "merge.json"
# the folders --mergekit writes: their merge.json names the mergekit method
OUTPUT = OutputFolder("merge --mergekit", "--out", RECORD, "mergekit_method")
TOKENIZER_FILES = (
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json", "merges.txt",
    "tokenizer.model", "added_tokens.json", "chat_template.jinja", "vocab.txt",
)  # fmt: skip
SAFETENSORS_NAMES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64"}


def weights_file(source: str) -> Path:
    """The one safetensors file of a model reference (a file, or a folder's model.safetensors)."""
    from shardfuse.checkpoints.init_weights import weight_files

    try:
        files = weight_files(source)
    except UserError as exc:
        raise UserError(str(exc).replace("init_from ", "model ", 1)) from None
    if len(files.shards) != 1:
        raise UserError(
            f"model {source} is sharded ({len(files.shards)} files); merge it in a run with mergekit_config: "
            "FILE (the collect stage reads shards), or re-save it as one model.safetensors"
        )
    return files.shards[0]


def _same_tensors(readers: list[SafetensorsReader]) -> None:
    first = readers[0]
    for reader in readers[1:]:
        for name, info in first.tensors.items():
            other = reader.tensors.get(name)
            if other is None:
                raise UserError(
                    f"{reader.path} has no tensor {name!r}, which {first.path} holds; merge models of one "
                    "architecture"
                )
            if (other.dtype.name, other.shape) != (info.dtype.name, info.shape):
                raise UserError(
                    f"tensor {name!r} of {reader.path} is {other.dtype.name} {list(other.shape)} but "
                    f"{first.path} has {info.dtype.name} {list(info.shape)}; merge models of one "
                    "architecture and dtype"
                )
        extra = sorted(set(reader.tensors) - set(first.tensors))
        if extra:
            raise UserError(
                f"{reader.path} has tensor {extra[0]!r}, which {first.path} lacks; merge models of one "
                "architecture"
            )


class CastSink:
    """The engine's sink, writing each float tensor's bytes in another float dtype."""

    def __init__(self, writer: SafetensorsWriter, source: dict[str, Any], target: dict[str, str]) -> None:
        self.writer, self.source, self.target = writer, source, target

    def write(self, name: str, data) -> None:
        info = self.source[name]
        target = DTYPES[self.target[name]]
        if target is info.dtype:
            self.writer.write(name, data)
            return
        raw = np.frombuffer(memoryview(data).cast("B"), dtype=np.uint8)
        values = decode_float(raw, info.dtype, np.empty(len(raw) // info.dtype.itemsize))
        cast = encode_float(values, target, np.empty(len(values) * target.itemsize, np.uint8))
        if not all_finite(cast, target):
            raise UserError(
                f"merged tensor {name} overflows out_dtype {target.name} (a value beyond its range became "
                "inf); nothing was written: use a wider out_dtype"
            )
        self.writer.write(name, cast)


def _folder(source: str) -> Path | None:
    path = Path(source)
    return path if path.is_dir() else None


def merge_folders(cfg: MergekitConfig, out: Path, block_bytes: int = BLOCK_BYTES) -> dict[str, Any]:
    """Merge ``cfg``'s models into the folder ``out``; returns merge.json's record."""
    started = time.perf_counter()
    OUTPUT.check(out)
    record = registry.method_record(cfg.method)
    num_models = len(cfg.models)
    try:
        params = registry.resolve_params(cfg.method, cfg.params, [1] * num_models)
    except UserError as exc:
        raise UserError(f"mergekit config {cfg.path} (run as shardfuse's {cfg.method}): {exc}") from None
    weights = registry.rank_weights(cfg.method, params, [1] * num_models)
    out.parent.mkdir(parents=True, exist_ok=True)
    staged = staging_dir(out)  # ours alone, renamed at the end
    try:
        with contextlib.ExitStack() as stack:
            readers = [stack.enter_context(SafetensorsReader(weights_file(m))) for m in cfg.models]
            base = None
            if record.uses_base:
                base = stack.enter_context(SafetensorsReader(weights_file(cfg.base)))
            _same_tensors(readers + ([base] if base is not None else []))
            source = readers[0].tensors
            target = {
                name: SAFETENSORS_NAMES[cfg.out_dtype]
                if cfg.out_dtype and info.dtype.is_float
                else info.dtype.name
                for name, info in source.items()
            }
            entries = {name: (target[name], list(info.shape)) for name, info in source.items()}
            try:  # the per-layer and per-tensor settings resolve against the tensor names here
                engine = Engine(
                    readers, base, cfg.method, params, list(range(num_models)), weights, block_bytes
                )
            except UserError as exc:
                raise UserError(
                    f"mergekit config {cfg.path} (run as shardfuse's {cfg.method}): {exc}"
                ) from None
            writer = SafetensorsWriter(staged / WEIGHTS, entries, {"format": "pt"})
            try:
                total = sum(source[name].numel for name in writer.names)
                with StageProgress(f"merge {cfg.path.name}", total, "parameters") as progress:
                    stats = engine.run(writer.names, CastSink(writer, source, target), progress.advance)
            except BaseException:
                writer.discard()
                raise
            digest = writer.close()
            inputs = [
                {"model": m, "file": str(r.path), "sha256": r.sha256()}
                for m, r in zip(cfg.models, readers, strict=True)
            ]
            base_input = (
                None if base is None else {"model": cfg.base, "file": str(base.path), "sha256": base.sha256()}
            )
        _copy_config(cfg, staged)
        tokenizer = _copy_tokenizer(cfg, staged)
        (staged / "mergekit_config.yml").write_text(cfg.text)
        merged = {
            "mergekit_config": str(cfg.path),
            "mergekit_config_sha256": cfg.sha256,
            "mergekit_method": cfg.mergekit_method,
            "method": cfg.method,
            "params": params,
            "weights": weights,
            "notes": list(cfg.notes),
            "inputs": inputs,
            "base": base_input,
            "dtype": cfg.dtype,
            "out_dtype": cfg.out_dtype,
            "tokenizer_from": tokenizer,
            "output": WEIGHTS,
            "sha256": digest,
            "num_tensors": len(entries),
            "num_parameters": sum(info.numel for info in source.values()),
            "max_abs_diff_between_models": max((st["max_abs_diff"] for st in stats.values()), default=0.0),
            "seconds": time.perf_counter() - started,
            "peak_rss_mb": peak_rss_mb(),
        }
        if engine.table is not None:
            merged["per_tensor_params"] = engine.table.summary()
        write_json(staged / RECORD, merged)
        replace_dir(staged, out, OUTPUT)  # only a folder a --mergekit merge wrote is replaced
    except BaseException:
        shutil.rmtree(staged, ignore_errors=True)
        raise
    return merged


def _copy_config(cfg: MergekitConfig, staged: Path) -> None:
    folder = _folder(cfg.base) if cfg.base else None
    folder = folder or _folder(cfg.models[0])
    if folder is None or not (folder / "config.json").is_file():
        return
    config = json.loads((folder / "config.json").read_text())
    if cfg.out_dtype is not None:
        config["dtype" if "dtype" in config else "torch_dtype"] = cfg.out_dtype
    (staged / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    if (folder / "generation_config.json").is_file():
        shutil.copyfile(folder / "generation_config.json", staged / "generation_config.json")


def _copy_tokenizer(cfg: MergekitConfig, staged: Path) -> str | None:
    source = cfg.tokenizer_source or cfg.base or cfg.models[0]
    folder = _folder(source)
    if folder is None:
        if cfg.tokenizer_source is not None:
            raise UserError(f"tokenizer_source {source} is not a folder; name a model folder or base")
        return None
    copied = [name for name in TOKENIZER_FILES if (folder / name).is_file()]
    if cfg.tokenizer_source is not None and not copied:
        raise UserError(
            f"tokenizer_source {source} holds no tokenizer files ({', '.join(TOKENIZER_FILES[:3])}, ...); "
            "name a folder with a tokenizer"
        )
    for name in copied:
        shutil.copyfile(folder / name, staged / name)
    return str(folder) if copied else None
