"""Chat records (``messages_field`` of the jsonl and hf_disk sources): a conversation, a list of
``{"role": ..., "content": ...}`` messages (TRL's conversational format; roles system, user and
assistant), rendered with the chat template of the ``tokenizer: hf:DIR`` folder (``chat_template.jinja``,
else the ``chat_template`` of ``tokenizer_config.json``: :mod:`shardfuse.data.sources.hf_tokenizer`) as
transformers' ``apply_chat_template`` renders it: jinja2's sandbox (``trim_blocks``, ``lstrip_blocks``,
``raise_exception``, a ``tojson`` that does not escape HTML), with ``messages``, ``add_generation_prompt``
false, and the folder's ``bos_token`` and ``eos_token``.

Only the assistant turns count in the loss. Each message's text is found by rendering prefixes: message
i's span is render(messages[:i+1]) less render(messages[:i]) (a template that renders earlier messages
differently once later ones follow, e.g. one that drops past reasoning, is refused naming the record).
Of an assistant span, the header the generation prompt adds (render(messages[:i], add_generation_prompt)
less render(messages[:i]), e.g. ``<|im_start|>assistant\\n``) is context where the template has one: what
counts is what the model generates after it, the content and the turn's end. Rendering prefixes costs a
render per message (quadratic in a conversation's length; conversations are short). A template's
``{% generation %}`` marks (TRL's assistant masks) render their body and are otherwise not needed.

No command line; a library module used by :mod:`shardfuse.data.sources.jsonl`. By hand::

    python -c "from shardfuse.data.sources.chat import chat_parts, chat_template
    template = chat_template('hf:pretrained/gpt2-stdlib')
    messages = [{'role': 'user', 'content': 'hi'}, {'role': 'assistant', 'content': 'hello'}]
    print(chat_parts(messages, 'by hand', 'messages', template))"
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import lru_cache
from pathlib import Path
from typing import Any, NamedTuple

import jinja2
from jinja2.ext import Extension, loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from shardfuse.data.sources.checks import SPEC_FIX
from shardfuse.data.sources.hf_tokenizer import (
    CONFIG_FILE,
    PREFIX,
    TEMPLATE_FILE,
    chat_problem,
    chat_template_source,
)
from shardfuse.io import UserError, error_reason

ROLES = ("system", "user", "assistant")
COUNTED_ROLE = "assistant"


class ChatTemplate(NamedTuple):
    ref: str  # the tokenizer, "hf:DIR", for errors
    render: Callable[..., str]  # (messages, add_generation_prompt) -> the rendered text


def check_chat(spec: dict[str, Any]) -> None:
    """A chat spec's tokenizer is an ``hf:DIR`` folder with a chat template that compiles."""
    if problem := chat_problem(spec):
        raise UserError(f"{problem[1]}; {SPEC_FIX}" if problem[0] == "messages_field" else problem[1])
    chat_template(spec["tokenizer"])


def chat_template(ref: str) -> ChatTemplate:
    """The compiled chat template of tokenizer ``hf:DIR`` (compiled again only when its files change)."""
    folder = Path(ref[len(PREFIX) :])
    return _compiled(ref, _stamp(folder / TEMPLATE_FILE), _stamp(folder / CONFIG_FILE))


def _stamp(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except OSError:
        return None
    return stat.st_mtime_ns, stat.st_size


@lru_cache(maxsize=8)
def _compiled(ref: str, *stamps: tuple[int, int] | None) -> ChatTemplate:
    source, where, config = chat_template_source(ref)
    try:
        template = _environment().from_string(source)
    except jinja2.TemplateError as exc:
        raise UserError(
            f"tokenizer {ref!r}: the chat template in {where} does not compile ({error_reason(exc)}); fix "
            "the template"
        ) from None
    tokens = {key: _token(config, key) for key in ("bos_token", "eos_token")}

    def render(messages: list[dict[str, Any]], add_generation_prompt: bool = False) -> str:
        return template.render(messages=messages, add_generation_prompt=add_generation_prompt, **tokens)

    return ChatTemplate(ref, render)


def _token(config: Any, key: str) -> str:
    """A special token of tokenizer_config.json: a string, or an AddedToken's ``content``."""
    value = config.get(key) if isinstance(config, dict) else None
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else ""


class _Generation(Extension):
    """``{% generation %}…{% endgeneration %}`` renders its body (spans are found by prefixes here)."""

    tags = frozenset({"generation"})

    def parse(self, parser):
        next(parser.stream)
        return parser.parse_statements(("name:endgeneration",), drop_needle=True)


def _raise_exception(message: str) -> None:
    raise jinja2.TemplateError(message)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None, **keys: Any) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, **keys)


def _environment() -> ImmutableSandboxedEnvironment:
    """The sandbox transformers renders chat templates in (a template is untrusted code). No
    ``strftime_now``: a template then falls back to its fixed date, so the tokens do not change by the day."""
    environment = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols]
    )
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    return environment


def checked_messages(value: Any, where: str, field: str) -> list[dict[str, Any]]:
    """A record's conversation: a list of messages with string roles (system, user, assistant) and
    contents, with an assistant turn and no empty one; UserError naming the record otherwise."""
    if not isinstance(value, list) or not value:
        kind = "empty list" if value == [] else "null" if value is None else type(value).__name__
        raise UserError(
            f"{where}: field {field!r} is a JSON {kind}, not a list of messages "
            '({"role": ..., "content": ...}); fix the record'
        )
    for number, message in enumerate(value, start=1):
        if not (
            isinstance(message, dict) and all(isinstance(message.get(k), str) for k in ("role", "content"))
        ):
            raise UserError(
                f"{where}: message {number} of field {field!r} is not an object with a string 'role' and "
                "'content'; fix the record"
            )
        if message["role"] not in ROLES:
            raise UserError(
                f"{where}: message {number} has role {message['role']!r}; the roles are "
                f"{', '.join(ROLES)}: fix the record"
            )
        if message["role"] == COUNTED_ROLE and not message["content"].strip():
            raise UserError(
                f"{where}: assistant message {number} is empty; an assistant turn needs content to learn "
                "from: fix or drop the record"
            )
    if not any(message["role"] == COUNTED_ROLE for message in value):
        raise UserError(
            f"{where}: the conversation has no assistant message, so none of its tokens would count; add "
            "an assistant turn or drop the record"
        )
    return value


def _render(template: ChatTemplate, messages: list, where: str) -> str:
    try:
        return template.render(messages, False)
    except Exception as exc:  # a template is user code: any failure is the user's to fix
        raise UserError(
            f"{where}: the chat template of tokenizer {template.ref!r} fails on the conversation "
            f"({type(exc).__name__}: {error_reason(exc)}); fix the record or the template"
        ) from None


def _start(template: ChatTemplate) -> str:
    """What the template renders before any message (a BOS token, say); "" if it needs a message."""
    try:
        return template.render([], False)
    except Exception:  # e.g. a template reading messages[0]: the first message's span holds its start
        return ""


def _header(template: ChatTemplate, before: list, rendered: str, span: str) -> str:
    """The start of an assistant span the generation prompt adds to the conversation before it; "" if
    the template adds none, fails on the conversation before it, or its prompt does not start the span."""
    try:
        prompt = template.render(before, True)
    except Exception:
        return ""
    header = prompt[len(rendered) :] if prompt.startswith(rendered) else ""
    return header if span.startswith(header) else ""


def chat_parts(value: Any, where: str, field: str, template: ChatTemplate) -> tuple[tuple[str, bool], ...]:
    """A conversation's rendered text as (text, counts in the loss) parts: each message's span, context
    but for an assistant's content and turn end."""
    messages = checked_messages(value, where, field)
    rendered = _start(template)
    parts = [(rendered, False)]
    for number, message in enumerate(messages, start=1):
        text = _render(template, messages[:number], where)
        if not text.startswith(rendered):
            raise UserError(
                f"{where}: the chat template of tokenizer {template.ref!r} renders messages 1..{number - 1} "
                f"differently once message {number} follows (it is not prefix-stable), so the assistant "
                "turns cannot be told apart; use a template that renders a conversation's start the same, "
                "or prompt_field and completion_field"
            )
        span = text[len(rendered) :]
        if message["role"] == COUNTED_ROLE:
            header = _header(template, messages[: number - 1], rendered, span)
            parts += [(header, False), (span[len(header) :], True)]
        else:
            parts.append((span, False))
        rendered = text
    return tuple((text, counts) for text, counts in parts if text or counts)
