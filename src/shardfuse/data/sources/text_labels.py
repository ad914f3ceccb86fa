"""Text classification rows (the jsonl source with ``task: classification``): each record's
``text_field`` (default ``text``) tokenized into one row of ``block_size`` token ids, its ``label_field``
the class (strings or integers, coded 0..C-1 in sorted order as every source's labels; the names in
dataset.json and in the logged model's predictions).

One record is one row, never packed with another (a label belongs to one text): a text longer than
block_size keeps its first block_size tokens (the head, as transformers' tokenizers truncate by default;
counted in dataset.json's ``truncated_records``), a shorter one is padded after its last token with the
pad id (right padding, ``pad_id`` in dataset.json). A model reads each row's last token before the
padding: the built-in transformer's :class:`shardfuse.models.builtin.SequenceClassifier`, or a
transformers ``AutoModelForSequenceClassification`` told the pad id (``model: hf``). The pad id: the
byte tokenizer's is 256, one past the bytes (vocabulary 257); an ``hf:DIR`` tokenizer's is its pad token,
else its end-of-text token (GPT-2's practice; its own vocabulary, so a pretrained embedding fits); a
``package.module:function`` tokenizer's is its vocab_size (one more id). A text with no token is an error
naming its file and line.

No command line; a library module used by :mod:`shardfuse.data.sources.jsonl`. By hand::

    python -c "from shardfuse.data.sources.text_labels import labelled_rows
    spec = {'paths': ['reviews.jsonl'], 'exclude': [], 'text_field': 'text', 'label_field': 'label',
            'block_size': 32, 'tokenizer': None}
    print(labelled_rows(spec).features.shape)"
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from shardfuse.data.sources.base import Loaded
from shardfuse.data.sources.checks import SPEC_FIX
from shardfuse.data.sources.hf_tokenizer import CONFIG_FILE, PREFIX, is_hf, tokenizer_file
from shardfuse.data.sources.tables import label_codes
from shardfuse.data.sources.text import VOCAB_SIZE, load_tokenizer, token_dtype, token_ids
from shardfuse.io import UserError, error_reason

DEFAULT_TEXT_FIELD = "text"
LABEL_FIELD = "label_field"


def check_label_fields(spec: dict[str, Any]) -> None:
    """A text field and a label field: two field names."""
    text, label = spec.get("text_field") or DEFAULT_TEXT_FIELD, spec.get(LABEL_FIELD)
    for key, value in (("text_field", text), (LABEL_FIELD, label)):
        if not (isinstance(value, str) and value):
            raise UserError(
                f"spec key {key!r} must be a field name (a non-empty string), got {value!r}; {SPEC_FIX}"
            )
    if text == label:
        raise UserError(
            f"spec keys 'text_field' and 'label_field' both name {text!r}; name two fields; {SPEC_FIX}"
        )


def _hf_pad_id(ref: str) -> int:
    """An hf tokenizer's pad token's id, else its end-of-text token's (tokenizer_config.json names them)."""
    folder = Path(ref[len(PREFIX) :])
    try:
        config = json.loads((folder / CONFIG_FILE).read_text(encoding="utf-8"))
        vocabulary = json.loads(tokenizer_file(ref).read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise UserError(
            f"cannot read the tokenizer {ref!r} ({error_reason(exc)}); re-save it with save_pretrained"
        ) from None
    ids = {token["content"]: token["id"] for token in vocabulary.get("added_tokens", [])}
    ids |= (vocabulary.get("model") or {}).get("vocab") or {}
    for key in ("pad_token", "eos_token"):
        token = config.get(key)
        token = token.get("content") if isinstance(token, dict) else token
        if isinstance(token, str) and token in ids:
            return int(ids[token])
    raise UserError(
        f"tokenizer {ref!r} has no pad or end-of-text token to pad text rows with; set pad_token (or "
        f"eos_token) in {folder / CONFIG_FILE}"
    )


def _tokenizer(spec: dict[str, Any]) -> tuple[Any, int, int]:
    """(bytes -> int64 ids, the vocabulary size, the pad id)."""
    ref = spec.get("tokenizer")
    if ref is None:
        return (lambda data, what: np.frombuffer(data, dtype=np.uint8).astype(np.int64)), VOCAB_SIZE + 1, 256
    tokenize, vocab_size = load_tokenizer(spec)
    spec = {**spec, "vocab_size": vocab_size}
    if is_hf(ref):
        return (lambda data, what: token_ids(tokenize, data, what, spec)), vocab_size, _hf_pad_id(ref)
    return (lambda data, what: token_ids(tokenize, data, what, spec)), vocab_size + 1, vocab_size


def labelled_rows(spec: dict[str, Any], records: Iterable[tuple[str, dict[str, Any]]]) -> Loaded:
    """The records ((where, object) in order) as token rows, their labels coded; what dataset.json
    records of them."""
    text_field = spec.get("text_field") or DEFAULT_TEXT_FIELD
    label_field = spec[LABEL_FIELD]
    tokenize, vocab_size, pad_id = _tokenizer(spec)
    block_size = int(spec["block_size"])
    rows: list[np.ndarray] = []
    labels: list[Any] = []
    truncated = num_tokens = 0
    for where, record in records:
        for name in (text_field, label_field):
            if name not in record:
                found = ", ".join(sorted(map(str, record))[:10]) or "none"
                raise UserError(
                    f"{where} has no field {name!r} (its fields: {found}); fix the record, or name the "
                    "fields with text_field and label_field"
                )
        text, label = record[text_field], record[label_field]
        if not isinstance(text, str):
            raise UserError(f"{where}: field {text_field!r} is not a string; fix the record")
        if label is None or isinstance(label, (dict, list)):
            raise UserError(
                f"{where}: label field {label_field!r} is {json.dumps(label)}; a label is a string or a "
                "number: fix or drop the record"
            )
        ids = tokenize(text.encode("utf-8"), where)
        if not len(ids):
            raise UserError(f"{where}: the text is empty after tokenization; fix or drop the record")
        truncated += len(ids) > block_size
        ids = ids[:block_size]
        num_tokens += len(ids)
        row = np.full(block_size, pad_id, dtype=np.int64)
        row[: len(ids)] = ids
        rows.append(row)
        labels.append(label)
    if len(rows) < 3:
        where = spec.get("paths") or spec.get("path")
        raise UserError(f"{where} hold {len(rows)} record(s); a train/val/test split needs at least 3")
    try:
        column = pa.chunked_array([pa.array(labels)])
    except (pa.ArrowInvalid, pa.ArrowTypeError):
        raise UserError(
            f"label field {label_field!r} holds both strings and numbers; give every record one kind"
        ) from None
    codes, names = label_codes(column, label_field, str(spec.get("paths") or spec.get("path")))
    if len(names) < 2:
        raise UserError(
            f"label field {label_field!r} has a single value {names[0]!r}; a classifier needs 2 classes"
        )
    keys = {
        "vocab_size": vocab_size,
        "block_size": block_size,
        "pad_id": pad_id,
        "tokenizer": spec.get("tokenizer"),
        "records": len(rows),
        "truncated_records": truncated,
        "num_tokens": num_tokens,
    }
    tokens = np.stack(rows).astype(token_dtype(vocab_size))
    return Loaded(tokens, codes, [f"t{j}" for j in range(block_size)], names, "tokens", keys)
