"""The text source: a corpus of files cut into blocks of block_size + 1 token ids (the bytes, or a user
tokenizer's ids; ``{stdlib}`` in paths is the Python standard library), for causal_lm.

No command line; a library module: :class:`Text` is the source's behaviour, named by its record in
:mod:`shardfuse.data.sources.registry`. By hand::

    python -c "from shardfuse.data.sources.text import read_text_blocks
    spec = {'paths': ['{stdlib}/json/*.py'], 'exclude': [], 'block_size': 64, 'max_tokens': None,
            'tokenizer': None}
    print(read_text_blocks(spec).blocks.shape)"
"""

from __future__ import annotations

import os
from typing import Any, NamedTuple

import numpy as np

from shardfuse.data.sources.base import Described, Loaded, SourceBehaviour
from shardfuse.data.sources.checks import SPEC_FIX, require_int, require_names
from shardfuse.data.sources.files import matching_text_files
from shardfuse.data.sources.hf_tokenizer import is_hf, load_hf_tokenizer, tokenizer_file
from shardfuse.io import UserError, error_reason
from shardfuse.models.task import Task
from shardfuse.models.usercode import load_factory

VOCAB_SIZE = 256  # the byte tokenizer's vocabulary
MAX_UINT16_VOCAB = 65535  # token blocks are uint16 up to this vocabulary size, int32 above


class Text(SourceBehaviour):
    """Token blocks of a corpus: block_size inputs and, shifted by one, block_size next-token targets."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        require_names(spec, "paths", "non-empty list of glob patterns")
        require_names(spec, "exclude", "list of glob patterns", allow_empty=True)
        require_int(spec, "block_size", 2)
        if spec["max_tokens"] is not None:
            require_int(spec, "max_tokens", 2)
        tokenizer = spec["tokenizer"]
        if is_hf(tokenizer):
            tokenizer_file(tokenizer)
            if "vocab_size" in spec:
                require_int(spec, "vocab_size", 2)
            return
        if tokenizer is None:
            if "vocab_size" in spec:
                raise UserError(
                    "spec key 'vocab_size' only applies with a tokenizer (the byte tokenizer's vocabulary is "
                    f"{VOCAB_SIZE}); drop vocab_size or set tokenizer: package.module:function"
                )
            return
        module_name, sep, attribute = tokenizer.partition(":") if isinstance(tokenizer, str) else ("", "", "")
        if not (module_name and sep and attribute):
            raise UserError(
                f"spec key 'tokenizer' must be an import path package.module:function (or null for bytes), "
                f"got {tokenizer!r}; {SPEC_FIX}"
            )
        if "vocab_size" not in spec:
            raise UserError(
                f"tokenizer {tokenizer!r} needs 'vocab_size' (one more than its largest token id); {SPEC_FIX}"
            )
        require_int(spec, "vocab_size", 2)
        if spec["vocab_size"] > np.iinfo(np.int32).max:
            raise UserError(f"spec key 'vocab_size' must be < 2**31, got {spec['vocab_size']}; {SPEC_FIX}")

    def describe(self, spec: dict[str, Any], task: Task) -> Described:
        """A tokenizer's bytes per token is measured on the corpus: left out here (it scales a metric,
        not a tensor)."""
        block_size, tokenizer = int(spec["block_size"]), spec.get("tokenizer")
        if tokenizer is None:
            vocab_size = VOCAB_SIZE
        elif is_hf(tokenizer):
            vocab_size = max(load_hf_tokenizer(tokenizer)[1], int(spec.get("vocab_size", 0)))
        else:
            vocab_size = int(spec["vocab_size"])
        width = block_size + 1  # block_size inputs and, shifted by one, the targets
        keys = {"vocab_size": vocab_size, "block_size": block_size, "tokenizer": tokenizer}
        return Described("tokens", [width], [f"t{j}" for j in range(width)], [], keys)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        text = read_text_blocks(spec)
        blocks = text.blocks
        keys = {
            "vocab_size": text.vocab_size,
            "block_size": spec["block_size"],
            "num_tokens": text.num_tokens,
            "tokenizer": spec["tokenizer"],
        }
        if text.bytes_per_token is not None:  # bits per byte = bits per token / bytes per token
            keys["bytes_per_token"] = text.bytes_per_token
        return Loaded(blocks, None, [f"t{j}" for j in range(blocks.shape[1])], [], "tokens", keys)


JSON_SUFFIXES = (".jsonl", ".jsonl.gz", ".json")


def refuse_json_files(files: list[str]) -> None:
    """A JSON Lines or JSON file read as text would train on its raw syntax (quotes, keys, escapes)."""
    found = [path for path in files if path.lower().endswith(JSON_SUFFIXES)]
    if found:
        more = f" (and {len(found) - 1} more)" if len(found) > 1 else ""
        raise UserError(
            f"{found[0]}{more} is JSON, which source: text would read as raw text (its quotes, keys and "
            "escapes); use source: jsonl with text_field (or prompt_field and completion_field), or "
            "exclude it"
        )


def text_files(spec: dict) -> list[str]:
    """The files a text spec reads (:func:`shardfuse.data.sources.files.matching_text_files`, which the
    workflow makes prepare's inputs); UserError when there are none."""
    found = matching_text_files(spec)
    if not found:
        excluding = f" (after exclude {spec['exclude']})" if spec["exclude"] else ""
        raise UserError(
            f"no file matches the text dataset's paths {spec['paths']}{excluding}; fix 'paths' (relative "
            f"to {os.getcwd()}, or absolute)"
        )
    return found


def _read_file(path: str, size: int = -1) -> bytes:
    try:
        with open(path, "rb") as file:
            return file.read(size)
    except OSError as exc:
        reason = error_reason(exc)
        raise UserError(f"cannot read text file {path} ({reason}); fix 'paths' or the file") from None


def _read_text(files: list[str], max_tokens: int | None) -> bytearray:
    """The files' bytes joined by b"\\n", at most max_tokens of them (files read only as far as needed)."""
    corpus = bytearray()
    for index, path in enumerate(files):
        if max_tokens is not None and len(corpus) >= max_tokens:
            break
        if index:
            corpus += b"\n"
        corpus += _read_file(path, -1 if max_tokens is None else max(0, max_tokens - len(corpus)))
    if max_tokens is not None:
        del corpus[max_tokens:]  # the last separator may have stepped past it
    return corpus


def load_tokenizer(spec: dict) -> tuple[Any, int]:
    """The spec's tokenizer (``hf:DIR`` or ``package.module:function``, bytes to token ids) and its
    vocabulary size (an hf tokenizer's own, or the spec's vocab_size where that is larger)."""
    ref = spec["tokenizer"]
    if is_hf(ref):
        tokenize, size = load_hf_tokenizer(ref)
        return tokenize, max(size, int(spec.get("vocab_size") or 0))
    return _load_tokenizer(ref), int(spec["vocab_size"])


def _load_tokenizer(ref: str):
    if is_hf(ref):
        return load_hf_tokenizer(ref)[0]
    try:
        return load_factory(ref)
    except UserError as exc:  # usercode speaks of models; say tokenizer, and how a dataset finds its code
        message = str(exc).replace(f"model {ref!r}", f"tokenizer {ref!r}", 1)
        message = message.replace("add its directory to `code_paths`", "set PYTHONPATH to its directory")
        raise UserError(message.replace("returns an nn.Module", "maps bytes to token ids")) from None


def token_ids(tokenize, data: bytes, what: str, spec: dict) -> np.ndarray:
    """The user tokenizer's ids for ``data`` as an int64 array, checked against the vocabulary."""
    ref, vocab_size = spec["tokenizer"], spec["vocab_size"]
    try:
        ids = np.asarray(tokenize(data))
    except Exception as exc:  # any failure inside user code is the user's to fix
        reason = f"{type(exc).__name__}: {exc}".splitlines()[0]
        raise UserError(f"tokenizer {ref!r} failed on {what} ({reason}); fix the tokenizer") from None
    if ids.ndim != 1 or (ids.size and not np.issubdtype(ids.dtype, np.integer)):
        raise UserError(
            f"tokenizer {ref!r} returned {ids.dtype} values of shape {ids.shape} for {what}; it must "
            "return a list or 1-d array of integer token ids"
        )
    bad = ids[(ids < 0) | (ids >= vocab_size)]
    if bad.size:
        raise UserError(
            f"tokenizer {ref!r} returned token id {bad[0]} for {what}, outside [0, vocab_size="
            f"{vocab_size}); raise vocab_size or fix the tokenizer"
        )
    return ids.astype(np.int64)


def _read_tokens(files: list[str], spec: dict) -> tuple[np.ndarray, float]:
    """The user tokenizer's ids of each file, joined by those of b"\\n" (as the byte tokenizer joins the
    files), at most max_tokens of them: files are read whole, and no further once max_tokens is reached;
    and the bytes per token of what was read (for bits per byte)."""
    tokenize, max_tokens = _load_tokenizer(spec["tokenizer"]), spec["max_tokens"]
    separator = token_ids(tokenize, b"\n", "the file separator b'\\n'", spec)
    pieces: list[np.ndarray] = []
    num_tokens = num_bytes = 0
    for index, path in enumerate(files):
        if max_tokens is not None and num_tokens >= max_tokens:
            break
        data = _read_file(path)
        pieces += [separator] if index else []
        pieces.append(token_ids(tokenize, data, path, spec))
        num_tokens += len(pieces[-1]) + (len(separator) if index else 0)
        num_bytes += len(data) + (1 if index else 0)
    return np.concatenate(pieces)[:max_tokens], num_bytes / max(num_tokens, 1)


def token_dtype(vocab_size: int) -> type[np.integer]:
    return np.uint16 if vocab_size <= MAX_UINT16_VOCAB else np.int32


class TextBlocks(NamedTuple):
    blocks: np.ndarray  # (num_blocks, block_size + 1) token ids
    num_tokens: int  # tokens read (the tail that fills no block included)
    vocab_size: int
    bytes_per_token: float | None  # of the text read; None for the byte tokenizer (1 by definition)


def read_text_blocks(spec: dict) -> TextBlocks:
    """The text spec's rows, a (num_blocks, block_size + 1) array of token ids (uint16, or int32 for a
    vocabulary over 65535; the tail that fills no block is dropped), with what dataset.json records."""
    files = text_files(spec)
    refuse_json_files(files)
    bytes_per_token = None
    if is_hf(spec["tokenizer"]):
        size = load_hf_tokenizer(spec["tokenizer"])[1]
        spec = {**spec, "vocab_size": max(size, spec.get("vocab_size", 0))}
    if spec["tokenizer"] is None:
        tokens = np.frombuffer(_read_text(files, spec["max_tokens"]), dtype=np.uint8)
    else:
        tokens, bytes_per_token = _read_tokens(files, spec)
    row_tokens = spec["block_size"] + 1  # block_size inputs and, shifted by one, block_size targets
    num_blocks = len(tokens) // row_tokens
    if num_blocks < 3:
        raise UserError(
            f"the text files give {len(tokens)} tokens, {num_blocks} block(s) of block_size + 1 = "
            f"{row_tokens}; a train/val/test split needs at least 3: add text or lower block_size"
        )
    blocks = tokens[: num_blocks * row_tokens].reshape(num_blocks, row_tokens)
    vocab_size = spec.get("vocab_size", VOCAB_SIZE)
    return TextBlocks(blocks.astype(token_dtype(vocab_size)), len(tokens), vocab_size, bytes_per_token)
