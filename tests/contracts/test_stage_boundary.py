"""The stage boundary (issue 29): a broken file between stages, or a broken environment (a full or
read-only disk, an SQL store that is a directory), is one line naming the file, the cause and the fix;
exit status 2; nothing that looks complete at the output path; never a traceback.

Each case builds its input from small hand-made records (no training) and runs the stage's ``main``
under ``run_cli`` in this process, as ``python -m shardfuse.<stage>`` does; SUBPROCESS_CASES also run as
real processes (the exit status and stderr a user sees). The docs/errors.md section "Broken files
between stages" lists every case, with the message fragment asserted here.
"""

from __future__ import annotations

import errno
import importlib
import json
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from shardfuse.console.errors import run_cli
from shardfuse.io import destination
from tests.support.helpers import REPO, run_stage, subprocess_env, write_train_dir
from tests.support.tracking import free_port

DOCS = REPO / "docs" / "errors.md"
SECTION = "## Broken files between stages"


@dataclass
class Case:
    stage: str
    args: list
    fragment: str
    out: Path | None = None  # must not exist afterwards, nor a temporary sibling of it
    fault: tuple[int, str] | None = None  # (errno, strerror) os.replace raises, as a disk would
    env: dict[str, str] | None = None  # run as a real process with these variables (a torchrun rank's)


# ---------------------------------------------------------------- inputs


def run_dir(tmp: Path, **overrides) -> tuple[Path, Path, str]:
    """(results/runs, results/trainings, --runs-json) of one run ``r`` whose eval.json, merge.json and
    train.json are well formed; ``overrides``: {file name: its content (an object, or raw bytes)}."""
    runs, trainings = tmp / "runs", tmp / "trainings"
    (runs / "r").mkdir(parents=True)
    (trainings / "t" / "ranks").mkdir(parents=True)
    scores = {"accuracy": 0.8, "loss": 0.5}
    files = {
        runs / "r" / "eval.json": {
            "run": "r", "task": "classification", "score": "accuracy", "merged": scores, "base": scores,
            "ranks": [{"rank": 0, **scores}], "best_rank_accuracy": 0.8, "mean_rank_accuracy": 0.8,
        },
        runs / "r" / "merge.json": {"run": "r", "method": "uniform", "max_abs_diff_between_ranks": 0.1},
        trainings / "t" / "ranks" / "train.json": {"run": "t", "num_steps": 4, "train_seconds": 1.0},
    }  # fmt: skip
    for path, content in files.items():
        content = overrides.get(path.name, content)
        path.write_bytes(content if isinstance(content, bytes) else json.dumps(content).encode())
    config = {"training": "t", "dataset": "d", "world_size": 2, "strategy": "localsgd", "sync_every": 0}
    return runs, trainings, json.dumps({"r": config})


def summary_case(tmp: Path, fragment: str, runs_json: str | None = None, **overrides) -> Case:
    runs, trainings, default_runs = run_dir(tmp, **overrides)
    out = tmp / "summary.csv"
    args = ["--runs-json", runs_json or default_runs, "--results-dir", runs, "--trainings-dir", trainings]
    return Case("summary", [*args, "--out", out], fragment, out)


def ranks_dir(tmp: Path) -> Path:
    return write_train_dir(tmp / "ranks", {"net.0.weight": torch.zeros(3, 4), "net.0.bias": torch.zeros(3)})


def gather_case(tmp: Path, ranks: Path, fragment: str, **fields) -> Case:
    out = tmp / "gather.json"
    return Case("gather", ["--train-dir", ranks, "--world-size", 2, "--out", out], fragment, out, **fields)


# ---------------------------------------------------------------- the cases


def case_runs_table_not_utf8(tmp):
    runs = tmp / "runs.tsv"
    runs.write_bytes(b"run\tlr\nr\t0.1\nna\xefve\t0.2\n")  # Latin-1, as a spreadsheet may save it
    config = tmp / "config.yaml"
    datasets = {"d": {"source": "digits"}}
    config.write_text(json.dumps({"runs": str(runs), "datasets": datasets, "run_defaults": {"dataset": "d"}}))
    return Case(
        "config", ["--configfile", config], f"{runs} is not UTF-8 text (byte 0xef at line 3, column 3)"
    )


def case_record_not_utf8(tmp):
    return summary_case(tmp, "train.json is not UTF-8 text (byte 0xff at line 1, column 2); delete it", **{
        "train.json": b'{\xff"run": "t"}'
    })  # fmt: skip


def case_record_field_wrong_type(tmp):
    return summary_case(
        tmp,
        "eval.json: 'merged' is a string \"high\", not dict; re-run the evaluate stage",
        **{"eval.json": {"run": "r", "task": "classification", "merged": "high"}},
    )


def case_record_metric_not_a_number(tmp):
    scores = {"accuracy": "0.8"}
    return summary_case(
        tmp,
        "eval.json: 'base' is a mapping whose 'accuracy' is a string \"0.8\", not a number",
        **{"eval.json": {"run": "r", "task": "classification", "merged": {"accuracy": 0.8}, "base": scores}},
    )


def case_record_field_missing(tmp):
    return summary_case(
        tmp, "train.json has no 'train_seconds' field; re-run the train stage", **{"train.json": {"run": "t"}}
    )


def case_record_not_json(tmp):
    return summary_case(tmp, "merge.json is not valid JSON", **{"merge.json": b'{"run": "r",'})


def case_runs_json_missing_key(tmp):
    return summary_case(tmp, "--runs-json: run 'r' has no 'training'", runs_json='{"r": {"dataset": "d"}}')


def case_runs_json_not_objects(tmp):
    return summary_case(tmp, "--runs-json must be a JSON object of objects", runs_json='["r"]')


def case_directory_where_a_file_is_expected(tmp):
    case = summary_case(tmp, "")
    case.out.mkdir()
    case.fragment = f"{case.out} is a directory where a file is expected"
    case.out = None  # the directory stays, untouched
    return case


def case_disk_full_names_the_destination(tmp):
    ranks = ranks_dir(tmp)
    out = tmp / "gather.json"
    return gather_case(
        tmp, ranks, f"cannot write {out} (No space left on device); free space on the filesystem of {tmp}",
        fault=(errno.ENOSPC, "No space left on device"),
    )  # fmt: skip


def case_read_only_output(tmp):
    fragment = f"cannot write {tmp / 'gather.json'}: its filesystem is read-only (Read-only file system)"
    return gather_case(tmp, ranks_dir(tmp), fragment, fault=(errno.EROFS, "Read-only file system"))


def case_training_record_not_utf8(tmp):
    ranks = ranks_dir(tmp)
    (ranks / "train.json").write_bytes(b'{"run": "t\xe9"}')
    return gather_case(
        tmp, ranks, f"{ranks / 'train.json'} is not UTF-8 text (byte 0xe9 at line 1, column 11)"
    )


def case_truncated_base_checkpoint(tmp):
    ranks = ranks_dir(tmp)
    base = ranks / "base.safetensors"
    base.write_bytes(base.read_bytes()[:60])
    return gather_case(tmp, ranks, f"checkpoint {base} is not a readable safetensors file")


def case_tracking_record_malformed(tmp):
    png, record = tmp / "a.png", tmp / "mlflow.json"
    png.write_bytes(b"png")
    record.write_text('{"parent_run_id": "x"}')
    out = tmp / "out.json"
    args = ["--png", png, "--records", record, "--out", out]
    return Case("comparison", args, f"tracking record {record} has no tracking_uri and parent_run_id", out)


def case_sqlite_uri_is_a_directory(tmp):
    png, record, store = tmp / "a.png", tmp / "mlflow.json", tmp / "mlflow.db"
    png.write_bytes(b"png")
    store.mkdir()
    record.write_text(json.dumps({"tracking_uri": f"sqlite:///{store}", "parent_run_id": "x"}))
    out = tmp / "out.json"
    return Case(
        "comparison",
        ["--png", png, "--records", record, "--out", out],
        f"cannot use tracking URI sqlite:///{store} (",
        out,
    )


def gathered(tmp: Path) -> Path:
    """gather.json of hand-made ranks (gather's own main, in this process)."""
    from shardfuse import gather

    ranks = ranks_dir(tmp)
    gather.main(["--train-dir", str(ranks), "--world-size", "2", "--out", str(tmp / "gather.json")])
    return tmp / "gather.json"


def hand_made_shards(tmp: Path, world_size: int = 2, **first_shard) -> Path:
    """A shard directory whose manifest.json adds up; ``first_shard`` edits rank 0's entry."""
    shard_dir = tmp / "shards"
    shard_dir.mkdir()
    shards = [
        {"rank": rank, "path": f"shard-{rank}.parquet", "rows": 5, "sha256": f"{rank}" * 64, "bytes": 1}
        for rank in range(world_size)
    ]
    shards[0].update(first_shard)
    rows = 5 * world_size
    manifest = {
        "format": "shardfuse.shards/1", "world_size": world_size, "seed": 0, "drop_remainder": False,
        "source": {"path": "train.parquet", "sha256": "f" * 64, "rows": rows}, "total_rows": rows,
        "dropped_rows": 0, "schema": [], "shards": shards,
    }  # fmt: skip
    (shard_dir / "manifest.json").write_text(json.dumps(manifest))
    return shard_dir


def case_prepare_source_not_parquet(tmp):
    data = tmp / "data.parquet"
    data.write_bytes(b"PAR1" + b"\xff" * 20)
    spec = json.dumps({"source": "parquet", "path": str(data), "label_column": "y", "feature_columns": ["a"]})
    out = tmp / "dataset"
    # Arrow's reason, then the fix, as docs/errors.md quotes them.
    fragment = f"cannot read {data} as parquet (Parquet magic bytes not found in footer. Either the file is "
    fragment += "corrupted or this is not a parquet file.); check the file and the spec's 'source'"
    return Case("prepare", ["--name", "d", "--spec-json", spec, "--out-dir", out], fragment, out)


def case_partition_input_not_parquet(tmp):
    split = tmp / "train.parquet"
    split.write_bytes(b"PAR1" + b"\xff" * 20)
    out = tmp / "shards"
    args = ["--input", split, "--world-size", 2, "--seed", 0, "--out-dir", out]
    return Case("partition", args, f"--input {split} is not a readable Parquet file", out)


def case_launch_manifest_path_edited(tmp):
    shard_dir = hand_made_shards(tmp, path=5)
    out = tmp / "train"
    args = [
        "--nproc-per-node", 2, "--out-dir", out, "--", "--run-name", "r", "--shard-dir", shard_dir,
        "--dataset-dir", tmp, "--config-json", "{}",
    ]  # fmt: skip
    fragment = f"shard manifest {shard_dir / 'manifest.json'} has a malformed shards[0].path (5)"
    return Case("launch", args, fragment, out)


def case_merge_base_swapped_after_gather(tmp):
    gather_json = gathered(tmp)
    other = write_train_dir(
        tmp / "other", {"net.0.weight": torch.ones(3, 4), "net.0.bias": torch.ones(3)}, run="another"
    )
    for name in ("base.safetensors", "base.json"):
        if (other / name).exists():
            (tmp / "ranks" / name).write_bytes((other / name).read_bytes())
    out = tmp / "merged.safetensors"
    args = ["--gather", gather_json, "--method", "task_arithmetic", "--out-weights", out]
    return Case(
        "merge", [*args, "--out-json", tmp / "merge.json"], "re-run training (snakemake -R train)", out
    )


def case_evaluate_dataset_json_not_utf8(tmp):
    gather_json = gathered(tmp)
    test = tmp / "test.parquet"
    test.write_bytes(b"PAR1")
    (tmp / "dataset.json").write_bytes(b'{"rows": "\xe9"}')
    out = tmp / "eval.json"
    args = ["--run", "r", "--test", test, "--gather", gather_json, "--merged", tmp / "m.safetensors"]
    return Case("evaluate", [*args, "--out", out], f"{tmp / 'dataset.json'} is not UTF-8 text", out)


def case_plots_summary_not_utf8(tmp):
    summary, out = tmp / "summary.csv", tmp / "merge_methods.png"
    summary.write_bytes(b"run,method\nr,unif\xe9\n")
    return Case("plots", ["compare", "--summary", summary, "--out", out], f"{summary} is not UTF-8 text", out)


def case_tracking_gather_record_not_utf8(tmp):
    runs, trainings, _ = run_dir(tmp)
    manifest, record = tmp / "manifest.json", runs / "r" / "gather.json"
    record.write_bytes(b'{"format": "\xff"}')
    manifest.write_text("{}")  # present: the inputs' existence is checked first
    (runs / "r" / "merged.safetensors").write_bytes(b"")
    config = json.dumps({"run": "r", "dataset": "d", "training": "t"})
    out = tmp / "ids.json"
    args = [
        "--run", "r", "--run-dir", runs / "r", "--train-dir", trainings / "t" / "ranks", "--manifest",
        manifest, "--config-json", config, "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--out", out,
    ]  # fmt: skip
    return Case("tracking", args, f"{record} is not UTF-8 text", out)


def case_export_truncated_weights(tmp):
    weights = ranks_dir(tmp) / "base.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    out = tmp / "exported"
    return Case(
        "export", ["--weights", weights, "--out", out], f"{weights} is not a readable safetensors", out
    )


def case_init_from_truncated(tmp):
    weights = ranks_dir(tmp) / "base.safetensors"
    weights.write_bytes(weights.read_bytes()[:50])
    args = ["--init-from", weights, "--dataset-json", '{"source": "digits"}']
    return Case("check_init", args, f"init_from {weights} is not a readable safetensors file")


def case_train_dataset_record_not_utf8(tmp):
    """The train stage as its own command, as torchrun runs each rank (here one rank of one)."""
    shard_dir = hand_made_shards(tmp, world_size=1)
    (tmp / "dataset.json").write_bytes(b'{"name": "d\xe9"}')
    out = tmp / "train"
    args = ["--run-name", "r", "--shard-dir", shard_dir, "--dataset-dir", tmp, "--config-json", "{}"]
    rank = {"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1"}
    rank.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
    fragment = f"{tmp / 'dataset.json'} is not UTF-8 text (byte 0xe9 at line 1, column 12)"
    return Case("train", [*args, "--out-dir", out], fragment, out / "rank-0.safetensors", env=rank)


def case_export_adapter_gather_not_utf8(tmp):
    record = tmp / "gather.json"
    record.write_bytes(b'{"run": "t\xe9"}')
    merge = tmp / "merge.json"
    merge.write_text(json.dumps({"run": "r", "method": "uniform"}))
    out = tmp / "adapter"
    args = ["--gather", record, "--merge-json", merge, "--mode", "svd", "--out", out]
    return Case("export_adapter", args, f"{record} is not UTF-8 text (byte 0xe9 at line 1, column 11)", out)


def case_collect_checkpoint_not_safetensors(tmp):
    broken = tmp / "a.safetensors"
    broken.write_bytes(b"\x00" * 7)  # shorter than a safetensors header
    out = tmp / "ranks"
    args = ["--run-name", "c", "--shard-dir", tmp / "w1", "--dataset-dir", tmp / "d", "--config-json", "{}"]
    fragment = f"checkpoint {broken} is not a readable safetensors file"
    return Case("collect", [*args, "--checkpoint", broken, "--out-dir", out], fragment, out)


def case_leaderboard_store_is_a_directory(tmp):
    store = tmp / "mlflow.db"
    store.mkdir()  # a sqlite:/// URI naming a folder
    uri = f"sqlite:///{store}"
    fragment = f"cannot use tracking URI {uri} ({store} is a directory, not a database file)"
    return Case("leaderboard", ["--tracking-uri", uri, "--experiment", "e"], fragment, None)


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}
SUBPROCESS_CASES = {"record_not_utf8", "training_record_not_utf8"}


# ---------------------------------------------------------------- the checks


def run_in_process(case: Case, capsys, monkeypatch) -> tuple[int, str]:
    module = importlib.import_module(f"shardfuse.{case.stage}")
    if case.fault is not None:
        number, text = case.fault

        def failing_replace(src, dst):  # the disk refuses the rename of the finished temporary file
            raise OSError(number, text, str(src))

        monkeypatch.setattr("shardfuse.io.os.replace", failing_replace)
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_cli(module.main, [str(arg) for arg in case.args])
    monkeypatch.undo()
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_a_broken_file_or_disk_is_one_line_at_the_stage_boundary(name, tmp_path, capsys, monkeypatch):
    case = CASES[name](tmp_path)
    if case.env is not None:
        command = [sys.executable, "-m", f"shardfuse.{case.stage}", *map(str, case.args)]
        env = {**subprocess_env(), **case.env}
        proc = subprocess.run(command, capture_output=True, text=True, env=env, timeout=300)
        returncode, stderr = proc.returncode, proc.stderr
    elif name in SUBPROCESS_CASES:
        proc = run_stage(case.stage, *case.args)
        returncode, stderr = proc.returncode, proc.stderr
    else:
        returncode, stderr = run_in_process(case, capsys, monkeypatch)
    assert returncode == 2, stderr[-2000:]
    assert "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert lines[-1].startswith(f"shardfuse.{case.stage}: error: "), stderr[-2000:]
    assert case.fragment in lines[-1], lines[-1]
    assert ".tmp-" not in lines[-1]  # a temporary file is named as the file it was to become
    if case.out is not None:
        assert not case.out.exists()
        assert not list(case.out.parent.glob(f".{case.out.name}.tmp-*"))


def test_every_stage_with_a_command_line_has_a_case(tmp_path):
    """Every ``python -m shardfuse.<stage>`` (a module of the package with a ``main``) has a case."""
    src = REPO / "src" / "shardfuse"
    stages = {path.stem for path in src.glob("*.py") if "\ndef main(" in path.read_text()}
    covered = set()
    for index, build in enumerate(CASES.values()):
        (tmp_path / str(index)).mkdir()
        covered.add(build(tmp_path / str(index)).stage)
    assert stages <= covered, f"stages without a broken-input case: {sorted(stages - covered)}"


def test_a_temporary_sibling_is_named_as_its_destination():
    assert destination("/r/.gather.json.tmp-abc123") == Path("/r/gather.json")
    assert destination("/r/.ranks.tmp-x1/rank-0.safetensors") == Path("/r/ranks/rank-0.safetensors")
    assert destination("/r/gather.json") == Path("/r/gather.json")


def test_a_bug_keeps_its_traceback(capsys):
    def main(argv):
        raise IndexError("list index out of range")

    with pytest.raises(IndexError):
        run_cli(main, [])


def test_each_error_line_is_one_write(monkeypatch):
    """Ranks share a console and a log: each line and its newline leave in one write (print makes two),
    so two ranks' lines never join into one."""
    from shardfuse import io
    from shardfuse.console import errors as console_errors

    writes = []
    monkeypatch.setattr(io.os, "write", lambda fd, data: writes.append(data) or len(data))

    class Console:
        def fileno(self):
            return 2

        def flush(self):
            pass

    console_errors.write_line("shardfuse.train: error: rank 1: x", Console())
    assert writes == [b"shardfuse.train: error: rank 1: x\n"]


def documented_cases() -> dict[str, str]:
    """{case: its message excerpt} of the docs/errors.md section on broken files between stages."""
    text = DOCS.read_text().split(SECTION, 1)[1].split("\n## ", 1)[0]
    rows = {}
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and (match := re.fullmatch(r"`(\w+)`", cells[0])):
            rows[match.group(1)] = cells[2]
    return rows


def test_every_case_is_documented_with_its_message():
    rows = documented_cases()
    assert set(rows) == set(CASES)
    drifted = []
    source = Path(__file__).read_text().replace('\\"', '"')  # the fragments as the user reads them
    for name, message in rows.items():
        for piece in re.findall(r"`([^`]+)`", message):
            for part in (part.strip(" ;:,()") for part in piece.split("…")):
                if len(part) >= 8 and part not in source:
                    drifted.append(f"{name}: {part!r}")
    assert not drifted, f"docs/errors.md quotes what no case asserts: {drifted}"
    assert os.path.basename(__file__) in DOCS.read_text().split(SECTION, 1)[1]
