"""The hf_disk source (shardfuse/data/sources/hf_disk.py) on folders written by the real `datasets`
package's save_to_disk: the same records (prompt/completion, or chat) as a JSON Lines file give the same
split files and shards, byte for byte; a DatasetDict's split is chosen by `split`; a ClassLabel column
keeps its class names; a wrong folder, split or column is one line."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.data.sources.dataset import prepare
from shardfuse.data.sources.files import hf_disk_files
from shardfuse.io import UserError
from tests.support.chat import CONVERSATION, write_chat_tokenizer
from tests.support.helpers import call_stage

datasets = pytest.importorskip("datasets", reason="the dev extra installs datasets (make venv)")

SFT = {"prompt_field": "prompt", "completion_field": "completion", "block_size": 16}


def records(count: int = 80) -> list[dict]:
    return [
        {"prompt": f"What is {i} + {i}? ", "completion": f"It is {2 * i}.", "id": i} for i in range(count)
    ]


def conversations(count: int = 40) -> list[dict]:
    """Chat records: CONVERSATION with numbered contents, every other one cut to a user and an assistant
    turn."""
    rows = []
    for i in range(count):
        messages = [{**message, "content": f"{message['content']} {i}"} for message in CONVERSATION]
        rows.append({"messages": messages if i % 2 == 0 else messages[1:3], "id": i})
    return rows


@pytest.mark.parametrize("kind", ["prompt_completion", "chat"])
def test_the_same_records_as_jsonl_and_as_a_datasets_folder_give_the_same_splits_and_shards(tmp_path, kind):
    rows, keys = records(), SFT
    if kind == "chat":
        rows = conversations()
        keys = {
            "messages_field": "messages",
            "block_size": 16,
            "tokenizer": write_chat_tokenizer(tmp_path / "tok"),
        }
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(row) + "\n" for row in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "pairs_hf"))
    from_jsonl, from_hf = tmp_path / "a", tmp_path / "b"
    prepare("pairs", {"source": "jsonl", "paths": [str(tmp_path / "pairs.jsonl")], **keys}, from_jsonl)
    prepare(
        "pairs",
        {"source": "hf_disk", "path": str(tmp_path / "pairs_hf"), "task": "causal_lm", **keys},
        from_hf,
    )
    for split in ("train", "val", "test"):
        assert (from_jsonl / f"{split}.parquet").read_bytes() == (from_hf / f"{split}.parquet").read_bytes()
    assert "loss_mask" in pq.read_schema(from_hf / "train.parquet").names
    for prepared in (from_jsonl, from_hf):
        out = prepared / "shards"
        proc = call_stage(
            "partition",
            "--input",
            prepared / "train.parquet",
            "--world-size",
            2,
            "--seed",
            0,
            "--out-dir",
            out,
        )
        assert proc.returncode == 0, proc.stderr
    for rank in (0, 1):
        name = f"shard-{rank}.parquet"
        assert (from_jsonl / "shards" / name).read_bytes() == (from_hf / "shards" / name).read_bytes()


def test_a_datasetdict_split_is_chosen_by_split_and_a_missing_one_lists_the_splits(tmp_path):
    folder = tmp_path / "dict"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(records(60)), "test": datasets.Dataset.from_list(records(5))}
    ).save_to_disk(str(folder))
    spec = {"source": "hf_disk", "path": str(folder), "task": "causal_lm", **SFT}
    info = prepare("d", {**spec, "split": "train"}, tmp_path / "out")
    assert info["records"] == 60
    assert any(path.endswith(".arrow") for path in hf_disk_files({**spec, "split": "train"}))
    with pytest.raises(UserError) as error:
        prepare("d", spec, tmp_path / "never")
    assert "is a DatasetDict of splits" in str(error.value)
    assert str(error.value).endswith("and the spec names no split; set split: to one of them")
    assert not (tmp_path / "never").exists()


def test_a_classlabel_column_keeps_its_class_names(tmp_path):
    from sklearn.datasets import load_breast_cancer

    cancer = load_breast_cancer()
    features = datasets.Features(
        {
            **{f"f{j}": datasets.Value("float32") for j in range(4)},
            "diagnosis": datasets.ClassLabel(names=[str(name) for name in cancer.target_names]),
        }
    )
    data = {f"f{j}": cancer.data[:, j].astype(np.float32) for j in range(4)}
    data["diagnosis"] = cancer.target
    datasets.Dataset.from_dict(data, features=features).save_to_disk(str(tmp_path / "cancer"))
    spec = {
        "source": "hf_disk",
        "path": str(tmp_path / "cancer"),
        "feature_columns": [f"f{j}" for j in range(4)],
        "label_column": "diagnosis",
    }
    info = prepare("cancer", spec, tmp_path / "out")
    assert info["label_names"] == ["benign", "malignant"]  # not "0", "1"; sorted, as every source's
    labels = np.concatenate(
        [
            pq.read_table(tmp_path / "out" / f"{s}.parquet").column("label").to_numpy()
            for s in ("train", "val", "test")
        ]
    )
    # cancer.target: 0 = malignant, 1 = benign; sorted names make benign 0: the counts swap accordingly.
    assert np.bincount(labels).tolist() == [int((cancer.target == 1).sum()), int((cancer.target == 0).sum())]


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (
            {"path": "nowhere"},
            "nowhere does not exist, so it is not a datasets folder; point 'path' at a folder",
        ),
        ({"prompt_field": "question", "completion_field": "completion"}, "column(s) 'question' not found in"),
        ({"split": "test"}, "holds split None"),
    ],
)
def test_a_wrong_folder_or_column_is_one_line(tmp_path, spec, message):
    datasets.Dataset.from_list(records(20)).save_to_disk(str(tmp_path / "one"))
    full = {"source": "hf_disk", "path": str(tmp_path / "one"), "task": "causal_lm", **SFT, **spec}
    if "split" in spec:  # a Dataset folder with no split recorded takes any split name: nothing to refuse
        assert prepare("x", full, tmp_path / "out")["records"] == 20
        return
    with pytest.raises(UserError) as error:
        prepare("x", full, tmp_path / "out")
    assert message in str(error.value)
