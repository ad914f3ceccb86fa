"""The hf_disk source (shardfuse/data/sources/hf_disk.py) on folders written by the real `datasets`
package's save_to_disk: the same records (prompt/completion, or chat) as a JSON Lines file give the same
split files and shards, byte for byte; a DatasetDict's split is chosen by `split`; a ClassLabel column
keeps its class names; a wrong folder, split or column is one line. An Image column (scikit-learn's digits
as PNGs) gives the tensors image_folder gives for the same PNGs, bit for bit, decoded batch by batch; its
keys, a corrupt image and an image stored by path only are one line."""

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


# ---------------------------------------------------------------- an Image feature column

DIGIT_NAMES = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def digit_pngs(count: int) -> list[tuple[str, bytes]]:
    """(class name, PNG bytes) of scikit-learn's first ``count`` digits, 8x8 grayscale, sorted by class
    name (the order image_folder reads class folders in; stable, so file order within a class)."""
    import io

    from PIL import Image
    from sklearn.datasets import load_digits

    digits = load_digits()
    rows = []
    for pixels, target in zip(digits.images[:count], digits.target[:count], strict=True):
        buffer = io.BytesIO()
        Image.fromarray((pixels * 15).astype(np.uint8), mode="L").save(buffer, format="PNG")
        rows.append((DIGIT_NAMES[target], buffer.getvalue()))
    return sorted(rows, key=lambda row: row[0])


def save_images(folder, rows: list[tuple[str, bytes]], num_shards: int = 1, **columns) -> None:
    """A datasets folder of an Image column ``image`` and a ClassLabel column ``label`` (and ``columns``)."""
    features = {"image": datasets.Image(), "label": datasets.ClassLabel(names=DIGIT_NAMES)}
    features |= {name: datasets.Value("int64") for name in columns}
    data = {
        "image": [{"bytes": png, "path": None} for _, png in rows],
        "label": [DIGIT_NAMES.index(name) for name, _ in rows],
        **columns,
    }
    dataset = datasets.Dataset.from_dict(data, features=datasets.Features(features))
    dataset.save_to_disk(str(folder), num_shards=num_shards)


def image_spec(folder, **keys) -> dict:
    return {"source": "hf_disk", "path": str(folder), "feature_columns": ["image"], "label_column": "label",
            "image_size": [6, 5], **keys}  # fmt: skip


def replace_image(folder, row: int, image: dict | None) -> None:
    """Rewrite the folder's one Arrow stream file with row ``row``'s image replaced (as a hand-made or
    older datasets folder may hold it)."""
    import pyarrow as pa

    (path,) = folder.glob("*.arrow")
    with pa.OSFile(str(path)) as file:  # read into memory: the file is written over below
        table = pa.ipc.open_stream(file).read_all()
    images = table.column("image").to_pylist()
    images[row] = image
    column = pa.array(images, type=table.schema.field("image").type)
    table = table.set_column(table.schema.get_field_index("image"), table.schema.field("image"), column)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)


def split_tables(folder) -> list:
    return [pq.read_table(folder / f"{split}.parquet") for split in ("train", "val", "test")]


@pytest.mark.parametrize("mode", ["L", "RGB"])
def test_an_image_column_gives_the_tensors_image_folder_gives_for_the_same_pngs(tmp_path, mode):
    rows = digit_pngs(300)
    for index, (name, png) in enumerate(rows):
        (tmp_path / "folders" / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / "folders" / name / f"{index:04d}.png").write_bytes(png)
    save_images(tmp_path / "hf", rows, num_shards=2)
    keys = {"image_size": [6, 5], "mode": mode}
    from_folders = prepare("d", {"source": "image_folder", "path": str(tmp_path / "folders"), **keys},
                           tmp_path / "a")  # fmt: skip
    from_hf = prepare("d", image_spec(tmp_path / "hf", **keys), tmp_path / "b")
    assert from_hf["label_names"] == sorted(DIGIT_NAMES)  # the ClassLabel's names, not codes 0..9
    assert (
        from_hf["input"]
        == from_folders["input"]
        == {
            "kind": "tensor",
            "shape": [{"L": 1, "RGB": 3}[mode], 6, 5],
            "dtype": "float32",
        }
    )
    assert (from_hf["skipped_images"], from_hf["rows"]) == (0, from_folders["rows"])
    for hf_split, folder_split in zip(
        split_tables(tmp_path / "b"), split_tables(tmp_path / "a"), strict=True
    ):
        assert hf_split.column_names == ["x", "label"]
        assert hf_split.equals(folder_split)  # the same rows, labels and float32 pixels, bit for bit


def test_images_are_decoded_batch_by_batch_into_one_preallocated_tensor(tmp_path, monkeypatch):
    from shardfuse.data.sources import hf_disk

    save_images(tmp_path / "hf", digit_pngs(90), num_shards=3)
    calls = []

    def spy(sources, spec, out, where):
        calls.append((len(sources), out.base))
        return hf_disk_decode(sources, spec, out, where)

    hf_disk_decode = hf_disk.decode_images
    monkeypatch.setattr(hf_disk, "decode_images", spy)
    info = prepare("d", image_spec(tmp_path / "hf"), tmp_path / "out")
    assert sum(info["rows"].values()) == 90
    assert len(calls) >= 3 and max(count for count, _ in calls) <= 30  # one record batch at a time
    assert sum(count for count, _ in calls) == 90
    assert len({id(base) for _, base in calls}) == 1 and calls[0][1] is not None  # views of one array


def test_an_image_column_is_found_by_its_arrow_type_without_dataset_info(tmp_path):
    rows = digit_pngs(60)
    save_images(tmp_path / "hf", rows)
    (tmp_path / "hf" / "dataset_info.json").unlink()
    info = prepare("d", image_spec(tmp_path / "hf"), tmp_path / "out")
    assert info["input"]["shape"] == [1, 6, 5]
    assert info["label_names"] == [str(code) for code in sorted({DIGIT_NAMES.index(n) for n, _ in rows})]


@pytest.mark.parametrize(
    ("keys", "key", "message"),
    [
        (
            {"image_size": None},
            "image_size",
            "holds images (an Image feature), which are resized to image_size; add image_size: [height, "
            "width]",
        ),
        (
            {"feature_columns": ["image", "width"]},
            "feature_columns",
            "holds images (an Image feature), which are a dataset's only input; set feature_columns: [image]",
        ),
        (
            {"feature_columns": ["width"], "image_size": None, "mode": "RGB"},
            "mode",
            "spec key 'mode' is for an image column (an Image feature), and feature_columns of",
        ),
    ],
)
def test_image_keys_that_do_not_fit_the_columns_are_refused_before_any_job(tmp_path, keys, key, message):
    from shardfuse.experiment.load import load_experiment
    from shardfuse.experiment.schema import ConfigError

    rows = digit_pngs(40)
    save_images(tmp_path / "hf", rows, width=[8] * len(rows))
    spec = {k: v for k, v in {**image_spec(tmp_path / "hf"), **keys}.items() if v is not None}
    with pytest.raises(UserError) as error:
        prepare("d", spec, tmp_path / "out")
    assert message in str(error.value) and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()
    config = {"runs": {"r": {}}, "datasets": {"imgs": spec}, "run_defaults": {"dataset": "imgs"}}
    with pytest.raises(ConfigError) as error:  # the config check: before Snakemake starts any job
        load_experiment(config, environ={})
    assert str(error.value).startswith(f"config error at datasets.imgs.{key}: ")
    assert message in str(error.value)


def test_a_corrupt_image_is_an_error_unless_skipped_and_counted(tmp_path):
    rows = digit_pngs(50)
    save_images(tmp_path / "hf", rows)
    replace_image(tmp_path / "hf", 6, {"bytes": b"\x89PNG but not really", "path": None})
    where = tmp_path / "hf"
    bad = f"cannot read image {where} row 7 (column 'image') (cannot identify image file); fix or remove"
    with pytest.raises(UserError) as error:
        prepare("d", image_spec(tmp_path / "hf"), tmp_path / "out")
    assert str(error.value).startswith(bad)
    assert str(error.value).endswith("fix or remove it, or set on_bad_image: skip")
    info = prepare("d", image_spec(tmp_path / "hf", on_bad_image="skip"), tmp_path / "out")
    assert (info["skipped_images"], sum(info["rows"].values())) == (1, 49)
    labels = np.concatenate([table.column("label").to_numpy() for table in split_tables(tmp_path / "out")])
    kept = [name for index, (name, _) in enumerate(rows) if index != 6]
    assert sorted(np.array(info["label_names"])[labels].tolist()) == sorted(kept)  # the bad row's label went


def test_an_image_stored_by_path_only_is_refused_naming_its_row(tmp_path):
    save_images(tmp_path / "hf", digit_pngs(30))
    replace_image(tmp_path / "hf", 11, {"bytes": None, "path": "/elsewhere/digit.png"})
    with pytest.raises(UserError) as error:
        prepare("d", image_spec(tmp_path / "hf", on_bad_image="skip"), tmp_path / "out")
    assert str(error.value) == (
        f"{tmp_path / 'hf'} row 12 holds no image bytes in column 'image' (path '/elsewhere/digit.png') "
        "and only images stored in the folder are read; save it again with datasets' save_to_disk (which "
        "embeds local image files) or drop the row"
    )
