"""A long stage says how far it is on the workflow's console: nothing for a stage that ends within
CONSOLE_SECONDS, then a line every CONSOLE_SECONDS and the last one, each in the log too; the real
prepare (a streamed source), partition and merge engine count their rows and parameters to the total;
nothing under --quiet."""

from __future__ import annotations

import io
import json
import os

import numpy as np
import pytest
from safetensors.numpy import save_file

from shardfuse import partition, prepare
from shardfuse.checkpoints.stream import SafetensorsReader
from shardfuse.console import progress as stage_progress
from shardfuse.console.progress import StageProgress
from shardfuse.console.stream import CONSOLE_FD_ENV, QUIET_ENV, console_token
from shardfuse.data.sources import synthetic
from shardfuse.fusion.engine import Engine
from shardfuse.fusion.methods.registry import resolve_params
from tests.support.helpers import ManualClock


def test_a_short_stage_prints_nothing_and_a_long_one_a_line_every_10_s_then_its_last():
    clock, console, log = ManualClock(100.0), io.StringIO(), io.StringIO()
    console.close = lambda: None  # read after the stage
    with StageProgress("merge ties", 1000, "parameters", clock=clock, console=console, log=log) as short:
        clock.now += 9.9
        short.advance(1000)
    assert console.getvalue() == log.getvalue() == ""

    with StageProgress("merge ties", 1000, "parameters", clock=clock, console=console, log=log) as long:
        clock.now += 10.0
        long.advance(250)  # 25 per second: 30 s to go
        clock.now += 5.0
        long.advance(250)  # within 10 s of the last line: none
        clock.now += 5.0
        long.advance(250)
        clock.now += 1.0
        long.advance(250)
    assert console.getvalue().splitlines() == [
        "merge ties: 250/1,000 parameters (25%), 25 parameters/s, ETA 30s",
        "merge ties: 750/1,000 parameters (75%), 38 parameters/s, ETA 7s",
        "merge ties: 1,000/1,000 parameters (100%), 48 parameters/s, ETA 0s",
    ]
    assert log.getvalue() == console.getvalue()


def test_without_a_total_the_line_counts_and_gives_the_rate():
    clock, log = ManualClock(), io.StringIO()
    stage = StageProgress("prepare big", None, "rows", clock=clock, console=None, log=log)
    clock.now += 20.0
    stage.advance(4000)
    assert log.getvalue() == "prepare big: 4,000 rows, 200 rows/s\n"


@pytest.fixture
def console_file(tmp_path, monkeypatch):
    """The job's console as the workflow's shell prefix passes it, every advance a line (no 10 s wait)."""
    path = tmp_path / "console.txt"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    monkeypatch.setenv(CONSOLE_FD_ENV, console_token(fd))
    monkeypatch.delenv(QUIET_ENV, raising=False)
    monkeypatch.setattr(stage_progress, "CONSOLE_SECONDS", 0.0)
    yield path
    os.close(fd)


def test_prepare_and_partition_count_their_rows_on_the_jobs_console(tmp_path, console_file, monkeypatch):
    monkeypatch.setattr(synthetic, "SYNTHETIC_CHUNK_VALUES", 4000)  # chunks of 1000 rows of 4 features
    spec = {"source": "synthetic", "num_rows": 3000, "num_features": 4, "num_classes": 3}
    prepare.prepare("synth", spec, tmp_path / "synth")
    lines = console_file.read_text().splitlines()
    assert lines[-1].startswith("prepare synth: 3,000/3,000 rows (100%), ")
    assert len(lines) == 4  # a line per chunk, then the last one again

    partition.main([
        "--input", str(tmp_path / "synth" / "train.parquet"), "--world-size", "2", "--seed", "0",
        "--out-dir", str(tmp_path / "shards" / "w2-seed0"), "--batch-size", "500",
    ])  # fmt: skip
    rows = json.loads((tmp_path / "synth" / "dataset.json").read_text())["rows"]["train"]
    last = console_file.read_text().splitlines()[-1]
    assert last.startswith(f"partition shards/w2-seed0: {rows:,}/{rows:,} rows (100%), "), last

    monkeypatch.setenv(QUIET_ENV, "1")  # snakemake --quiet
    before = console_file.read_text()
    prepare.prepare("quiet", spec, tmp_path / "quiet")
    assert console_file.read_text() == before


@pytest.mark.parametrize("method", ["uniform", "ties"])
def test_the_merge_engine_counts_every_parameter_it_writes_once(tmp_path, method):
    rng = np.random.default_rng(0)
    paths = []
    for rank in range(3):
        tensors = {
            "a": rng.standard_normal(3001).astype(np.float32),
            "b": rng.standard_normal((7, 5)).astype(np.float32),
            "steps": np.arange(4, dtype=np.int64),
        }
        save_file(tensors, str(tmp_path / f"rank-{rank}.safetensors"))
        paths.append(tmp_path / f"rank-{rank}.safetensors")
    readers = [SafetensorsReader(path) for path in paths]
    base = SafetensorsReader(paths[0]) if method == "ties" else None
    params = resolve_params(method, {}, [1, 1, 1])
    engine = Engine(readers, base, method, params, [0, 1, 2], block_bytes=512)
    counted = []

    class Sink:
        def write(self, name, data) -> None:
            pass

    engine.run(list(readers[0].tensors), Sink(), counted.append)
    assert sum(counted) == 3001 + 35 + 4 and len(counted) > 3  # block by block
