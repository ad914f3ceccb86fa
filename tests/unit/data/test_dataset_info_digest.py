"""dataset.json carries the digest of its own fields (issue 54): a file edited by hand after prepare (the
classes renamed or re-counted) is refused where a stage reads it; files of older prepare stages, which
have no digest, are read as before."""

from __future__ import annotations

import json

import pytest

from shardfuse.data.dataset_info import INFO_DIGEST, read_dataset_info
from shardfuse.io import UserError
from shardfuse.prepare import prepare


@pytest.fixture(scope="module")
def prepared(tmp_path_factory):
    out = tmp_path_factory.mktemp("digits")
    prepare("digits", {"source": "digits", "test_fraction": 0.2, "seed": 0}, out)
    return out


def edited(prepared, tmp_path, change):
    info = json.loads((prepared / "dataset.json").read_text())
    change(info)
    (tmp_path / "dataset.json").write_text(json.dumps(info))
    return tmp_path


def test_a_dataset_json_as_prepare_wrote_it_is_read(prepared):
    info = read_dataset_info(prepared)
    assert len(info[INFO_DIGEST]) == 64 and info["num_classes"] == 10


@pytest.mark.parametrize(
    "change",
    [
        lambda info: info.update(label_names=list(reversed(info["label_names"]))),  # classes renamed
        lambda info: info.update(num_classes=20),  # a 20-class model would train
        lambda info: info["rows"].update(train=1),
    ],
)
def test_a_field_edited_by_hand_is_refused_naming_the_file(prepared, tmp_path, change):
    folder = edited(prepared, tmp_path, change)
    with pytest.raises(UserError) as refused:
        read_dataset_info(folder)
    assert str(refused.value) == (
        f"dataset info {folder}/dataset.json was edited after prepare wrote it (its fields no longer match "
        "its info_sha256: label_names, num_classes or another field changed); re-run the prepare stage "
        "(snakemake -R prepare_dataset)"
    )


def test_an_older_dataset_json_without_a_digest_is_read_as_before(prepared, tmp_path):
    folder = edited(prepared, tmp_path, lambda info: info.pop(INFO_DIGEST))
    assert read_dataset_info(folder)["label_names"] == read_dataset_info(prepared)["label_names"]
