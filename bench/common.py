"""Shared helpers of the benchmarks: measured child processes, medians, machine info, Markdown tables.

Every timed command runs in its own child process, measured with ``os.wait4``: wall time from just
before the fork to the exit, the child's peak RSS (``ru_maxrss``) and its CPU time (``ru_utime +
ru_stime``); both cover the grandchildren it waited for, e.g. torchrun's ranks. Baselines run
interleaved with what they are compared to, so a busy machine slows both alike; results are medians of
the repetitions.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PYTHON = sys.executable


def child_env(**extra: str) -> dict[str, str]:
    """This checkout's src first on PYTHONPATH, the interpreter's bin dir first on PATH."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO / "src"), env.get("PYTHONPATH")]))
    env["PATH"] = os.pathsep.join([str(Path(PYTHON).parent), env.get("PATH", "")])
    env.update(extra)
    return env


@dataclass(frozen=True)
class Measured:
    seconds: float
    peak_rss_mb: float
    stdout: str
    returncode: int = 0
    cpu_seconds: float = 0.0  # user + system of the command and the descendants it waited for


# A child's ru_maxrss starts at its parent's RSS when it forks (Linux keeps the pre-exec high-water
# mark), so a benchmark process holding torch would lend every child its own RSS. A bare interpreter
# (-I -S: next to nothing to lend) forks the measured command instead and reports wall time and the
# command's rusage.
_WRAPPER = """
import json, os, subprocess, sys, time
started = time.perf_counter()
proc = subprocess.Popen(sys.argv[2:])
_, status, usage = os.wait4(proc.pid, 0)
seconds = time.perf_counter() - started
proc.returncode = os.waitstatus_to_exitcode(status)
with open(sys.argv[1], "w") as fh:
    json.dump({"seconds": seconds, "maxrss_kb": usage.ru_maxrss, "returncode": proc.returncode,
               "cpu_seconds": usage.ru_utime + usage.ru_stime}, fh)
"""


def measure(
    cmd: Sequence[object], cwd: Path | None = None, env: dict[str, str] | None = None, check: bool = True
) -> Measured:
    """Run ``cmd`` to completion; its wall time and peak RSS (stdout and stderr captured together).
    A failure raises with the output's tail, unless ``check`` is false."""
    with tempfile.TemporaryDirectory(prefix="shardfuse-measure-") as tmp:
        report = Path(tmp) / "report.json"
        proc = subprocess.run(
            [PYTHON, "-I", "-S", "-c", _WRAPPER, report, *map(str, cmd)],
            cwd=cwd,
            env=env or child_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        result = json.loads(report.read_text())
    output = proc.stdout
    if check and result["returncode"] != 0:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({result['returncode']}):\n{output[-3000:]}")
    return Measured(
        result["seconds"], result["maxrss_kb"] / 1024, output, result["returncode"], result["cpu_seconds"]
    )


READY = "ready"


def run_together(cmds: Sequence[Sequence[object]], env: dict[str, str] | None = None) -> list[str]:
    """Run ``cmds`` at the same time, each in its own process, and return each one's stdout after
    its ``READY`` line. Every command prints a line ``READY`` once its start-up is done (interpreter,
    imports, warm-up) and then waits for a line on stdin; all are released together, so the work
    after READY overlaps in full. Started one after the other they would overlap only partly: a
    start-up takes longer than the short work measured after it."""
    procs = [
        subprocess.Popen(
            list(map(str, cmd)),
            env=env or child_env(),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for cmd in cmds
    ]
    try:
        for proc in procs:
            line = proc.stdout.readline()
            if line.strip() != READY:
                raise RuntimeError(
                    f"{_short(proc.args)} did not get ready: {line!r} {proc.stderr.read()[-3000:]}"
                )
        for proc in procs:
            proc.stdin.write("go\n")
            proc.stdin.flush()
        outputs = [proc.communicate() for proc in procs]
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    for proc, (_, stderr) in zip(procs, outputs, strict=True):
        if proc.returncode != 0:
            raise RuntimeError(f"{_short(proc.args)} failed ({proc.returncode}):\n{stderr[-3000:]}")
    return [stdout for stdout, _ in outputs]


def _short(args: Sequence[object]) -> str:
    """A command line cut to fit an error message (``python -c`` scripts are long)."""
    text = " ".join(map(str, args))
    return text if len(text) <= 200 else text[:200] + " ..."


def load_average() -> str:
    """The 1-minute load average now, for a note beside figures that two busy cores would skew."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except OSError:
        return "n/a"


def python_cmd(*args: object) -> list[object]:
    return [PYTHON, *args]


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def verdict(ok: bool) -> str:
    return "PASS" if ok else "FAIL"


def table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A Markdown table; floats get 3 significant digits (enough for noisy timings)."""

    def cell(value: object) -> str:
        if isinstance(value, float):
            return f"{value:,.3g}" if abs(value) < 1000 else f"{value:,.0f}"
        return str(value)

    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _ram_gib() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return float("nan")


def machine_info() -> dict[str, str]:
    import numpy
    import pyarrow
    import torch

    try:
        load = " / ".join(f"{v:.2f}" for v in os.getloadavg())
    except OSError:
        load = "n/a"
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
    return {
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "cpu": _cpu_model(),
        "cores": str(os.cpu_count()),
        "ram": f"{_ram_gib():.1f} GiB",
        "gpu": gpu,
        "load average (1/5/15 min) at start": load,
        "os": platform.platform(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "pyarrow": pyarrow.__version__,
        "numpy": numpy.__version__,
    }


def dir_bytes(path: Path) -> int:
    return sum(p.stat().st_size for p in Path(path).rglob("*") if p.is_file())


def remove(path: Path) -> None:
    if Path(path).is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        Path(path).unlink(missing_ok=True)


def write_json(path: Path, obj: object) -> None:
    Path(path).write_text(json.dumps(obj, indent=2) + "\n")


def synthetic_spec(
    num_rows: int, num_features: int, test_fraction: float = 0.01, val_fraction: float | None = 0.0
) -> dict:
    """A spec for prepare's synthetic source (10 classes, seed 0). ``val_fraction`` None keeps prepare's
    default; it is left out where this checkout's prepare does not know the key yet."""
    try:  # the source's record says which keys it takes
        from shardfuse.data.sources.registry import find_source

        known = find_source("synthetic").allowed()
    except ImportError:  # a checkout from before the records carried the keys: prepare's table
        from shardfuse.prepare import SOURCE_KEYS

        known = set().union(*SOURCE_KEYS["synthetic"])
    spec = {
        "source": "synthetic",
        "num_rows": num_rows,
        "num_features": num_features,
        "num_classes": 10,
        "seed": 0,
        "test_fraction": test_fraction,
    }
    if val_fraction is not None and "val_fraction" in known:
        spec["val_fraction"] = val_fraction
    return spec


def make_dataset(out_dir: Path, num_rows: int, num_features: int, test_fraction: float = 0.01) -> Measured:
    """``shardfuse.prepare`` of a synthetic dataset into ``out_dir`` (measured: wall time, peak RSS)."""
    spec = json.dumps(synthetic_spec(num_rows, num_features, test_fraction=test_fraction))
    return measure(
        python_cmd("-m", "shardfuse.prepare", "--name", "bench", "--spec-json", spec, "--out-dir", out_dir)
    )


def make_shards(dataset: Path, world_size: int, out_dir: Path) -> Path:
    """``shardfuse.partition`` of ``dataset``/train.parquet into ``world_size`` shards (seed 0)."""
    measure(
        python_cmd(
            "-m", "shardfuse.partition", "--input", Path(dataset) / "train.parquet",
            "--world-size", world_size, "--seed", 0, "--out-dir", out_dir,
        )
    )  # fmt: skip
    return Path(out_dir)


TOKEN_VOCAB_SIZE = 50_257  # GPT-2's: ids need uint16, as prepare stores them under 65536
TOKEN_BLOCK_ROWS = 65_536  # blocks per row group of a written corpus


def write_token_corpus(path: Path, num_blocks: int, block_size: int = 256, seed: int = 0) -> Path:
    """A causal-LM split as prepare writes it: one ``tokens`` column, fixed_size_list<uint16>[block_size
    + 1], uniformly random ids (no repeats to exploit: the worst case for size). Written a row group at
    a time, so a ~1 GB corpus needs ~35 MB here."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.parquet as pq

    rng = np.random.default_rng(seed)
    width = block_size + 1
    schema = pa.schema([pa.field("tokens", pa.list_(pa.uint16(), width))])
    with pq.ParquetWriter(path, schema) as writer:
        for start in range(0, num_blocks, TOKEN_BLOCK_ROWS):
            count = min(TOKEN_BLOCK_ROWS, num_blocks - start)
            ids = pa.array(rng.integers(0, TOKEN_VOCAB_SIZE, count * width, dtype=np.uint16))
            writer.write_table(pa.table({"tokens": pa.FixedSizeListArray.from_arrays(ids, width)}))
    return Path(path)
