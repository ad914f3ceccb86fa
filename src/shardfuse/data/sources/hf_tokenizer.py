"""``tokenizer: hf:DIR`` for a text dataset: the fast tokenizer (``tokenizer.json``) of a local
``save_pretrained`` folder, read with the ``tokenizers`` package (the optional extra ``shardfuse[hf]``),
so a pretrained model's own tokenizer tokenizes its fine-tuning corpus. Its vocabulary size is the
dataset's ``vocab_size`` unless the spec sets a larger one."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from shardfuse.io import UserError

PREFIX = "hf:"


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
