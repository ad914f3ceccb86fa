"""Text classification from JSON Lines (shardfuse/data/sources/text_labels.py, the jsonl source with
task: classification): one row of block_size token ids per record (its first tokens, padded after its
last with the pad id), the labels coded in sorted order; bad records one line naming file and line; the
keys of the other task refused before any job. The sequence classifier: tests/unit/models; the logged
model: tests/stages/test_mlflow_model.py."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.data.sources.dataset import prepare
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError

TEXTS = ["def f(): pass", "import os", "x = 1", "print('hi')", "a long line of text " * 4, "y"]


def write(path: Path, records: list) -> Path:
    path.write_text("".join(json.dumps(record) + "\n" for record in records))
    return path


def spec(path: Path, **keys) -> dict:
    return {"source": "jsonl", "task": "classification", "paths": [str(path)], "label_field": "kind",
            "block_size": 16, **keys}  # fmt: skip


def test_each_record_is_one_row_of_its_first_tokens_padded_and_its_label_coded_in_sorted_order(tmp_path):
    records = [{"text": text, "kind": "code" if i % 2 == 0 else "prose"} for i, text in enumerate(TEXTS * 3)]
    info = prepare("kinds", spec(write(tmp_path / "r.jsonl", records)), tmp_path / "out")
    assert info["label_names"] == ["code", "prose"] and info["num_classes"] == 2
    assert (info["vocab_size"], info["pad_id"], info["block_size"]) == (257, 256, 16)
    assert info["input"] == {"kind": "tokens", "shape": [16], "dtype": "uint16"}
    assert info["records"] == 18 and info["truncated_records"] == 3  # the long line, thrice
    assert info["num_tokens"] == sum(min(len(t.encode()), 16) for t in TEXTS * 3)
    rows = {}
    for split in ("train", "val", "test"):
        table = pq.read_table(tmp_path / "out" / f"{split}.parquet")
        pairs = zip(table.column("tokens").to_pylist(), table.column("label").to_pylist(), strict=True)
        for tokens, label in pairs:
            rows.setdefault(bytes(t for t in tokens if t != 256), set()).add(label)
    for i, text in enumerate(TEXTS):  # bytes by hand: the head of each text, the rest padding
        assert rows[text.encode()[:16]] == {0 if i % 2 == 0 else 1}
    table = pq.read_table(tmp_path / "out" / "train.parquet")
    padded = np.array(table.column("tokens").to_pylist())
    assert ((padded == 256).cumsum(axis=1) > 0).sum() == (padded == 256).sum()  # padding only at the end


def test_integer_labels_and_an_hf_tokenizer_pad_with_its_end_of_text_token(tmp_path):
    from tests.support.chat import write_chat_tokenizer

    ref = write_chat_tokenizer(tmp_path / "tok")
    folder = Path(ref.removeprefix("hf:"))
    records = [{"text": text, "kind": i % 3 * 10} for i, text in enumerate(TEXTS * 2)]
    keys = {"tokenizer": ref}
    info = prepare("kinds", spec(write(tmp_path / "r.jsonl", records), **keys), tmp_path / "out")
    assert info["label_names"] == ["0", "10", "20"]
    config = json.loads((folder / "tokenizer_config.json").read_text())
    vocabulary = json.loads((folder / "tokenizer.json").read_text())
    eos = {t["content"]: t["id"] for t in vocabulary["added_tokens"]}[config["eos_token"]]
    assert info["pad_id"] == eos and info["vocab_size"] == 1 + max(
        [*vocabulary["model"]["vocab"].values(), *(t["id"] for t in vocabulary["added_tokens"])]
    )


@pytest.mark.parametrize(
    ("records", "message"),
    [
        ([{"text": "a"}], "r.jsonl line 1 has no field 'kind' (its fields: text)"),
        ([{"text": "a", "kind": None}], "r.jsonl line 1: label field 'kind' is null; a label is a string"),
        ([{"text": "", "kind": "x"}], "r.jsonl line 1: the text is empty after tokenization"),
        ([{"text": 3, "kind": "x"}], "r.jsonl line 1: field 'text' is not a string"),
        ([{"text": "a", "kind": "x"}, {"text": "b", "kind": 1}] * 2, "'kind' holds both strings and numbers"),
        ([{"text": "a", "kind": "x"}] * 4, "label field 'kind' has a single value 'x'"),
    ],
)  # fmt: skip
def test_a_bad_record_is_one_line_naming_its_file_and_line(tmp_path, records, message):
    with pytest.raises(UserError) as error:
        prepare("kinds", spec(write(tmp_path / "r.jsonl", records)), tmp_path / "out")
    assert message in str(error.value)
    assert not (tmp_path / "out" / "train.parquet").exists()


def config(dataset: dict) -> dict:
    return {
        "datasets": {"d": dataset},
        "runs": {"r": {"dataset": "d", "strategy": "ddp", "model": "transformer"}},
        "run_defaults": {"world_size": 2},
    }


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"prompt_field": "p"}, "d.prompt_field: only causal_lm datasets use it but task is classification"),
        ({"task": "causal_lm"}, "d.label_field: only classification datasets use it but task is causal_lm"),
    ],
)  # fmt: skip
def test_the_keys_of_the_other_task_are_refused_before_any_job(tmp_path, keys, message):
    dataset = spec(tmp_path / "r.jsonl", **keys)
    with pytest.raises(ConfigError, match=re.escape(message)):
        load_experiment(config(dataset), environ={})


def test_an_hf_tokenizer_without_a_pad_or_end_of_text_token_is_one_line(tmp_path):
    from tests.support.chat import write_chat_tokenizer

    ref = write_chat_tokenizer(tmp_path / "tok")
    config_path = Path(ref.removeprefix("hf:")) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(
        json.dumps({k: v for k, v in config.items() if k not in ("eos_token", "pad_token")})
    )
    records = [{"text": text, "kind": i % 2} for i, text in enumerate(TEXTS)]
    with pytest.raises(
        UserError, match="has no pad or end-of-text token to pad text rows with; set pad_token"
    ):
        prepare("kinds", spec(write(tmp_path / "r.jsonl", records), tokenizer=ref), tmp_path / "out")
