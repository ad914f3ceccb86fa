"""The jsonl source: JSON Lines records (``.jsonl``, or gzip-compressed ``.jsonl.gz``), the input format
of the fine-tuning tools (TRL's SFTTrainer, axolotl, torchtune), tokenized and packed into blocks of
block_size + 1 token ids for causal_lm, as the text source packs files:

- ``text_field`` (default ``text``): language modelling on each record's text; every token counts.
- ``prompt_field`` + ``completion_field``: supervised fine-tuning. The prompt and the completion are
  tokenized apart and joined (as TRL's prompt-completion records are), and only the completion's tokens
  and the separator after it count in the loss and the metrics (loss, perplexity, bits per token and
  per byte): the prompt is context. The blocks carry the mask (``loss_mask``, one 0/1 per next token).
- ``messages_field``: chat. Each record's field is a conversation, a list of ``{"role", "content"}``
  messages (system, user, assistant: TRL's conversational format), rendered with the chat template of
  ``tokenizer: hf:DIR`` (:mod:`shardfuse.data.sources.chat`); only the assistant turns (their content and
  turn end, not the header the generation prompt adds) and the separator after the last count. The
  messages' spans are tokenized apart and joined, as a prompt and its completion are: a BPE may split
  a boundary differently than in the whole rendered text.

With ``task: classification``, ``text_field`` and ``label_field`` make one token row per record with its
label instead (sequence classification: :mod:`shardfuse.data.sources.text_labels`).

Records are joined by the tokens of ``b"\\n"`` (the text source's file separator) and packed back to
back: a block may end inside one record and the next block go on with it, and a block may hold the end
of one record and the start of the next (its tokens attend to the earlier record's, as in the packing of
TRL and torchtune without position resets). The mask is per token, so one record's prompt never counts
and never masks another's completion; a block in which no token counts (all prompt) is left out and
counted in dataset.json's ``blocks_without_loss``. Records are read in file order (files sorted by path),
each line one record; blank lines are skipped.

No command line; a library module: :class:`Jsonl` is the source's behaviour, named by its record in
:mod:`shardfuse.data.sources.registry`. By hand::

    python -c "from shardfuse.data.sources.jsonl import read_records
    spec = {'paths': ['data/*.jsonl'], 'exclude': [], 'text_field': 'text', 'prompt_field': None,
            'completion_field': None, 'messages_field': None}
    print(next(read_records(spec)))"
"""

from __future__ import annotations

import gzip
import json
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple

import numpy as np

from shardfuse.data.sources.base import Described, Loaded, SourceBehaviour
from shardfuse.data.sources.chat import chat_parts, chat_template, check_chat
from shardfuse.data.sources.checks import SPEC_FIX
from shardfuse.data.sources.text import (
    VOCAB_SIZE,
    Text,
    load_tokenizer,
    text_files,
    token_dtype,
    token_ids,
)
from shardfuse.data.sources.text_labels import check_label_fields, labelled_rows
from shardfuse.io import UserError, error_reason
from shardfuse.models.task import CLASSES, Task

SUFFIXES = (".jsonl", ".jsonl.gz")
DEFAULT_TEXT_FIELD = "text"
FIELD_KEYS = ("text_field", "prompt_field", "completion_field", "messages_field")


class Record(NamedTuple):
    where: str  # "FILE line N", for errors
    parts: tuple[tuple[str, bool], ...]  # (text, counts in the loss), in order


class Fields(NamedTuple):
    """The record fields a spec reads (those of the other kinds None)."""

    text: str | None
    prompt: str | None
    completion: str | None
    messages: str | None

    @property
    def columns(self) -> list[str]:
        return [name for name in self if name is not None]


def fields_of(spec: dict[str, Any]) -> Fields:
    """The text field (default ``text``) unless the spec names a prompt and a completion field, or a
    messages field."""
    text, prompt, completion, messages = (spec.get(key) for key in FIELD_KEYS)
    if prompt is None and completion is None and messages is None:
        return Fields(text or DEFAULT_TEXT_FIELD, None, None, None)
    return Fields(None, prompt, completion, messages)


def check_fields(spec: dict[str, Any]) -> None:
    """The record field keys: names, and one kind of record: a text field, a prompt and a completion
    field, or a messages field (with a tokenizer that has a chat template)."""
    for key in FIELD_KEYS:
        value = spec.get(key)
        if value is not None and not (isinstance(value, str) and value):
            raise UserError(
                f"spec key {key!r} must be a field name (a non-empty string), got {value!r}; {SPEC_FIX}"
            )
    text, prompt, completion, messages = (spec.get(key) for key in FIELD_KEYS)
    if (prompt is None) != (completion is None):
        given, missing = (
            ("prompt_field", "completion_field")
            if completion is None
            else ("completion_field", "prompt_field")
        )
        raise UserError(
            f"spec key {given!r} needs {missing!r} (supervised fine-tuning reads a prompt and a "
            "completion from each record); set both, or neither and text_field for plain text; "
            f"{SPEC_FIX}"
        )
    if prompt is not None and text is not None:
        raise UserError(
            "spec keys 'text_field' and 'prompt_field'/'completion_field' exclude each other: a "
            f"record is either plain text or a prompt with its completion; drop one; {SPEC_FIX}"
        )
    if prompt is not None and prompt == completion:
        raise UserError(
            f"spec keys 'prompt_field' and 'completion_field' both name {prompt!r}; name two "
            f"fields; {SPEC_FIX}"
        )
    if messages is not None:
        if text is not None or prompt is not None:
            raise UserError(
                "spec key 'messages_field' excludes 'text_field', 'prompt_field' and 'completion_field': a "
                f"record is a conversation, plain text or a prompt with its completion; drop one; {SPEC_FIX}"
            )
        check_chat(spec)


class Jsonl(SourceBehaviour):
    """Token blocks of JSON Lines records, with a loss mask for prompt/completion records; or, for
    classification, one token row per record with its label (:mod:`shardfuse.data.sources.text_labels`)."""

    def check(self, spec: dict[str, Any], task: Task) -> None:
        text_spec = {**spec, "exclude": spec.get("exclude", []), "max_tokens": spec.get("max_tokens")}
        Text().check(text_spec, task)
        if task.labels == CLASSES:
            check_label_fields(spec)
            return
        check_fields(spec)

    def describe(self, spec: dict[str, Any], task: Task) -> Described | None:
        if task.labels == CLASSES:  # the classes only the records can tell
            return None
        return Text().describe(spec, task)

    def load(self, spec: dict[str, Any], task: Task) -> Loaded:
        if task.labels == CLASSES:
            return labelled_rows(spec, read_objects(spec))
        return packed_rows(pack_records(spec), spec)


def packed_rows(packed: Packed, spec: dict[str, Any]) -> Loaded:
    """The rows of packed records for the writer, with what dataset.json records of them."""
    keys = {
        "vocab_size": packed.vocab_size,
        "block_size": spec["block_size"],
        "num_tokens": packed.num_tokens,
        "loss_tokens": packed.loss_tokens,
        "records": packed.records,
        "blocks_without_loss": packed.blocks_without_loss,
        "tokenizer": spec["tokenizer"],
    }
    if packed.bytes_per_token is not None:
        keys["bytes_per_token"] = packed.bytes_per_token
    names = [f"t{j}" for j in range(packed.blocks.shape[1])]
    return Loaded(packed.blocks, packed.mask, names, [], "tokens", keys)


def jsonl_files(spec: dict[str, Any]) -> list[str]:
    """The files the spec's globs match; each must be .jsonl or .jsonl.gz (UserError otherwise)."""
    found = text_files(spec)
    for path in found:
        if not path.endswith(SUFFIXES):
            raise UserError(
                f"{path} is not a JSON Lines file (.jsonl or .jsonl.gz); narrow 'paths' to those files, "
                "or use source: text for plain text"
            )
    return found


def _lines(path: str) -> Iterator[tuple[int, str]]:
    opener = gzip.open if path.endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8") as file:
            yield from enumerate(file, start=1)
    except (OSError, EOFError, UnicodeDecodeError) as exc:
        raise UserError(f"cannot read {path} ({error_reason(exc)}); fix the file or 'paths'") from None


def read_records(spec: dict[str, Any]) -> Iterator[Record]:
    """Every record of the spec's files, in order, as the parts that go into the token stream."""
    for where, record in read_objects(spec):
        yield to_record(record, where, spec)


def read_objects(spec: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(where, the JSON object) of every record of the spec's files, in order."""
    for path in jsonl_files(spec):
        for number, line in _lines(path):
            if not line.strip():
                continue
            where = f"{path} line {number}"
            try:
                record = json.loads(line)
            except ValueError as exc:
                raise UserError(
                    f"{where} is not JSON ({exc}); fix the line (one JSON object per line)"
                ) from None
            if not isinstance(record, dict):
                raise UserError(
                    f"{where} is a JSON {type(record).__name__}, not an object; one object per line"
                )
            yield where, record


def to_record(record: dict[str, Any], where: str, spec: dict[str, Any]) -> Record:
    """One record's parts: its text (counted), or its prompt (context) and its completion (counted), or
    its conversation's spans (the assistant's counted)."""
    fields = fields_of(spec)
    for name in fields.columns:
        if name not in record:
            found = ", ".join(sorted(map(str, record))[:10]) or "none"
            raise UserError(
                f"{where} has no field {name!r} (its fields: {found}); fix the record, or name the "
                "field with text_field, prompt_field and completion_field, or messages_field"
            )
    if fields.messages:
        template = chat_template(spec["tokenizer"])
        return Record(where, chat_parts(record[fields.messages], where, fields.messages, template))
    values = []
    for name in fields.columns:
        if not isinstance(record[name], str):
            kind = "null" if record[name] is None else type(record[name]).__name__
            raise UserError(f"{where}: field {name!r} is a JSON {kind}, not a string; fix the record")
        values.append(record[name])
    if fields.text:
        return Record(where, ((values[0], True),))
    return Record(where, ((values[0], False), (values[1], True)))


class Packed(NamedTuple):
    blocks: np.ndarray  # (num_blocks, block_size + 1) token ids
    mask: np.ndarray | None  # (num_blocks, block_size) uint8, 1 where the next token counts; None: all
    num_tokens: int  # tokens of the stream (the tail that fills no block included)
    loss_tokens: int  # of those, the ones that count
    records: int
    blocks_without_loss: int
    vocab_size: int
    bytes_per_token: float | None  # of the counted text; None for the byte tokenizer (1 by definition)


def pack_records(spec: dict[str, Any], records: Iterable[Record] | None = None) -> Packed:
    """The records' tokens and loss mask, joined by the separator's tokens (which count after a counted
    part: a completion's end is learned) and cut into blocks of block_size + 1. ``records``: the spec's
    JSON Lines records unless given (another source's, e.g. a datasets folder's rows)."""
    ref = spec["tokenizer"]
    if ref is None:
        vocab_size = VOCAB_SIZE

        def tokenize(data: bytes, what: str) -> np.ndarray:
            return np.frombuffer(data, dtype=np.uint8).astype(np.int64)
    else:
        tokenizer, vocab_size = load_tokenizer(spec)
        spec = {**spec, "vocab_size": vocab_size}

        def tokenize(data: bytes, what: str) -> np.ndarray:
            return token_ids(tokenizer, data, what, spec)

    separator = tokenize(b"\n", "the record separator b'\\n'")
    ids: list[np.ndarray] = []
    counts: list[np.ndarray] = []
    num_records = counted_bytes = counted_tokens = 0
    limit = spec.get("max_tokens")
    total = 0
    for record in read_records(spec) if records is None else records:
        if limit is not None and total >= limit:
            break
        for text, counted in record.parts:
            data = text.encode("utf-8")
            part = tokenize(data, record.where)
            if counted and len(record.parts) > 1 and not len(part):
                raise UserError(
                    f"{record.where}: the completion is empty after tokenization; a prompt needs a "
                    "completion to learn from: fix or drop the record"
                )
            ids.append(part)
            counts.append(np.full(len(part), counted, dtype=np.uint8))
            if counted:
                counted_bytes += len(data)
                counted_tokens += len(part)
        last_counts = record.parts[-1][1]
        ids.append(separator)
        counts.append(np.full(len(separator), last_counts, dtype=np.uint8))
        if last_counts:
            counted_bytes += 1
            counted_tokens += len(separator)
        total += sum(len(piece) for piece in ids[-len(record.parts) - 1 :])
        num_records += 1
    if not num_records:
        where = f"the files of 'paths' {spec['paths']}" if "paths" in spec else spec["path"]
        raise UserError(f"{where} hold no record; add records or fix the dataset's spec")
    stream = np.concatenate(ids)[:limit]
    flags = np.concatenate(counts)[:limit]
    row = spec["block_size"] + 1
    num_blocks = len(stream) // row
    blocks = stream[: num_blocks * row].reshape(num_blocks, row)
    # The mask of a block's targets: whether tokens 1..block_size (the next tokens) count.
    mask = flags[: num_blocks * row].reshape(num_blocks, row)[:, 1:]
    keep = mask.any(axis=1)
    blocks, mask = blocks[keep], np.ascontiguousarray(mask[keep])
    if len(blocks) < 3:
        raise UserError(
            f"the records give {len(stream)} tokens, {len(blocks)} block(s) of block_size + 1 = {row} with a "
            "token that counts; a train/val/test split needs at least 3: add records or lower block_size"
        )
    every = bool(mask.all())
    return Packed(
        blocks.astype(token_dtype(vocab_size)),
        None if every else mask,
        len(stream),
        int(mask.sum()),
        num_records,
        int((~keep).sum()),
        vocab_size,
        None if ref is None else counted_bytes / max(counted_tokens, 1),
    )
