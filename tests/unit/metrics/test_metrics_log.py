"""The per-rank metrics log: what a killed job keeps on disk, resume truncation, consolidation."""

from __future__ import annotations

import math
import time

import pyarrow.parquet as pq

from shardfuse.metrics.steps import RECORD_BYTES, MetricsLog, read_records


def append_steps(log: MetricsLog, steps: range) -> None:
    for step in steps:
        log.append(step, 0, 1.0 / step, 100.0 + step / 3, 0.1, time.perf_counter())


def steps_on_disk(log: MetricsLog) -> list[int]:
    return read_records(log.path)["step"].to_pylist()


def test_rows_reach_the_file_once_the_flush_interval_has_passed(tmp_path):
    before_ms = time.time() * 1000
    log = MetricsLog(tmp_path, rank=0, flush_seconds=0.0)
    append_steps(log, range(1, 4))
    assert steps_on_disk(log) == [1, 2, 3]  # every append found the interval over: nothing only in memory
    # The step clock (perf_counter) is stored as wall-clock milliseconds, for MLflow's timestamps.
    stamps = read_records(log.path)["timestamp_ms"].to_pylist()
    assert all(before_ms - 1000 <= stamp <= time.time() * 1000 + 1000 for stamp in stamps)
    assert stamps == sorted(stamps)


def test_rows_wait_in_memory_within_the_interval_and_a_flush_writes_them(tmp_path):
    log = MetricsLog(tmp_path, rank=1, flush_seconds=3600.0)
    append_steps(log, range(1, 51))
    assert steps_on_disk(log) == []
    log.flush()  # what the training loop does at every checkpoint
    assert steps_on_disk(log) == list(range(1, 51))


def test_a_full_buffer_is_flushed_whatever_the_interval(tmp_path):
    log = MetricsLog(tmp_path, rank=0, flush_seconds=3600.0, max_rows=10)
    append_steps(log, range(1, 26))
    assert steps_on_disk(log) == list(range(1, 21))


def test_values_read_back_bitwise_including_non_finite_ones(tmp_path):
    log = MetricsLog(tmp_path, rank=0, flush_seconds=0.0)
    values = [0.1 + 0.2, 1e-300, 123456.789012345678, float("inf"), -float("inf")]
    for step, value in enumerate(values, start=1):
        log.append(step, 2, value, value, value, step)
    log.append(len(values) + 1, 2, float("nan"), 1.0, 1.0, 0)
    table = read_records(log.path).to_pydict()
    assert table["loss"][: len(values)] == values and table["lr"][: len(values)] == values
    assert math.isnan(table["loss"][-1]) and table["epoch"] == [2] * (len(values) + 1)


def test_a_line_cut_by_a_kill_is_left_out(tmp_path):
    log = MetricsLog(tmp_path, rank=0, flush_seconds=0.0)
    append_steps(log, range(1, 4))
    with open(log.path, "ab") as fh:
        fh.write(b"\x01" * (RECORD_BYTES - 5))  # the process died mid-write: part of a record
    assert steps_on_disk(log) == [1, 2, 3]
    resumed = MetricsLog(tmp_path, rank=0, resume_step=3)
    append_steps(resumed, range(4, 6))
    assert pq.read_table(resumed.consolidate())["step"].to_pylist() == [1, 2, 3, 4, 5]


def test_resume_drops_rows_after_the_checkpoint_and_consolidate_orders_steps(tmp_path):
    log = MetricsLog(tmp_path, rank=0, flush_seconds=0.0)
    append_steps(log, range(1, 31))
    # A restart resumes from step 20: the rows 21..30 of the failed attempt go, the new attempt
    # logs them again, and the final file has exactly one row per step.
    resumed = MetricsLog(tmp_path, rank=0, resume_step=20, flush_seconds=3600.0)
    assert steps_on_disk(resumed) == list(range(1, 21))
    append_steps(resumed, range(21, 41))
    final = resumed.consolidate()
    table = pq.read_table(final)
    assert table["step"].to_pylist() == list(range(1, 41))
    assert table["loss"].to_pylist() == [1.0 / s for s in range(1, 41)]
    assert not resumed.path.exists()


def test_a_kill_after_consolidating_resumes_from_the_consolidated_rows(tmp_path):
    log = MetricsLog(tmp_path, rank=0, flush_seconds=0.0)
    append_steps(log, range(1, 31))
    log.consolidate()  # the record file goes; killed here, before train.json: torchrun restarts
    resumed = MetricsLog(tmp_path, rank=0, resume_step=25, flush_seconds=3600.0)
    assert steps_on_disk(resumed) == list(range(1, 26))
    append_steps(resumed, range(26, 31))
    table = pq.read_table(resumed.consolidate())
    assert table["step"].to_pylist() == list(range(1, 31))
    assert table["loss"].to_pylist() == [1.0 / s for s in range(1, 31)]
    # A fresh start still drops everything (the stale Parquet is replaced at its own consolidation).
    assert steps_on_disk(MetricsLog(tmp_path, rank=0)) == []


def test_a_fresh_start_drops_what_an_attempt_without_checkpoint_logged(tmp_path):
    append_steps(MetricsLog(tmp_path, rank=0, flush_seconds=0.0), range(1, 8))
    fresh = MetricsLog(tmp_path, rank=0)
    assert steps_on_disk(fresh) == []
