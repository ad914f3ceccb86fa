"""``tokenizer: hf:DIR`` for a text dataset: the fast tokenizer (``tokenizer.json``) of a local
``save_pretrained`` folder, read with the ``tokenizers`` package (the optional extra ``shardfuse[hf]``),
so a pretrained model's own tokenizer tokenizes its fine-tuning corpus. Its vocabulary size is the
dataset's ``vocab_size`` unless the spec sets a larger one. The folder's chat template (for
``messages_field``: :mod:`shardfuse.data.sources.chat` renders it) is ``chat_template.jinja``, or the
``chat_template`` of ``tokenizer_config.json``. Standard library only at import (the source records name
:func:`chat_problem`, the config check's)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

from shardfuse.io import UserError, error_reason

PREFIX = "hf:"
TEMPLATE_FILE = "chat_template.jinja"  # where newer transformers save a chat template
CONFIG_FILE = "tokenizer_config.json"  # where older ones do, as its chat_template key


def is_hf(ref: object) -> bool:
    return isinstance(ref, str) and ref.startswith(PREFIX)


def tokenizer_file(ref: str) -> Path:
    path = Path(ref[len(PREFIX) :]) / "tokenizer.json"
    if not path.is_file():
        raise UserError(
            f"tokenizer {ref!r}: {path} does not exist; point hf: at a save_pretrained folder with a fast "
            "tokenizer (tokenizer.json)"
        )
    return path


def load_hf_tokenizer(ref: str) -> tuple[Callable[[bytes], list[int]], int]:
    """(bytes -> token ids, the vocabulary size counting added tokens). Bytes are decoded as UTF-8,
    an undecodable byte becoming U+FFFD (a byte-level BPE then sees the replacement character)."""
    path = tokenizer_file(ref)
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise UserError(
            f"tokenizer {ref!r} needs the tokenizers package; install the extra: pip install 'shardfuse[hf]'"
        ) from None
    try:
        tokenizer = Tokenizer.from_file(str(path))
    except Exception as exc:  # the tokenizers package raises its own Exception type
        raise UserError(f"tokenizer {ref!r}: {path} does not load ({exc}); re-save the tokenizer") from None

    def tokenize(data: bytes) -> list[int]:
        return tokenizer.encode(data.decode("utf-8", errors="replace"), add_special_tokens=False).ids

    return tokenize, tokenizer.get_vocab_size(with_added_tokens=True)


def chat_template_source(ref: str) -> tuple[str, Path, dict[str, Any]]:
    """(the chat template of tokenizer ``hf:DIR``, the file it is in, tokenizer_config.json's keys);
    UserError when the folder has none."""
    folder = Path(ref[len(PREFIX) :])
    config_path = folder / CONFIG_FILE
    config: Any = {}
    if config_path.is_file():
        try:
            config = json.loads(config_path.read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise UserError(
                f"cannot read {config_path} ({error_reason(exc)}); re-save the tokenizer"
            ) from None
    config = config if isinstance(config, dict) else {}
    if (folder / TEMPLATE_FILE).is_file():
        return (folder / TEMPLATE_FILE).read_text(encoding="utf-8"), folder / TEMPLATE_FILE, config
    template = config.get("chat_template")
    if isinstance(template, list):  # named templates: [{"name": ..., "template": ...}]
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if not (isinstance(template, str) and template):
        raise UserError(
            f"tokenizer {ref!r} has no chat template (no {folder / TEMPLATE_FILE}, no chat_template in "
            f"{config_path}); add a chat_template to {config_path}, or use prompt_field and "
            "completion_field"
        )
    return template, config_path, config


def chat_problem(spec: dict[str, Any]) -> tuple[str, str] | None:
    """(key, what is wrong and the fix) of a chat spec (``messages_field``) whose tokenizer is not an
    ``hf:DIR`` folder with a chat template; None otherwise (a missing tokenizer.json is said elsewhere)."""
    ref = spec.get("tokenizer")
    if spec.get("messages_field") is None:
        return None
    if not is_hf(ref):
        return "messages_field", (
            "spec key 'messages_field' needs tokenizer: hf:DIR, a save_pretrained folder whose chat "
            "template renders the conversations; set tokenizer, or use prompt_field and completion_field"
        )
    if not (Path(ref[len(PREFIX) :]) / "tokenizer.json").is_file():
        return None
    try:
        chat_template_source(ref)
    except UserError as exc:
        return "tokenizer", str(exc)
    return None
