"""Per-rank system metrics: the sampling thread, what a kill and a resume keep, NVML present or not,
MLflow's names, and a real torchrun training that samples without changing a bit of what it trains."""

from __future__ import annotations

import importlib.util
import re
import sys
import time
import types
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.metrics import system as sysmetrics
from shardfuse.metrics.system import (
    COLUMNS,
    GPU_COLUMNS,
    INTERVAL_ENV,
    RECORD_BYTES,
    SystemSampler,
    interval_from_env,
    peak,
    read_rows,
    read_system_metrics,
    system_metrics_path,
)
from tests.support.training import CPU_METRICS


@pytest.fixture(autouse=True)
def no_real_nvml(monkeypatch):
    """No test here depends on whether the machine has NVML (``None`` in sys.modules: import fails)."""
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.delenv(INTERVAL_ENV, raising=False)


def busy(seconds: float) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        sum(range(1000))


def wait_for(condition, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def test_sampler_thread_records_plausible_samples_at_start_every_interval_and_at_stop(tmp_path):
    before_ms = time.time() * 1000
    with SystemSampler(tmp_path, rank=0, interval_s=0.05) as sampler:
        assert sampler._thread.daemon  # never keeps a finished rank alive
        busy(0.4)
    path = sampler.consolidate()
    assert path == system_metrics_path(tmp_path, 0) and path.is_file()
    assert not sampler.path.exists()  # the record file goes once consolidated
    metrics = read_system_metrics(path)
    assert set(metrics) == CPU_METRICS  # no NVML: no GPU metric at all
    num_rows = len(metrics["system/process_rss_megabytes"])
    assert num_rows >= 4 and num_rows == sampler.num_samples
    for rows in metrics.values():
        assert rows.shape == (num_rows, 2)
        assert np.all(np.diff(rows[:, 0]) >= 0)  # time order
        assert before_ms - 1000 <= rows[0, 0] and rows[-1, 0] <= time.time() * 1000 + 1000
    value = {name: rows[:, 1] for name, rows in metrics.items()}
    assert np.all(value["system/process_rss_megabytes"] > 1)  # a Python with numpy is MBs at least
    assert np.all(value["system/process_cpu_utilization_percentage"] >= 0)
    assert value["system/process_cpu_utilization_percentage"].max() > 20  # the busy loop shows
    assert np.all(value["system/cpu_utilization_percentage"] >= 0)
    assert np.all(value["system/cpu_utilization_percentage"] <= 100 + 1e-9)
    used, total = value["system/system_memory_usage_megabytes"], value["system/system_memory_total_megabytes"]
    assert np.all((used > 0) & (used < total))
    np.testing.assert_allclose(value["system/system_memory_usage_percentage"], 100 * used / total)


def test_a_short_run_still_has_a_sample_at_start_and_one_at_stop(tmp_path):
    sampler = SystemSampler(tmp_path, rank=3, interval_s=3600).start()
    path = sampler.consolidate()
    assert path.name == "system-rank-3.parquet"
    assert pq.read_table(path).num_rows == 2
    assert all(len(rows) == 2 for rows in read_system_metrics(path).values())


def test_a_record_cut_by_a_kill_is_dropped_and_later_records_stay_aligned(tmp_path):
    with SystemSampler(tmp_path, rank=0, interval_s=3600) as first:
        pass
    with open(first.path, "ab") as fh:
        fh.write(b"\x01" * (RECORD_BYTES - 5))  # the process died mid-write: part of a record
    assert len(read_rows(first.path)) == 2  # readers keep whole records only
    assert read_system_metrics(first.path)["system/process_rss_megabytes"].shape == (2, 2)
    second = SystemSampler(tmp_path, rank=0, interval_s=3600).start()
    rows = read_rows(second.consolidate())
    assert len(rows) == 4
    assert np.all(rows[:, COLUMNS.index("process_rss_megabytes")] > 1)  # not misaligned garbage
    assert np.all(np.diff(rows[:, 0]) >= 0)


def test_a_resumed_run_appends_so_every_attempts_samples_are_kept(tmp_path):
    with SystemSampler(tmp_path, rank=1, interval_s=3600):  # attempt 1, killed: never consolidated
        pass
    time.sleep(0.01)
    attempt_1_end = read_rows(tmp_path / "system-rank-1.f64")[-1, 0]
    rows = read_rows(SystemSampler(tmp_path, rank=1, interval_s=3600).start().consolidate())
    assert len(rows) == 4 and np.sum(rows[:, 0] <= attempt_1_end) == 2  # timestamps tell them apart
    # An attempt killed after consolidating (before train.json): the next one keeps its samples too,
    # and rows in both files (a kill between the Parquet write and the unlink) count once.
    third = SystemSampler(tmp_path, rank=1, interval_s=3600).start()
    third.stop()
    (tmp_path / "system-rank-1.f64").write_bytes(
        (tmp_path / "system-rank-1.f64").read_bytes() + rows[:1].astype("<f8").tobytes()
    )
    assert len(read_rows(third.consolidate())) == 6


def test_without_nvml_there_are_no_gpu_columns_and_no_error(tmp_path, capfd):
    path = SystemSampler(tmp_path, rank=0, gpu=0, interval_s=3600).start().consolidate()
    assert not set(GPU_COLUMNS) & set(pq.read_table(path).column_names)
    assert set(read_system_metrics(path)) == CPU_METRICS
    assert capfd.readouterr().err == ""


def fake_nvml(init_error: Exception | None = None) -> types.SimpleNamespace:
    """The few pynvml calls the sampler makes, for a machine with four GPUs."""
    calls: list[tuple] = []

    def init():
        if init_error is not None:
            raise init_error

    return types.SimpleNamespace(
        calls=calls,
        nvmlInit=init,
        nvmlShutdown=lambda: calls.append(("shutdown",)),
        nvmlDeviceGetHandleByIndex=lambda index: calls.append(("index", index)) or ("gpu", index),
        nvmlDeviceGetHandleByUUID=lambda uuid: calls.append(("uuid", uuid)) or ("gpu", 2),
        nvmlDeviceGetIndex=lambda handle: handle[1],
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(used=2e9, total=8e9),
        nvmlDeviceGetUtilizationRates=lambda handle: types.SimpleNamespace(gpu=37, memory=5),
    )


def test_with_nvml_the_ranks_own_gpu_is_sampled_under_mlflows_gpu_names(tmp_path, monkeypatch):
    nvml = fake_nvml()
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1,3")  # the rank's cuda:1 is the machine's GPU 3
    path = SystemSampler(tmp_path, rank=1, gpu=1, interval_s=3600).start().consolidate()
    metrics = read_system_metrics(path)
    assert set(metrics) == CPU_METRICS | {
        "system/gpu_3_utilization_percentage",
        "system/gpu_3_memory_usage_megabytes",
        "system/gpu_3_memory_usage_percentage",
    }
    assert metrics["system/gpu_3_utilization_percentage"][:, 1].tolist() == [37.0, 37.0]
    assert metrics["system/gpu_3_memory_usage_megabytes"][:, 1].tolist() == [2000.0, 2000.0]
    assert metrics["system/gpu_3_memory_usage_percentage"][:, 1].tolist() == [25.0, 25.0]
    assert nvml.calls == [("index", 3), ("shutdown",)]
    # A UUID in CUDA_VISIBLE_DEVICES is looked up as one; a CPU rank (gpu=None) asks NVML nothing.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "GPU-8d1c")
    nvml.calls.clear()
    SystemSampler(tmp_path, rank=0, gpu=0, interval_s=3600).start().stop()
    assert nvml.calls[0] == ("uuid", "GPU-8d1c")
    nvml.calls.clear()
    SystemSampler(tmp_path, rank=2, gpu=None, interval_s=3600).start().stop()
    assert nvml.calls == []


def test_nvml_that_fails_to_start_means_no_gpu_columns_not_an_error(tmp_path, monkeypatch, capfd):
    monkeypatch.setitem(sys.modules, "pynvml", fake_nvml(init_error=RuntimeError("NVML driver not loaded")))
    path = SystemSampler(tmp_path, rank=0, gpu=0, interval_s=3600).start().consolidate()
    assert set(read_system_metrics(path)) == CPU_METRICS
    assert capfd.readouterr().err == ""


def test_a_failing_read_stops_sampling_with_one_warning_and_never_raises(tmp_path, monkeypatch, capfd):
    real_sample = sysmetrics._Probe.sample
    calls = []

    def failing(probe):
        calls.append(1)
        if len(calls) > 1:
            raise OSError("/proc went away")
        return real_sample(probe)

    monkeypatch.setattr(sysmetrics._Probe, "sample", failing)
    sampler = SystemSampler(tmp_path, rank=5, interval_s=0.01).start()
    wait_for(lambda: not sampler._thread.is_alive())
    busy(0.05)
    assert len(calls) == 2  # sampling stopped at the first failure
    sampler.stop()
    rows = read_system_metrics(sampler.consolidate())
    assert len(rows["system/process_rss_megabytes"]) == 1  # what it had sampled is kept
    warnings = capfd.readouterr().err.strip().splitlines()
    assert warnings == [
        "shardfuse.sysmetrics: warning: rank 5: system metrics sampling stopped "
        "(OSError: /proc went away); training goes on"
    ]
    assert sampler.error == "OSError: /proc went away"


def test_a_consolidation_that_fails_warns_and_keeps_the_records_for_the_training_to_finish(tmp_path, capfd):
    sampler = SystemSampler(tmp_path, rank=0, interval_s=3600).start()
    sampler.final_path.mkdir()  # the Parquet file cannot be written where a directory stands
    assert sampler.consolidate() is None
    assert len(read_rows(sampler.path)) == 2
    assert "shardfuse.sysmetrics: warning: rank 0: system metrics not consolidated" in capfd.readouterr().err


def test_interval_comes_from_the_environment_and_zero_turns_sampling_off(tmp_path, monkeypatch, capfd):
    assert interval_from_env() == 5.0
    monkeypatch.setenv(INTERVAL_ENV, "0.25")
    assert SystemSampler(tmp_path, rank=0).interval_s == 0.25
    monkeypatch.setenv(INTERVAL_ENV, "0")
    off = SystemSampler(tmp_path, rank=0).start()
    assert not off.enabled and off._thread is None and off.consolidate() is None
    assert list(tmp_path.iterdir()) == []
    monkeypatch.setenv(INTERVAL_ENV, "often")
    assert interval_from_env() == 5.0
    assert "is not a number of seconds" in capfd.readouterr().err


def test_peak_is_the_largest_value_of_each_metric_over_the_ranks_given():
    rank0 = {"system/a": np.array([[1.0, 3.0], [2.0, 9.0]]), "system/b": np.array([[1.0, -1.0]])}
    rank1 = {"system/a": np.array([[1.0, 4.0]]), "system/c": np.empty((0, 2))}
    assert peak(rank0, rank1) == {"system/a": 9.0, "system/b": -1.0}
    assert peak() == {}


def mlflow_system_metric_names() -> set[str]:
    """The metric names MLflow's own CPU and GPU monitors log, read from the installed package (GPU
    names with their index as ``{i}``)."""
    package = Path(importlib.util.find_spec("mlflow").origin).parent  # found, not imported (slow)
    names = set()
    for module in ("cpu_monitor.py", "gpu_monitor.py"):
        source = (package / "system_metrics" / "metrics" / module).read_text()
        names |= set(re.findall(r'_metrics\[f?"([a-z_{}0-9]+)"\]', source))
    return names


def test_names_are_mlflows_own_where_they_mean_the_same():
    mlflow_names = mlflow_system_metric_names()
    assert {"cpu_utilization_percentage", "gpu_{i}_utilization_percentage"} <= mlflow_names  # parsed
    ours = {
        sysmetrics.metric_name(column, "{i}")
        for column in COLUMNS
        if column not in ("timestamp_ms", "gpu_index")
    }
    shared = {name for name in ours if name.removeprefix("system/") in mlflow_names}
    assert {name.removeprefix("system/") for name in ours - shared} == {
        "system_memory_total_megabytes",  # MLflow logs no total
        "process_cpu_utilization_percentage",  # the rank's own process: MLflow samples the machine only
        "process_rss_megabytes",
    }
    assert len(shared) == 6
