"""The jsonl source (shardfuse/data/sources/jsonl.py): records packed into token blocks with the loss
mask of supervised fine-tuning, gzip read as plain, one-line errors naming the file and line; chat
records (shardfuse/data/sources/chat.py) rendered with the tokenizer folder's template, the assistant
turns alone counting, a folder without a template refused before any job; the text source's refusal of
JSON files; and the causal_lm task's completion-only loss against a hand-computed masked loss."""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch

from shardfuse.data.reader import load_table
from shardfuse.data.sources.dataset import prepare as prepare_dataset
from shardfuse.data.sources.files import text_files_of
from shardfuse.data.sources.jsonl import pack_records
from shardfuse.data.sources.spec import validate_spec
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError
from shardfuse.models.causal_lm import IGNORED, CausalLM
from shardfuse.models.task import Totals
from tests.support.chat import CHATML, CONVERSATION, write_chat_tokenizer

SFT = {"prompt_field": "prompt", "completion_field": "completion"}
CHAT = {"messages_field": "messages"}


def write_jsonl(path, records) -> str:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return str(path)


def spec_of(paths, **keys) -> dict:
    return validate_spec({"source": "jsonl", "paths": paths, "block_size": 4, **keys})


def test_prompt_tokens_are_context_and_completion_tokens_with_their_separator_count(tmp_path):
    records = [{"prompt": "ab", "completion": "cd"}, {"prompt": "e", "completion": "fg"}] * 3
    path = write_jsonl(tmp_path / "pairs.jsonl", records)
    packed = pack_records(spec_of([path], **SFT))
    stream = b"abcd\nefg\n" * 3  # 27 bytes: five blocks of 4 + 1
    flags = [0, 0, 1, 1, 1, 0, 1, 1, 1] * 3
    expected = np.frombuffer(stream[:25], dtype=np.uint8).reshape(5, 5)
    expected_mask = np.asarray(flags[:25], dtype=np.uint8).reshape(5, 5)[:, 1:]
    assert np.array_equal(packed.blocks, expected)
    assert np.array_equal(packed.mask, expected_mask)
    assert (packed.num_tokens, packed.records, packed.blocks_without_loss) == (27, 6, 0)
    assert packed.loss_tokens == int(expected_mask.sum())


def test_a_block_of_prompt_only_is_left_out_and_counted(tmp_path):
    records = [{"prompt": "p" * 12, "completion": "c"}] * 4
    packed = pack_records(spec_of([write_jsonl(tmp_path / "long.jsonl", records)], **SFT))
    assert packed.blocks_without_loss > 0
    assert packed.mask.any(axis=1).all() and len(packed.blocks) == len(packed.mask)


def test_text_records_count_every_token_and_carry_no_mask(tmp_path):
    path = write_jsonl(tmp_path / "t.jsonl", [{"text": "hello world"}, {"text": "again and again"}])
    packed = pack_records(spec_of([path]))
    assert packed.mask is None
    assert bytes(packed.blocks.astype(np.uint8).reshape(-1)) == b"hello world\nagain and again\n"[:25]


def test_a_gzipped_file_gives_the_same_blocks(tmp_path):
    records = [{"prompt": f"q{i}", "completion": f"answer {i}"} for i in range(20)]
    plain = write_jsonl(tmp_path / "a.jsonl", records)
    packed = tmp_path / "b.jsonl.gz"
    with gzip.open(packed, "wt") as file:
        file.write((tmp_path / "a.jsonl").read_text())
    one, two = pack_records(spec_of([plain], **SFT)), pack_records(spec_of([str(packed)], **SFT))
    assert np.array_equal(one.blocks, two.blocks) and np.array_equal(one.mask, two.mask)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("{not json}", "bad.jsonl line 2 is not JSON"),
        ('["a list"]', "bad.jsonl line 2 is a JSON list, not an object"),
        ('{"prompt": "x"}', "line 2 has no field 'completion' (its fields: prompt)"),
        ('{"prompt": "x", "completion": 3}', "line 2: field 'completion' is a JSON int, not a string"),
        (
            '{"prompt": "x", "completion": ""}',
            "line 2: the completion is empty after tokenization; a prompt needs a completion to learn "
            "from: fix or drop the record",
        ),
    ],
)
def test_a_bad_line_is_one_error_naming_its_file_and_line(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "a", "completion": "b"}\n' + line + "\n")
    with pytest.raises(UserError) as error:
        pack_records(spec_of([str(path)], **SFT))
    assert str(error.value).startswith(str(path)) and message in str(error.value)
    if "not JSON" in message:
        assert str(error.value).endswith("fix the line (one JSON object per line)")


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"prompt_field": "prompt"}, "spec key 'prompt_field' needs 'completion_field'"),
        (
            {**SFT, "text_field": "text"},
            "'text_field' and 'prompt_field'/'completion_field' exclude each other",
        ),
        ({"prompt_field": "x", "completion_field": "x"}, "both name 'x'"),
        ({**CHAT, "text_field": "text"}, "spec key 'messages_field' excludes 'text_field'"),
        (CHAT, "spec key 'messages_field' needs tokenizer: hf:DIR"),
    ],
)
def test_field_keys_that_do_not_fit_are_refused(tmp_path, keys, message):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    with pytest.raises(UserError, match=message):
        spec_of([path], **keys)


def chat_spec(tmp_path, conversations, tokenizer=None, **keys) -> dict:
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": messages} for messages in conversations])
    tokenizer = tokenizer or write_chat_tokenizer(tmp_path / "tokenizer")
    return spec_of([path], **CHAT, tokenizer=tokenizer, **keys)


# CHATML with TRL's {% generation %} marks around the assistant's content and turn end.
MARKED_CHATML = (
    "{% for message in messages %}{% if message['role'] == 'assistant' %}{{ '<|im_start|>assistant\\n' }}"
    "{% generation %}{{ message['content'] + '<|im_end|>' + '\\n' }}{% endgeneration %}{% else %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


@pytest.mark.parametrize(
    ("template", "in_config"),
    [(CHATML, True), (CHATML, False), (MARKED_CHATML, True)],
    ids=["tokenizer_config.json", "chat_template.jinja", "generation_marks"],
)
def test_a_chat_record_counts_its_assistant_turns_alone(tmp_path, template, in_config):
    tokenizer = write_chat_tokenizer(tmp_path / "tok", template, in_config=in_config)
    # One token a character, one each for <|im_start|> and <|im_end|>; the record is 70 tokens:
    # <|im_start|>system\nbe brief<|im_end|>\n   1 + 7 + 8 + 1 + 1 = 18   context
    # <|im_start|>user\nhi<|im_end|>\n            1 + 5 + 2 + 1 + 1 = 10   context
    # <|im_start|>assistant\n                     1 + 10 = 11              context (the generation prompt)
    # yo<|im_end|>\n                              2 + 1 + 1 = 4            counts
    # <|im_start|>user\nwhy<|im_end|>\n           1 + 5 + 3 + 1 + 1 = 11   context
    # <|im_start|>assistant\n                     11                       context
    # no<|im_end|>\n and the record separator \n  2 + 1 + 1 + 1 = 5        counts
    flags = [0] * 39 + [1] * 4 + [0] * 22 + [1] * 5
    packed = pack_records(chat_spec(tmp_path, [CONVERSATION] * 3, tokenizer, block_size=69))
    rendered = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in CONVERSATION) + "\n"
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(tmp_path / "tok" / "tokenizer.json")).encode(rendered).ids
    assert len(ids) == len(flags) == 70
    assert packed.blocks.tolist() == [ids] * 3
    assert packed.mask.tolist() == [flags[1:]] * 3
    assert (packed.records, packed.loss_tokens, packed.blocks_without_loss) == (3, 27, 0)


def test_a_tokenizer_without_a_chat_template_is_refused_before_any_job(tmp_path):
    tokenizer = write_chat_tokenizer(tmp_path / "plain", template=None)
    message = (
        f"tokenizer '{tokenizer}' has no chat template (no {tmp_path / 'plain' / 'chat_template.jinja'}, "
        f"no chat_template in {tmp_path / 'plain' / 'tokenizer_config.json'}); add a chat_template to"
    )
    with pytest.raises(UserError) as error:
        chat_spec(tmp_path, [CONVERSATION] * 3, tokenizer)
    assert str(error.value).startswith(message)
    assert str(error.value).endswith("or use prompt_field and completion_field")
    path = write_jsonl(tmp_path / "chat.jsonl", [{"messages": CONVERSATION}] * 3)
    dataset = {"source": "jsonl", "paths": [path], "block_size": 8, **CHAT, "tokenizer": tokenizer}
    config = {"runs": {"r": {}}, "datasets": {"chat": dataset}, "run_defaults": {"dataset": "chat"}}
    with pytest.raises(ConfigError) as error:  # the config check: before Snakemake starts any job
        load_experiment(config, environ={})
    assert str(error.value).startswith(f"config error at datasets.chat.tokenizer: {message}")


def test_a_chat_datasets_template_files_are_prepare_inputs(tmp_path):
    spec = chat_spec(tmp_path, [CONVERSATION])
    listed = text_files_of(spec)
    assert listed[-2:] == [
        str(tmp_path / "tokenizer" / name) for name in ("tokenizer.json", "tokenizer_config.json")
    ]
    assert str(tmp_path / "tokenizer" / "tokenizer_config.json") not in text_files_of(
        {**spec, "messages_field": None}
    )


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ("hello", "line 2: field 'messages' is a JSON str, not a list of messages"),
        ([{"role": "user"}], "line 2: message 1 of field 'messages' is not an object with a string 'role'"),
        (
            [{"role": "tool", "content": "42"}, {"role": "assistant", "content": "ok"}],
            "line 2: message 1 has role 'tool'; the roles are system, user, assistant: fix the record",
        ),
        (
            CONVERSATION[:2],
            "line 2: the conversation has no assistant message, so none of its tokens would count",
        ),
        (
            [*CONVERSATION[:2], {"role": "assistant", "content": ""}],
            "line 2: assistant message 3 is empty; an assistant turn needs content to learn from: fix or "
            "drop the record",
        ),
    ],
)
def test_a_bad_conversation_is_one_error_naming_its_file_and_line(tmp_path, messages, message):
    spec = chat_spec(tmp_path, [CONVERSATION])
    path = tmp_path / "chat.jsonl"
    path.write_text(path.read_text() + json.dumps({"messages": messages}) + "\n")
    with pytest.raises(UserError) as error:
        pack_records(spec)
    assert str(error.value).startswith(f"{path} line 2") and message in str(error.value)


@pytest.mark.parametrize(
    ("template", "message"),
    [
        (
            "{% for m in messages %}{% if loop.last %}[{{ m.content }}]{% else %}{{ m.content }}{% endif %}"
            "{% endfor %}",
            "renders messages 1..1 differently once message 2 follows (it is not prefix-stable)",
        ),
        (
            "{% for m in messages %}{% if m.role == 'system' %}{{ raise_exception('no system, please') }}"
            "{% endif %}{{ m.content }}{% endfor %}",
            "fails on the conversation (TemplateError: no system, please); fix the record or the template",
        ),
    ],
)
def test_a_template_that_cannot_mark_the_turns_is_one_error_naming_the_record(tmp_path, template, message):
    tokenizer = write_chat_tokenizer(tmp_path / "tok", template)
    with pytest.raises(UserError) as error:
        pack_records(chat_spec(tmp_path, [CONVERSATION], tokenizer))
    assert str(error.value).startswith(f"{tmp_path / 'chat.jsonl'} line 1: the chat template of tokenizer")
    assert message in str(error.value)


def test_a_file_that_is_not_json_lines_is_refused_by_jsonl_and_a_json_file_by_text(tmp_path):
    (tmp_path / "notes.txt").write_text("plain text\n" * 50)
    with pytest.raises(UserError) as error:
        pack_records(spec_of([str(tmp_path / "notes.txt")]))
    assert "notes.txt is not a JSON Lines file (.jsonl or .jsonl.gz)" in str(error.value)
    assert str(error.value).endswith("or use source: text for plain text")
    write_jsonl(tmp_path / "data.jsonl", [{"text": "x" * 40}] * 10)
    with pytest.raises(UserError) as error:
        prepare_dataset(
            "t", {"source": "text", "paths": [str(tmp_path / "*")], "block_size": 8}, tmp_path / "out"
        )
    assert "data.jsonl is JSON, which source: text would read as raw text" in str(error.value)
    assert "use source: jsonl" in str(error.value)
    assert not (tmp_path / "out").exists()


def test_prepared_splits_carry_the_mask_and_the_reader_gives_it_as_the_targets(tmp_path):
    records = [{"prompt": f"question {i}?", "completion": f" answer {i * 7}."} for i in range(60)]
    path = write_jsonl(tmp_path / "qa.jsonl", records)
    out = tmp_path / "prepared"
    prepare_dataset("qa", {"source": "jsonl", "paths": [path], "block_size": 16, **SFT}, out)
    info = json.loads((out / "dataset.json").read_text())
    assert info["records"] == 60 and 0 < info["loss_tokens"] < info["num_tokens"]
    table = pq.read_table(out / "train.parquet")
    assert table.schema.field("loss_mask").type.list_size == 16
    tokens, mask = load_table(out / "train.parquet")
    assert tokens.shape == (len(table), 17) and mask.shape == (len(table), 16) and mask.dtype == torch.uint8
    assert np.array_equal(mask.numpy(), np.stack(table.column("loss_mask").to_numpy(zero_copy_only=False)))


def test_completion_only_loss_equals_a_hand_computed_masked_loss():
    torch.manual_seed(0)
    vocab, rows, block = 11, 3, 6
    tokens = torch.randint(0, vocab, (rows, block + 1))
    mask = torch.tensor([[0, 0, 1, 1, 1, 0], [1, 1, 1, 1, 1, 1], [0, 0, 0, 0, 0, 1]], dtype=torch.uint8)
    task = CausalLM()
    inputs, targets = task.batch(tokens, mask)
    assert torch.equal(inputs, tokens[:, :-1])
    assert torch.equal(targets == IGNORED, mask == 0)
    logits = torch.randn(rows, block, vocab)
    by_hand = [
        -torch.log_softmax(logits[r, t], dim=-1)[tokens[r, t + 1]].item()
        for r in range(rows)
        for t in range(block)
        if mask[r, t]
    ]
    assert math.isclose(task.loss(logits, targets).item(), sum(by_hand) / len(by_hand), rel_tol=1e-6)
    totals = Totals()
    task.accumulate(totals, logits, targets)
    assert totals.rows == len(by_hand) == int(mask.sum())
    assert math.isclose(task.finish(totals)["loss"], sum(by_hand) / len(by_hand), rel_tol=1e-6)


def test_without_a_mask_every_next_token_counts_as_before():
    torch.manual_seed(1)
    tokens = torch.randint(0, 7, (2, 5))
    task = CausalLM()
    _, targets = task.batch(tokens, torch.empty(2, 0))
    assert torch.equal(targets, tokens[:, 1:])
    logits = torch.randn(2, 4, 7)
    expected = torch.nn.functional.cross_entropy(logits.reshape(-1, 7), tokens[:, 1:].reshape(-1))
    assert torch.equal(task.loss(logits, targets), expected)
