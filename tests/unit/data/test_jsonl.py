"""The jsonl source (shardfuse/data/sources/jsonl.py): records packed into token blocks with the loss
mask of supervised fine-tuning, gzip read as plain, one-line errors naming the file and line; the text
source's refusal of JSON files; and the causal_lm task's completion-only loss against a hand-computed
masked loss."""

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
from shardfuse.data.sources.jsonl import pack_records
from shardfuse.data.sources.spec import validate_spec
from shardfuse.io import UserError
from shardfuse.models.causal_lm import IGNORED, CausalLM
from shardfuse.models.task import Totals

SFT = {"prompt_field": "prompt", "completion_field": "completion"}


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
    ],
)
def test_field_keys_that_do_not_fit_are_refused(tmp_path, keys, message):
    path = write_jsonl(tmp_path / "a.jsonl", [{"text": "x"}])
    with pytest.raises(UserError, match=message):
        spec_of([path], **keys)


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
