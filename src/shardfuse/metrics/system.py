"""Per-rank system metrics (CPU, memory and, where NVML is present, the rank's GPU), sampled off the
training thread for MLflow's System metrics tab.

Each rank's :class:`SystemSampler` runs a daemon thread that takes a sample when it starts, every
``interval_s`` seconds (default 5 s; the environment variable ``SHARDFUSE_SYSTEM_METRICS_INTERVAL``
overrides it, ``0`` turns sampling off) and once more when it stops, so even a short run has two. A
sample reads /proc and NVML only (no torch, no RNG): this process's CPU time and resident memory, the
machine's CPU and memory, and, when ``pynvml`` (the nvidia-ml-py package) imports and ``nvmlInit``
succeeds, the utilisation and memory of the rank's own GPU. Without NVML the GPU columns are simply
absent. What sampling costs a training step is measured by bench/logging_overhead.py (figures in
bench/RESULTS.md).

Samples go to ``metrics/system-rank-{rank}.f64`` as fixed-size little-endian float64 records of
:data:`COLUMNS` (one ``write`` a sample, as :mod:`shardfuse.metrics.steps` does for step metrics), so a
kill keeps every whole record. Unlike the step metrics, a resumed run appends: the machine was really
used by every attempt, so the samples of all attempts are kept, told apart by their timestamps (a
record cut by a kill is cut off first, so what follows stays aligned). At the end of training
:meth:`SystemSampler.consolidate` writes ``metrics/system-rank-{rank}.parquet`` (atomically; the
record file goes), which :func:`read_system_metrics` turns into MLflow metric names for the tracker.

Names are MLflow's own system-metric names (``mlflow/system_metrics/metrics``) where they mean the
same (``system/cpu_utilization_percentage`` is the whole machine's CPU, 0-100; megabytes are 1e6
bytes; memory used is total - available, as psutil computes it), plus ``system/process_...`` for this
rank's process (CPU 100 = one core). The GPU columns become ``system/gpu_{i}_...`` with ``i`` the NVML
index of the rank's GPU, as MLflow's GPU monitor numbers them.

By hand (samples this Python process every second for five seconds)::

    python -c "import time, pathlib; from shardfuse.metrics.system import *; \\
        s = SystemSampler(pathlib.Path('/tmp/m'), 0, interval_s=1).start(); time.sleep(5); \\
        print(peak(read_system_metrics(s.consolidate())))"
"""

from __future__ import annotations

import contextlib
import math
import os
import struct
import sys
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from shardfuse.io import atomic_path

INTERVAL_ENV = "SHARDFUSE_SYSTEM_METRICS_INTERVAL"
DEFAULT_INTERVAL_S = 5.0
PREFIX = "system/"
# Record columns in file order. Every name but timestamp_ms and gpu_index is its metric's name less
# PREFIX; a gpu_<rest> column becomes system/gpu_{gpu_index}_<rest>.
COLUMNS = (
    "timestamp_ms",
    "cpu_utilization_percentage",  # the whole machine, 0-100 (MLflow's meaning)
    "system_memory_usage_megabytes",  # MemTotal - MemAvailable
    "system_memory_usage_percentage",
    "system_memory_total_megabytes",
    "process_cpu_utilization_percentage",  # this rank's process, 100 = one core
    "process_rss_megabytes",
    "gpu_index",  # NVML index of the rank's GPU; NaN without NVML
    "gpu_utilization_percentage",
    "gpu_memory_usage_megabytes",
    "gpu_memory_usage_percentage",
)
GPU_COLUMNS = COLUMNS[COLUMNS.index("gpu_index") :]
RECORD = np.dtype("<f8")
RECORD_BYTES = RECORD.itemsize * len(COLUMNS)
RECORD_STRUCT = struct.Struct(f"<{len(COLUMNS)}d")
MEGABYTE = 1e6  # as MLflow's monitors count


def interval_from_env(default: float = DEFAULT_INTERVAL_S) -> float:
    """Seconds between samples: ``SHARDFUSE_SYSTEM_METRICS_INTERVAL`` when set (0 = off), else ``default``."""
    text = os.environ.get(INTERVAL_ENV, "").strip()
    if not text:
        return default
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        _warn(f"{INTERVAL_ENV}={text!r} is not a number of seconds >= 0; sampling every {default:g} s")
        return default
    return value


def system_metrics_path(metrics_dir: Path, rank: int) -> Path:
    """The consolidated file of ``rank`` (``<train dir>/metrics/system-rank-{rank}.parquet``)."""
    return metrics_dir / f"system-rank-{rank}.parquet"


def metric_name(column: str, gpu_index: int | None = None) -> str:
    """The MLflow name of a record column (a GPU column needs the GPU's NVML index)."""
    if column in GPU_COLUMNS:
        return f"{PREFIX}gpu_{gpu_index}_{column[len('gpu_') :]}"
    return PREFIX + column


class SystemSampler:
    """``start`` (or ``with``) the sampling thread; ``consolidate`` at the end of training.

    ``gpu`` is the rank's CUDA device ordinal (``None`` on a CPU rank: no GPU columns). Nothing here
    raises into training: an error in the thread stops sampling with one warning line, ``stop`` waits
    for the thread at most ``join_timeout`` seconds, and a sampler with ``interval_s == 0`` does
    nothing at all (the do-nothing twin for ``--no-step-metrics``).
    """

    def __init__(
        self,
        metrics_dir: Path,
        rank: int,
        gpu: int | None = None,
        interval_s: float | None = None,
        join_timeout: float = 5.0,
    ) -> None:
        self.interval_s = interval_from_env() if interval_s is None else interval_s
        self.enabled = self.interval_s > 0
        self.rank, self.gpu, self.join_timeout = rank, gpu, join_timeout
        self.path = metrics_dir / f"system-rank-{rank}.f64"
        self.final_path = system_metrics_path(metrics_dir, rank)
        self.num_samples = 0
        self.cpu_seconds = 0.0  # the thread's CPU time inside samples (bench/logging_overhead.py)
        self.error: str | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> SystemSampler:
        if self.enabled and self._thread is None:
            self._thread = threading.Thread(target=self._run, name="shardfuse-sysmetrics", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        """Take the last sample and end the thread (waiting at most ``join_timeout`` s)."""
        if self._thread is None or self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(self.join_timeout)
        if self._thread.is_alive():
            _warn(f"rank {self.rank}: system metrics sampler busy after {self.join_timeout:g} s; left behind")

    def consolidate(self) -> Path | None:
        """Stop, then write every sample of every attempt to the Parquet file in time order; the record
        file goes. ``None`` when sampling is off, or (with a warning, the record file kept) when the
        file could not be written: losing the system metrics must not fail a finished training."""
        self.stop()
        if not self.enabled:
            return None
        try:
            return self._consolidate()
        except Exception as exc:
            _warn(f"rank {self.rank}: system metrics not consolidated ({type(exc).__name__}: {exc})")
            return None

    def _consolidate(self) -> Path:
        rows = read_rows(self.path)
        if self.final_path.is_file():
            # An attempt that consolidated and was killed before the training finished: keep its samples
            # (a kill between the write and the unlink leaves them in both files: exact duplicates go).
            rows = _distinct(np.concatenate([read_rows(self.final_path), rows]))
        rows = rows[np.argsort(rows[:, 0], kind="stable")]
        columns = {name: rows[:, j] for j, name in enumerate(COLUMNS)}
        columns["timestamp_ms"] = columns["timestamp_ms"].astype(np.int64)
        if np.isnan(columns["gpu_index"]).all():  # no NVML: no GPU columns at all
            columns = {name: values for name, values in columns.items() if name not in GPU_COLUMNS}
        self.final_path.parent.mkdir(parents=True, exist_ok=True)
        with atomic_path(self.final_path) as tmp:
            pq.write_table(pa.table(columns), tmp)
        self.path.unlink(missing_ok=True)
        return self.final_path

    def __enter__(self) -> SystemSampler:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # Sampling thread ---------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            with _open_records(self.path) as fd, contextlib.closing(_Probe(self.gpu)) as probe:
                self._sample(fd, probe)
                while not self._stop.wait(self.interval_s):
                    self._sample(fd, probe)
                self._sample(fd, probe)
        except Exception as exc:  # never into training: sampling stops, training goes on
            self.error = f"{type(exc).__name__}: {exc}"
            _warn(f"rank {self.rank}: system metrics sampling stopped ({self.error}); training goes on")

    def _sample(self, fd: int, probe: _Probe) -> None:
        started = time.thread_time()
        os.write(fd, RECORD_STRUCT.pack(*probe.sample()))
        self.num_samples += 1
        self.cpu_seconds += time.thread_time() - started


@contextlib.contextmanager
def _open_records(path: Path):
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        # A kill can cut the last record: drop its bytes, or every record appended after it is misread.
        size = os.fstat(fd).st_size
        if size % RECORD_BYTES:
            os.ftruncate(fd, size - size % RECORD_BYTES)
        yield fd
    finally:
        os.close(fd)


class _Probe:
    """Reads one sample. CPU figures are the change since the previous sample; the first averages over
    the process's life (since boot for the machine's), so it needs no warm-up sample. The /proc files
    stay open and are re-read with ``pread``, cheaper than opening them for every sample."""

    def __init__(self, gpu: int | None) -> None:
        self.ticks = os.sysconf("SC_CLK_TCK")
        self.page_megabytes = os.sysconf("SC_PAGE_SIZE") / MEGABYTE
        self.files: dict[str, int] = {}
        for name in ("/proc/self/stat", "/proc/self/statm", "/proc/stat", "/proc/meminfo"):
            self.files[name] = os.open(name, os.O_RDONLY)
        with open("/proc/uptime", "rb") as file:
            uptime = float(file.read().split()[0])
        self.last_wall = time.monotonic() - (uptime - int(self._process_stat()[19]) / self.ticks)
        self.last_process_cpu = self.last_busy = self.last_total = 0.0
        self.gpu = _Gpu.open(gpu)

    def _read(self, name: str) -> bytes:
        return os.pread(self.files[name], 65536, 0)

    def _process_stat(self) -> list[bytes]:
        """Fields of /proc/self/stat after the command name (which may hold spaces): [0] is field 3."""
        text = self._read("/proc/self/stat")
        return text[text.rindex(b")") + 2 :].split()

    def sample(self) -> list[float]:
        timestamp_ms = math.floor(time.time() * 1000)
        now = time.monotonic()
        stat = self._process_stat()
        process_cpu = (int(stat[11]) + int(stat[12])) / self.ticks  # utime + stime
        process_percent = 100 * (process_cpu - self.last_process_cpu) / max(now - self.last_wall, 1e-6)
        self.last_process_cpu, self.last_wall = process_cpu, now

        # The first line: "cpu user nice system idle iowait irq softirq steal guest guest_nice" (ticks;
        # guest time is counted in user already).
        ticks = [int(word) for word in self._read("/proc/stat").split(b"\n", 1)[0].split()[1:9]]
        total, busy = sum(ticks), sum(ticks) - ticks[3] - ticks[4]  # less idle and iowait
        cpu_percent = 100 * (busy - self.last_busy) / max(total - self.last_total, 1)
        self.last_busy, self.last_total = busy, total

        meminfo = _meminfo(self._read("/proc/meminfo"))
        mem_total = meminfo[b"MemTotal"] * 1024 / MEGABYTE
        mem_used = mem_total - meminfo[b"MemAvailable"] * 1024 / MEGABYTE
        rss = int(self._read("/proc/self/statm").split()[1]) * self.page_megabytes  # resident pages
        gpu = self.gpu.sample() if self.gpu is not None else [math.nan] * len(GPU_COLUMNS)
        mem_percent = 100 * mem_used / mem_total
        return [timestamp_ms, cpu_percent, mem_used, mem_percent, mem_total, process_percent, rss, *gpu]

    def close(self) -> None:
        for fd in self.files.values():
            os.close(fd)
        self.files.clear()
        if self.gpu is not None:
            self.gpu.close()


class _Gpu:
    """The rank's GPU through NVML. ``open`` gives ``None`` when NVML is missing or fails."""

    def __init__(self, nvml: Any, handle: Any) -> None:
        self.nvml, self.handle = nvml, handle
        self.index = float(nvml.nvmlDeviceGetIndex(handle))

    @classmethod
    def open(cls, ordinal: int | None) -> _Gpu | None:
        if ordinal is None:
            return None
        try:
            import pynvml

            pynvml.nvmlInit()
        except Exception:  # not installed, no driver or no GPU: no GPU columns
            return None
        try:
            return cls(pynvml, _nvml_handle(pynvml, ordinal))
        except Exception:
            with contextlib.suppress(Exception):
                pynvml.nvmlShutdown()
            return None

    def sample(self) -> list[float]:
        memory = self.nvml.nvmlDeviceGetMemoryInfo(self.handle)
        utilisation = self.nvml.nvmlDeviceGetUtilizationRates(self.handle)
        return [self.index, float(utilisation.gpu), memory.used / MEGABYTE, 100 * memory.used / memory.total]

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.nvml.nvmlShutdown()


def _nvml_handle(nvml: Any, ordinal: int) -> Any:
    """NVML's handle of CUDA device ``ordinal``: NVML ignores CUDA_VISIBLE_DEVICES, so map through it
    (indices or GPU-/MIG- UUIDs). CUDA and NVML agree on the order when CUDA_DEVICE_ORDER=PCI_BUS_ID,
    and on machines with one model of GPU."""
    visible = [
        entry.strip() for entry in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if entry.strip()
    ]
    entry = visible[ordinal] if ordinal < len(visible) else str(ordinal)
    if entry.isdigit():
        return nvml.nvmlDeviceGetHandleByIndex(int(entry))
    return nvml.nvmlDeviceGetHandleByUUID(entry)


def _meminfo(text: bytes) -> dict[bytes, float]:
    """MemTotal and MemAvailable of /proc/meminfo, in kB (KiB)."""
    found = {}
    for line in text.splitlines():
        key, _, rest = line.partition(b":")
        if key in (b"MemTotal", b"MemAvailable"):
            found[key] = float(rest.split()[0])
    return found


def _distinct(rows: np.ndarray) -> np.ndarray:
    """``rows`` without exact repeats (NaN equal to NaN), in their first order."""
    filled = np.ascontiguousarray(np.where(np.isnan(rows), -np.inf, rows))
    _, first = np.unique(filled.view(np.dtype((np.void, RECORD_BYTES))).ravel(), return_index=True)
    return rows[np.sort(first)]


def _warn(message: str) -> None:
    print(f"shardfuse.sysmetrics: warning: {message}", file=sys.stderr, flush=True)


# Reading -------------------------------------------------------------------------------------------


def read_rows(path: Path) -> np.ndarray:
    """The samples of a record file (whole records only: one cut by a kill is left out) or of a
    consolidated Parquet file, as an (n, len(COLUMNS)) float64 array (NaN where a column is absent)."""
    if path.suffix == ".parquet":
        table = pq.read_table(path)
        return np.stack(
            [
                table.column(name).to_numpy().astype(np.float64)
                if name in table.column_names
                else np.full(table.num_rows, math.nan)
                for name in COLUMNS
            ],
            axis=1,
        ).reshape(-1, len(COLUMNS))
    data = path.read_bytes() if path.is_file() else b""
    values = np.frombuffer(data, dtype=RECORD, count=(len(data) // RECORD_BYTES) * len(COLUMNS))
    return values.astype(np.float64).reshape(-1, len(COLUMNS))


def read_system_metrics(path: Path) -> dict[str, np.ndarray]:
    """Per MLflow metric name (``system/...``), an (n, 2) float64 array of (timestamp_ms, value) rows
    in time order, from ``metrics/system-rank-{rank}.parquet`` (or the ``.f64`` record file of a run
    that has not finished). Metrics never sampled (the GPU's without NVML) are absent."""
    rows = read_rows(path)
    rows = rows[np.argsort(rows[:, 0], kind="stable")]
    timestamps = rows[:, 0]
    metrics: dict[str, np.ndarray] = {}
    gpu_indices = rows[:, COLUMNS.index("gpu_index")]
    for j, column in enumerate(COLUMNS):
        if column in ("timestamp_ms", "gpu_index"):
            continue
        groups = (
            [(int(index), gpu_indices == index) for index in np.unique(gpu_indices[~np.isnan(gpu_indices)])]
            if column in GPU_COLUMNS
            else [(None, np.ones(len(rows), dtype=bool))]
        )
        for index, selected in groups:
            keep = selected & ~np.isnan(rows[:, j])
            if keep.any():
                metrics[metric_name(column, index)] = np.stack([timestamps[keep], rows[keep, j]], axis=1)
    return metrics


def peak(*metrics: dict[str, np.ndarray]) -> dict[str, float]:
    """The largest value of each metric over all the given :func:`read_system_metrics` results: pass
    every rank of one host for that node's peak."""
    peaks: dict[str, float] = {}
    for one in metrics:
        for name, rows in one.items():
            if len(rows):
                peaks[name] = max(peaks.get(name, -math.inf), float(rows[:, 1].max()))
    return peaks
