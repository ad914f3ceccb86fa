"""What an export copies from the pretrained folder beside the merged weights (issue 54): its tokenizer and
configuration files, never a link out of the folder (a link to a file elsewhere would be published with the
model and logged to MLflow); a Hugging Face cache snapshot's links into its own blobs/ are its files."""

from __future__ import annotations

from pathlib import Path

from shardfuse.models.hf import files_to_copy


def test_a_link_out_of_the_folder_is_left_out_and_said(tmp_path, capsys):
    folder = tmp_path / "gpt2"
    folder.mkdir()
    for name in ("config.json", "model.safetensors", "tokenizer.json", ".hidden"):
        (folder / name).write_text("{}")
    secret = tmp_path / "secret.txt"
    secret.write_text("not for publication")
    (folder / "notes.txt").symlink_to(secret)
    (folder / "vocab.json").symlink_to(folder / "tokenizer.json")  # a link inside the folder: copied
    assert [p.name for p in files_to_copy(folder)] == ["tokenizer.json", "vocab.json"]
    assert (
        f"export: not copied: {folder / 'notes.txt'} links outside the pretrained folder"
        in capsys.readouterr().err
    )


def test_a_hugging_face_cache_snapshot_links_into_its_blobs_and_is_copied(tmp_path):
    cache = tmp_path / "models--org--tiny"
    snapshot = cache / "snapshots" / "0123abcd"
    (cache / "blobs").mkdir(parents=True)
    snapshot.mkdir(parents=True)
    for name, blob in (("config.json", "aa11"), ("tokenizer.json", "bb22")):
        (cache / "blobs" / blob).write_text("{}")
        (snapshot / name).symlink_to(Path("../../blobs") / blob)
    assert [p.name for p in files_to_copy(snapshot)] == ["tokenizer.json"]
