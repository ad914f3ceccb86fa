"""A tokenizer folder for chat records, made locally with the ``tokenizers`` package (the extra
``shardfuse[hf]``; CI must have it, elsewhere a test needing it is skipped): every printable ASCII
character one token, ``<|im_start|>`` and ``<|im_end|>`` one token each, and a ChatML chat template, so a
test can count a conversation's tokens by hand."""

from __future__ import annotations

import json
import string
from pathlib import Path

from tests.support.helpers import missing_in_ci

CHATML = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
CONVERSATION = [
    {"role": "system", "content": "be brief"},
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "yo"},
    {"role": "user", "content": "why"},
    {"role": "assistant", "content": "no"},
]


def write_chat_tokenizer(folder: Path, template: str | None = CHATML, *, in_config: bool = True) -> str:
    """The folder as save_pretrained writes one (tokenizer.json, tokenizer_config.json), the template
    in tokenizer_config.json (``in_config``) or in chat_template.jinja (newer transformers), or none;
    returns the spec's ``tokenizer``, ``hf:folder``."""
    try:
        import tokenizers
    except ImportError:
        missing_in_ci("tokenizers is not installed; pip install 'shardfuse[hf]'")
    vocab = {char: index for index, char in enumerate(dict.fromkeys(string.printable))}
    tokenizer = tokenizers.Tokenizer(tokenizers.models.BPE(vocab=vocab, merges=[]))  # one token a character
    tokenizer.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(folder / "tokenizer.json"))
    config = {"bos_token": None, "eos_token": "<|im_end|>", "tokenizer_class": "PreTrainedTokenizerFast"}
    if template is not None and in_config:
        config["chat_template"] = template
    elif template is not None:
        (folder / "chat_template.jinja").write_text(template)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    return f"hf:{folder}"
