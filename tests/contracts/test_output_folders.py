"""Never delete what shardfuse did not write (issue 54): every stage flag that names a folder the stage
writes whole goes through one rule (``shardfuse.io.OutputFolder``): the folder is replaced only when it
is missing, empty, or that stage's own output (its record in it); a folder of the user's files is one
line naming it, exit status 2, and left exactly as it was.

The contract reads every stage's ``--out*`` flags from the source: each is either a folder flag with a
case here, or listed with the reason it needs none (a file written atomically, a folder written into).
"""

from __future__ import annotations

import importlib
import json
import re
from pathlib import Path

import pytest

from shardfuse.cluster.ownership import TRAINING_FOLDER
from shardfuse.console.errors import run_cli
from shardfuse.io import OutputFolder, UserError, atomic_dir, replace_dir
from tests.support.helpers import REPO

# (stage, flag) -> the folder it replaces, its arguments with OUT where the folder goes (the inputs need
# not exist: the rule is checked before any input is read).
FOLDER_FLAGS = {
    ("export", "--out"): ["--weights", "missing.safetensors", "--out", "OUT"],
    ("export_adapter", "--out"): [
        "--gather", "g.json", "--merge-json", "m.json", "--mode", "svd", "--out", "OUT",
    ],
    ("partition", "--out-dir"): [
        "--input", "in.parquet", "--world-size", "2", "--seed", "0", "--out-dir", "OUT",
    ],
    ("launch", "--out-dir"): ["--nproc-per-node", "1", "--out-dir", "OUT", "--", "--shard-dir", "s"],
    ("collect", "--out-dir"): [
        "--run-name", "r", "--shard-dir", "s", "--dataset-dir", "d", "--config-json", "{}",
        "--checkpoint", "missing.safetensors", "--out-dir", "OUT",
    ],
    ("merge", "--out"): ["--mergekit", "missing.yml", "--out", "OUT"],
}  # fmt: skip
# Flags that name no folder the stage replaces, and why.
OTHER_FLAGS = {
    ("comparison", "--out"): "a JSON file, written atomically",
    ("evaluate", "--out"): "eval.json, written atomically",
    ("gather", "--out"): "gather.json, written atomically",
    ("merge", "--out-weights"): "merged.safetensors, written atomically",
    ("merge", "--out-json"): "merge.json, written atomically",
    ("plots", "--out"): "a PNG file, written atomically",
    ("prepare", "--out-dir"): "train/val/test.parquet and dataset.json written into it, each atomically",
    ("plots", "--out-dir"): "figures written into it one by one, atomically; nothing else touched",
    ("summary", "--out"): "a CSV file, written atomically",
    ("tracking", "--out"): "a JSON file of run ids, written atomically",
    ("train", "--out-dir"): "rank files written into it; only its own checkpoints/step-N folders pruned",
}


def stage_flags() -> set[tuple[str, str]]:
    """Every (stage, --out* flag) a ``python -m shardfuse.<stage>`` accepts, read from the source."""
    found = set()
    for path in (REPO / "src" / "shardfuse").glob("*.py"):
        for flag in re.findall(r'add_argument\(\s*"(--out[a-z-]*)"', path.read_text()):
            found.add((path.stem, flag))
    return found


def test_every_out_flag_of_every_stage_is_a_folder_with_a_case_or_says_why_not():
    assert stage_flags() == set(FOLDER_FLAGS) | set(OTHER_FLAGS)


def users_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "mine"
    (folder / "sub").mkdir(parents=True)
    (folder / "notes.txt").write_text("months of work\n")
    (folder / "sub" / "data.csv").write_text("a,b\n1,2\n")
    return folder


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize(("stage", "flag"), sorted(FOLDER_FLAGS))
def test_a_folder_of_the_users_files_is_refused_in_one_line_and_left_untouched(
    stage, flag, tmp_path, capsys, monkeypatch
):
    folder = users_folder(tmp_path)
    before = snapshot(folder)
    monkeypatch.chdir(tmp_path)
    args = [str(folder) if arg == "OUT" else arg for arg in FOLDER_FLAGS[(stage, flag)]]
    module = importlib.import_module(f"shardfuse.{stage}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_cli(module.main, args)
    err = capsys.readouterr().err
    assert exited.value.code == 2, err
    lines = err.strip().splitlines()
    assert lines[-1].startswith(f"shardfuse.{stage}: error: {flag} {folder} holds files that "), err
    assert "nothing was changed: remove them yourself or give a new or empty folder" in lines[-1]
    assert "Traceback" not in err
    assert snapshot(folder) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mine"]  # no staging sibling left either


OWNER = OutputFolder("stage", "--out", "record.json", "format", "stage/1")


def staged(tmp_path: Path, content: str) -> Path:
    src = tmp_path / f"staged-{content}"
    src.mkdir()
    (src / "result.txt").write_text(content)
    (src / "record.json").write_text(json.dumps({"format": "stage/1"}))
    return src


def test_a_missing_an_empty_or_the_stages_own_folder_is_replaced(tmp_path):
    out = tmp_path / "out"
    replace_dir(staged(tmp_path, "one"), out, OWNER)  # missing
    replace_dir(staged(tmp_path, "two"), out, OWNER)  # its own
    assert (out / "result.txt").read_text() == "two"
    empty = tmp_path / "empty"
    empty.mkdir()
    replace_dir(staged(tmp_path, "three"), empty, OWNER)
    assert (empty / "result.txt").read_text() == "three"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "out"]


@pytest.mark.parametrize(
    "record",
    [None, "not json", json.dumps(["format"]), json.dumps({"format": "other/1"}), json.dumps({"fmt": 1})],
)
def test_a_folder_whose_record_is_missing_or_another_writers_is_refused(tmp_path, record):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("keep")
    if record is not None:
        (out / "record.json").write_text(record)
    src = staged(tmp_path, "new")
    with pytest.raises(UserError, match=r"^--out .*/out holds files that stage did not write \(no record"):
        replace_dir(src, out, OWNER)
    assert (out / "keep.txt").read_text() == "keep" and src.is_dir()


def test_a_file_or_a_link_where_the_folder_goes_is_refused(tmp_path):
    target = tmp_path / "target"
    target.mkdir()
    (tmp_path / "file").write_text("x")
    (tmp_path / "link").symlink_to(target)
    for name in ("file", "link"):
        refused = pytest.raises(UserError, match=r"exists and is not a folder; nothing was changed")
        with refused, atomic_dir(tmp_path / name, OWNER):
            raise AssertionError("the rule is checked before anything is staged")
    assert (tmp_path / "file").read_text() == "x" and (tmp_path / "link").resolve() == target


def test_a_folder_made_by_someone_else_while_the_stage_worked_is_still_refused(tmp_path):
    out = tmp_path / "out"
    refused = pytest.raises(UserError, match="holds files that stage did not write")
    with refused, atomic_dir(out, OWNER) as tmp:
        (tmp / "record.json").write_text(json.dumps({"format": "stage/1"}))
        out.mkdir()
        (out / "theirs.txt").write_text("theirs")
    assert (out / "theirs.txt").read_text() == "theirs"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # the staged folder is gone


def test_a_marking_stage_writes_its_record_and_replaces_its_own_output(tmp_path):
    marking = OutputFolder("export", "--out", ".shardfuse-export.json", "written_by", "export", mark=True)
    out = tmp_path / "hf"
    for text in ("first", "second"):
        with atomic_dir(out, marking) as tmp:
            (tmp / "config.json").write_text(text)
    assert (out / "config.json").read_text() == "second"
    assert json.loads((out / ".shardfuse-export.json").read_text()) == {"written_by": "export"}


def test_a_training_folder_is_recognised_by_its_train_json(tmp_path):
    ranks = tmp_path / "ranks"
    ranks.mkdir()
    (ranks / "train.json").write_text(json.dumps({"run": "t", "strategy": "ddp"}))
    TRAINING_FOLDER.check(ranks)  # a published training (a re-run replaces it)
    (ranks / "train.json").write_text(json.dumps({"run": "t"}))
    with pytest.raises(UserError, match="did not write"):
        TRAINING_FOLDER.check(ranks)


def test_a_killed_writes_temporary_siblings_go_at_the_next_write_of_that_output_and_no_others(tmp_path):
    """A process killed while writing ``out.json`` (or staging ``out/``) leaves ``.out.json.tmp-<owner>``
    (its pid in base 36 and a hash of its host: 8 characters, as mkstemp's random part, so names keep
    their length bound); the next write of that output removes what a dead process of this host left, and
    nothing else."""
    import os
    import subprocess
    import sys

    from shardfuse.io import _base36, _owner_tag, sweep_leftovers, write_json

    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    pid, host = _base36(int(dead.stdout), 5), _owner_tag()[5:]
    other_host = _base36((int(host, 36) + 1) % 36**3, 3)
    out = tmp_path / "out.json"
    leftover = tmp_path / f".out.json.tmp-{pid}{host}"
    leftover.write_text("half a file")
    kept = [
        tmp_path / f".out.json.tmp-{_base36(os.getpid(), 5)}{host}x",  # a live writer's (random suffix)
        tmp_path / f".out.json.tmp-{pid}{other_host}",  # another machine's: its pid means nothing here
        tmp_path / ".out.json.tmp-k2j_h5ab",  # mkstemp's random name (not an owner's)
        tmp_path / f".other.json.tmp-{pid}{host}",  # another output's
    ]
    for path in kept:
        path.write_text("keep")
    write_json(out, {"ok": True})
    assert json.loads(out.read_text()) == {"ok": True}
    assert not leftover.exists()
    assert all(path.read_text() == "keep" for path in kept)
    assert sweep_leftovers(out) == []
    folder = tmp_path / "ranks"
    (tmp_path / f".ranks.tmp-{pid}{host}" / "rank-0.safetensors").parent.mkdir()
    (tmp_path / f".ranks.tmp-{pid}{host}" / "rank-0.safetensors").write_text("half")
    assert sweep_leftovers(folder) == [tmp_path / f".ranks.tmp-{pid}{host}"]
    assert not (tmp_path / f".ranks.tmp-{pid}{host}").exists()


@pytest.mark.parametrize("size", ["lots", "2TB", "1.5GB", "500", "1 GB"])
def test_export_refuses_a_shard_size_save_pretrained_cannot_read_before_anything(tmp_path, capsys, size):
    from shardfuse import export

    with pytest.raises(SystemExit) as exited:
        run_cli(
            export.main,
            ["--weights", "missing.safetensors", "--out", str(tmp_path / "hf"), "--max-shard-size", size],
        )
    assert exited.value.code == 2
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--max-shard-size {size!r} is not a size; give a whole number with KB, MB or GB" in line
    assert not (tmp_path / "hf").exists()


def test_a_broken_file_that_no_stage_writes_is_never_advised_deleted(tmp_path):
    """merge --gather /etc/passwd once said "delete it and re-run the stage that produces it"."""
    from shardfuse.io import read_json

    passwd = tmp_path / "passwd"
    passwd.write_text("root:x:0:0:root:/root:/bin/bash\n")
    with pytest.raises(UserError) as refused:
        read_json(passwd, "gather record")
    assert str(refused.value) == (
        f"gather record {passwd} is not valid JSON (Expecting value at line 1); it is no record a stage "
        "writes: pass the gather record file (a .json) the stage wrote"
    )
    record = tmp_path / "gather.json"  # a record a stage writes, damaged: re-making it is the advice
    record.write_text("{")
    with pytest.raises(UserError, match="delete it and re-run the stage that produces it"):
        read_json(record, "gather record")
