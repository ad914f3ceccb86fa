"""Benchmark the streaming merge engine against loading every checkpoint fully and averaging.

    python bench/merge.py                      # 100 MB models, N = 2, 4, 8, 16 ranks, 3 repetitions
    python bench/merge.py --sizes-mb 100 --ranks 2,8 --regimes cold
    python bench/merge.py --quick              # CI smoke: 8 MB models, N = 2, 4 (cold: 4), once (< 30 s)

For each model size and N it writes N rank checkpoints (a few big float32 tensors, small ones, an int64
counter) under --dir (default: a temporary directory in /tmp, removed afterwards) plus a gather.json,
then runs, each in a fresh child process, interleaved and repeated:
  stream    shardfuse.merge.merge(method="uniform") on a gather.json of format version 2: explicit reads,
            block by block, every input's BLAKE3 checked (hashed in the engine's worker threads)
  sha256    the same on the gather.json of before format version 2 (sha256 checks): what it cost
  baseline  safetensors.torch.load_file of every rank, float64 mean in memory, save_file (no checks)
  mmap      the streaming loop but reading through safetensors.safe_open (memory-mapped): shows whether
            touched file pages inflate RSS with N (they do: the reason stream uses explicit reads)
  nohash    the stream engine with the input checks switched off: what verification costs
  floor     read every rank file once (FLOOR_THREADS files at a time, 4 MiB reads, sequential advice;
            no hashing, no math, no output): the time no merge of these files can beat
in two regimes (--regimes, default both):
  warm      the rank files in the page cache (read once before the repetition): every variant; the floor
            is then a copy out of memory
  cold      the rank files evicted from the page cache before each child (os.sync, then
            posix_fadvise(POSIX_FADV_DONTNEED) on each, which needs no privilege for clean pages):
            stream, nohash, baseline and floor read from the disk; the floor is the disk's. Eviction
            is checked with util-linux's fincore (the most MiB of the files still resident is reported)
Seconds are the merge itself, measured inside the child (interpreter start and imports excluded: the
baseline's `import torch` alone would dominate; its time is in bench/RESULTS.md); peak RSS is the
child's VmHWM, imports included (not ru_maxrss: a forked child's ru_maxrss includes the parent's RSS
from before its exec).
Targets: stream peak RSS <= 1.5 x model + 64 MB at every N; at N = 8, stream (verified) >= 3x faster than
baseline (warm, as since the first run of this benchmark) and <= 1.3x the floor of the disk (cold); the
other two ratios are printed with their verdicts too, and the exit status counts these three. Ratios are
paired per repetition, then the median taken. Sizes and RSS are in MiB (2**20 bytes): "100 MB" models
hold at least 100 MiB.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import child_env, load_average, machine_info, measure, median, python_cmd, remove, table, verdict

NUM_BIG = 4
SMALL_SHAPES = [(1024,), (4096,), (256, 64), (10,), (512, 3)] * 4
SPEC = {
    "type": "mlp",
    "num_features": 4,
    "num_classes": 3,
    "hidden_sizes": [],
    "activation": "relu",
    "dropout": 0,
}


# ---------------------------------------------------------------- fixtures


def write_ranks(root: Path, size_mb: int, num_ranks: int) -> dict:
    """Rank checkpoints of a model of ``size_mb`` MB and a gather.json listing all of them."""
    from safetensors.numpy import save_file

    from shardfuse.checkpoints.stream import SafetensorsReader
    from shardfuse.io import file_digests

    small = sum(int(np.prod(shape)) for shape in SMALL_SHAPES)
    big = -(-(size_mb * 2**20 // 4 - small - 1) // NUM_BIG)  # at least size_mb MiB in all
    ranks = []
    for rank in range(num_ranks):
        gen = np.random.default_rng(rank)
        tensors = {f"layer{i}.weight": gen.standard_normal(big, dtype=np.float32) for i in range(NUM_BIG)}
        tensors.update(
            {f"small{i}": gen.standard_normal(s, dtype=np.float32) for i, s in enumerate(SMALL_SHAPES)}
        )
        tensors["steps"] = np.array([1000], dtype=np.int64)  # identical counter: copied from rank 0
        meta = {"run": "bench", "rank": rank, "rows": 100 + rank, "num_steps": 1000, "model": SPEC}
        path = root / f"rank-{rank}.safetensors"
        save_file(tensors, str(path), metadata={"shardfuse": json.dumps(meta, sort_keys=True)})
        del tensors
        ranks.append(
            {
                "rank": rank,
                "path": str(path),
                **file_digests(path, ("sha256", "blake3")),
                "bytes": path.stat().st_size,
                "rows": 100 + rank,
                "num_steps": 1000,
            }
        )
    with SafetensorsReader(ranks[0]["path"]) as reader:
        header = reader.header()
    return {
        "format_version": 2,
        "hash": "blake3",
        "run": "bench",
        "model": SPEC,
        "base": "",
        "tensors": header,
        "ranks": ranks,
    }


def gather_for(root: Path, record: dict, num_ranks: int, version: int = 2) -> Path:
    """gather.json of the first ``num_ranks`` ranks; version 1: sha256 only, as gather wrote it before."""
    record = {**record, "world_size": num_ranks, "ranks": record["ranks"][:num_ranks]}
    if version == 1:
        record = {k: v for k, v in record.items() if k not in ("format_version", "hash")}
        record["ranks"] = [{k: v for k, v in r.items() if k != "blake3"} for r in record["ranks"]]
    path = root / f"gather-{num_ranks}-v{version}.json"
    path.write_text(json.dumps(record))
    return path


# ---------------------------------------------------------------- the page cache


def evict(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache: written back first (os.sync: dirty pages cannot be dropped),
    then POSIX_FADV_DONTNEED, which any process may ask for a file it can open."""
    os.sync()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def warm_up(paths: list[str]) -> None:
    """Read ``paths`` once, so that they are in the page cache."""
    buffer = bytearray(16 << 20)
    for path in paths:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buffer):
                pass


def resident_mb(paths: list[str]) -> float | None:
    """MiB of ``paths`` in the page cache (util-linux fincore); None where fincore is missing."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(
        ["fincore", "--bytes", "--raw", "--noheadings", "--output", "RES", *paths],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    return sum(int(line) for line in out.split()) / 2**20


# ---------------------------------------------------------------- children (one measurement each)


def _status_mb(key: str) -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def child_stream(gather: Path, out: Path) -> float:
    from shardfuse.merge import merge

    started = time.perf_counter()
    merge(gather, "uniform", out, out.with_suffix(".json"))
    return time.perf_counter() - started


def child_sha256(gather: Path, out: Path) -> float:
    """stream on the version-1 gather.json beside ``gather``: every input's sha256 checked."""
    return child_stream(gather.with_name(gather.name.replace("-v2", "-v1")), out)


FLOOR_THREADS = 4  # files read at once by the floor: one thread left this disk idle half the time


def child_floor(gather: Path, out: Path) -> float:
    """Read every rank file once, the fastest plain way we found here: FLOOR_THREADS files at a time,
    each front to back in 4 MiB reads into its thread's buffer, with sequential-access advice (larger
    readahead). The floor under any verified merge, cold (the disk's) or warm (a copy out of memory)."""
    from concurrent.futures import ThreadPoolExecutor

    def read(path: str) -> None:
        buffer = bytearray(4 << 20)
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            offset = 0
            while got := os.preadv(fd, [buffer], offset):
                offset += got
        finally:
            os.close(fd)

    paths = [r["path"] for r in json.loads(gather.read_text())["ranks"]]
    started = time.perf_counter()
    with ThreadPoolExecutor(max_workers=FLOOR_THREADS) as pool:
        list(pool.map(read, paths))
    return time.perf_counter() - started


def child_nohash(gather: Path, out: Path) -> float:
    """The stream engine without the input checksums: what verification costs."""
    from shardfuse.checkpoints.stream import SafetensorsReader, SafetensorsWriter
    from shardfuse.fusion.engine import Engine

    ranks = json.loads(gather.read_text())["ranks"]
    started = time.perf_counter()
    readers = [SafetensorsReader(r["path"], hash_reads=False) for r in ranks]
    entries = {name: (t.dtype.name, list(t.shape)) for name, t in readers[0].tensors.items()}
    writer = SafetensorsWriter(out, entries, None)
    Engine(readers, None, "uniform", {}, [r["rank"] for r in ranks]).run(writer.names, writer)
    writer.close()
    return time.perf_counter() - started


def child_baseline(gather: Path, out: Path) -> float:
    import torch
    from safetensors.torch import load_file, save_file

    paths = [r["path"] for r in json.loads(gather.read_text())["ranks"]]
    started = time.perf_counter()
    states = [load_file(path) for path in paths]
    merged = {}
    for name, first in states[0].items():
        if not first.is_floating_point():
            merged[name] = first
            continue
        total = first.to(torch.float64)
        for state in states[1:]:
            total += state[name]
        merged[name] = (total / len(states)).to(first.dtype)
    save_file(merged, str(out))
    return time.perf_counter() - started


def child_mmap(gather: Path, out: Path) -> float:
    from safetensors import safe_open

    from shardfuse.checkpoints.stream import SafetensorsReader, SafetensorsWriter

    paths = [r["path"] for r in json.loads(gather.read_text())["ranks"]]
    started = time.perf_counter()
    with SafetensorsReader(paths[0]) as first:
        entries = {name: (t.dtype.name, list(t.shape)) for name, t in first.tensors.items()}
    handles = [safe_open(path, framework="numpy") for path in paths]
    writer = SafetensorsWriter(out, entries, None)
    for name in writer.names:
        values = handles[0].get_tensor(name)
        if values.dtype.kind == "f":
            total = values.astype(np.float64)
            for handle in handles[1:]:
                total += handle.get_tensor(name)
            values = (total / len(handles)).astype(values.dtype)
        writer.write(name, values.reshape(-1).view(np.uint8))
    writer.close()
    return time.perf_counter() - started


CHILDREN = {
    "stream": child_stream,
    "baseline": child_baseline,
    "mmap": child_mmap,
    "nohash": child_nohash,
    "sha256": child_sha256,
    "floor": child_floor,
}


def run_child(kind: str, gather: Path, out: Path) -> None:
    seconds = CHILDREN[kind](gather, out)
    print(json.dumps({"seconds": seconds, "peak_rss_mb": _status_mb("VmHWM")}))


# ---------------------------------------------------------------- the benchmark


REGIMES = {  # regime: the variants measured in it
    "warm": tuple(CHILDREN),
    "cold": ("stream", "nohash", "baseline", "floor"),
}
PREFIX = {"warm": "", "cold": "cold_"}  # regime -> the prefix of its keys in a result row
RATIOS = {  # name: (numerator, denominator) of per-repetition time ratios, in every regime both exist
    "speedup": ("baseline", "stream"),
    "speedup_sha256": ("baseline", "sha256"),
    "speedup_nohash": ("baseline", "nohash"),
    "over_floor": ("stream", "floor"),
}


def bench(
    size_mb: int, ranks: list[int], repeats: int, regimes: list[str], root: Path, cold_ranks: list[int]
) -> list[dict]:
    """Measure every N of ``ranks`` in ``regimes`` (cold only at the N of ``cold_ranks``)."""
    print(f"writing {max(ranks)} rank checkpoints of {size_mb} MB in {root} ...", flush=True)
    record = write_ranks(root, size_mb, max(ranks))
    model_mb = record["ranks"][0]["bytes"] / 2**20
    os.sync()  # written back now, not during a measurement (and dirty pages cannot be evicted)
    results = []
    for num_ranks in ranks:
        gather = gather_for(root, record, num_ranks)
        gather_for(root, record, num_ranks, version=1)  # child_sha256's
        paths = [r["path"] for r in record["ranks"][:num_ranks]]
        measured_regimes = [r for r in regimes if r == "warm" or num_ranks in cold_ranks]
        samples: dict[tuple[str, str], list[tuple[float, float]]] = {
            (regime, kind): [] for regime in measured_regimes for kind in REGIMES[regime]
        }
        resident: list[float] = []  # MiB still cached after each eviction
        for repeat in range(repeats):
            for regime in measured_regimes:
                kinds = REGIMES[regime] if repeat % 2 == 0 else REGIMES[regime][::-1]  # alternate the order
                if regime == "warm":
                    warm_up(paths)  # same page-cache state for every warm variant: all files cached
                for kind in kinds:
                    if regime == "cold":
                        evict(paths)
                        mb = resident_mb(paths)
                        resident += [] if mb is None else [mb]
                    out = root / f"out-{kind}.safetensors"
                    measured = measure(python_cmd(__file__, "--child", kind, gather, out), env=child_env())
                    child = json.loads(measured.stdout.strip().splitlines()[-1])
                    # VmHWM of the child's own address space: ru_maxrss would also count the parent's RSS,
                    # which a (v)forked child inherits until it execs.
                    samples[regime, kind].append((child["seconds"], child["peak_rss_mb"]))
                    remove(out)
                    remove(out.with_suffix(".json"))
        row = {"size_mb": size_mb, "model_mb": model_mb, "ranks": num_ranks}
        row["resident_mb"] = max(resident) if resident else None
        row["files_mb"] = sum(Path(path).stat().st_size for path in paths) / 2**20
        for regime in measured_regimes:
            prefix = PREFIX[regime]
            for kind in REGIMES[regime]:
                values = samples[regime, kind]
                row[f"{prefix}{kind}_s"] = median([s for s, _ in values])
                row[f"{prefix}{kind}_rss_mb"] = max(rss for _, rss in values)
            for name, (top, bottom) in RATIOS.items():  # paired per repetition
                if top in REGIMES[regime] and bottom in REGIMES[regime]:
                    pairs = zip(samples[regime, top], samples[regime, bottom], strict=True)
                    row[prefix + name] = median([t / b for (t, _), (b, _) in pairs])
        results.append(row)
        for regime in measured_regimes:
            prefix = PREFIX[regime]
            print(
                f"  N={num_ranks} {regime}: stream {row[prefix + 'stream_s']:.2f} s / "
                f"{row[prefix + 'stream_rss_mb']:.0f} MB, baseline {row[prefix + 'baseline_s']:.2f} s, "
                f"floor {row[prefix + 'floor_s']:.2f} s",
                flush=True,
            )
    return results


def report(results: list[dict], repeats: int, regimes: list[str]) -> bool:
    print(f"\nuniform merge, medians of {repeats} run(s) (seconds: the merge inside the child; RSS: VmHWM)")
    if "warm" in regimes:
        print("\nwarm: rank files in the page cache\n")
        print(table(*warm_table(results)))
    if "cold" in regimes:
        print("\ncold: rank files evicted from the page cache before each child\n")
        print(table(*cold_table(results)))
    from shardfuse.io import new_hash

    data = np.random.default_rng(0).bytes(1 << 26)
    for algorithm in ("sha256", "blake3"):
        hasher = new_hash(algorithm)
        started = time.perf_counter()
        hasher.update(data)
        hasher.digest()
        rate = len(data) / (time.perf_counter() - started) / 1e9
        print(
            f"\n{algorithm} on this CPU: {rate:.2f} GB/s on one core, so checking N models of M MB costs "
            f"N x M / {rate * 1000:.0f} s of CPU (N = 8, 100 MB: {0.8 / rate:.2f} s), which the baseline "
            "does not spend."
        )
    print(f"\nload average at the end: {load_average()}\n")
    return verdicts(results, regimes)


# The columns both regimes' tables start with: (header, key of the row dict without the regime prefix)
HEAD_COLUMNS = [
    ("stream (BLAKE3 checked) s", "stream_s"),
    ("baseline s", "baseline_s"),
    ("speedup", "speedup"),
    ("read-once floor s", "floor_s"),
    ("stream / floor", "over_floor"),
]


def head_cells(r: dict, prefix: str) -> list:
    return [r["model_mb"], r["ranks"], *(r[prefix + key] for _, key in HEAD_COLUMNS)]


def warm_table(results: list[dict]) -> tuple[list[str], list[list]]:
    header = [
        "model MiB",
        "N",
        *(name for name, _ in HEAD_COLUMNS),
        "stream, sha256 checked s",
        "speedup, sha256",
        "stream w/o checksums s",
        "speedup w/o checksums",
        "stream peak RSS MiB",
        "baseline peak RSS MiB",
        "mmap-stream peak RSS MiB",
        "stream RSS / model",
    ]
    rows = [
        [
            *head_cells(r, ""),
            r["sha256_s"],
            r["speedup_sha256"],
            r["nohash_s"],
            r["speedup_nohash"],
            r["stream_rss_mb"],
            r["baseline_rss_mb"],
            r["mmap_rss_mb"],
            r["stream_rss_mb"] / r["model_mb"],
        ]
        for r in results
    ]
    return header, rows


def cold_table(results: list[dict]) -> tuple[list[str], list[list]]:
    header = [
        "model MiB",
        "N",
        *(name for name, _ in HEAD_COLUMNS),
        "stream w/o checksums s",
        "speedup w/o checksums",
        "floor GB/s",
        "stream peak RSS MiB",
        "MiB cached after eviction (of)",
    ]
    rows = [
        [
            *head_cells(r, "cold_"),
            r["cold_nohash_s"],
            r["cold_speedup_nohash"],
            r["files_mb"] * 2**20 / r["cold_floor_s"] / 1000000000.0,
            r["cold_stream_rss_mb"],
            "not checked (no fincore)"
            if r["resident_mb"] is None
            else f"{r['resident_mb']:.1f} ({r['files_mb']:.0f})",
        ]
        for r in results
        if "cold_stream_s" in r
    ]
    return header, rows


def verdicts(results: list[dict], regimes: list[str]) -> bool:
    """Print a verdict per target; true when the targets pass (the speedup warm, the floor cold)."""
    ok = True
    for r in results:
        for regime in regimes:
            key = PREFIX[regime] + "stream_rss_mb"
            if key not in r:
                continue
            limit = 1.5 * r["model_mb"] + 64
            passed = r[key] <= limit
            ok &= passed
            print(
                f"{verdict(passed)}  {r['model_mb']:.0f} MB, N={r['ranks']}: stream peak RSS "
                f"{r[key]:.0f} MB <= 1.5 x model + 64 MB = {limit:.0f} MB ({regime})"
            )
    for r in results:
        if r["ranks"] != 8:
            continue
        for regime in regimes:
            prefix = PREFIX[regime]
            if prefix + "speedup" not in r:
                continue
            if regime == "cold" and r["resident_mb"] is not None and r["resident_mb"] > 0.05 * r["files_mb"]:
                print(
                    f"n/a   cold: {r['resident_mb']:.0f} of {r['files_mb']:.0f} MiB still cached after "
                    "eviction; the cold figures are not the disk's"
                )
                ok = False
                continue
            speedup, over_floor = r[prefix + "speedup"], r[prefix + "over_floor"]
            counts = {"warm": "speedup", "cold": "floor"}[regime]  # what the exit status counts
            ok &= {"speedup": speedup >= 3, "floor": over_floor <= 1.3}[counts]
            print(
                f"{verdict(speedup >= 3)}  {r['model_mb']:.0f} MB, N=8, {regime}: stream (every input's "
                f"BLAKE3 checked) {speedup:.2f}x faster than baseline (>= 3x)"
                + (" [target]" if counts == "speedup" else "")
            )
            print(
                f"{verdict(over_floor <= 1.3)}  {r['model_mb']:.0f} MB, N=8, {regime}: stream takes "
                f"{over_floor:.2f}x the time to read the files once (<= 1.3x)"
                + (" [target: the disk's floor]" if counts == "floor" else " (a copy out of the page cache)")
            )
    return ok


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes-mb", default="100", help="model sizes in MB, comma-separated (default 100)")
    parser.add_argument("--ranks", default="2,4,8,16", help="rank counts, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--regimes", default="warm,cold", help="warm, cold or both (comma-separated)")
    parser.add_argument(
        "--quick", action="store_true", help="CI smoke: 8 MB, N = 2, 4 (cold: 4), one repetition"
    )
    parser.add_argument(
        "--dir", type=Path, help="where to write the checkpoints (default: a temp dir in /tmp)"
    )
    parser.add_argument("--child", nargs=3, metavar=("KIND", "GATHER", "OUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        run_child(args.child[0], Path(args.child[1]), Path(args.child[2]))
        return
    sizes = [8] if args.quick else [int(s) for s in args.sizes_mb.split(",")]
    ranks = [2, 4] if args.quick else [int(n) for n in args.ranks.split(",")]
    repeats = 1 if args.quick else args.repeats
    regimes = [regime for regime in REGIMES if regime in args.regimes.split(",")]
    if not regimes:
        parser.error(f"--regimes {args.regimes}: name warm, cold or both")
    print("\n".join(f"{key}: {value}" for key, value in machine_info().items()))
    results = []
    for size in sizes:
        root = Path(tempfile.mkdtemp(prefix="shardfuse-bench-merge-", dir=args.dir or "/tmp"))
        try:
            # --quick: the cold regime at the largest N only (each cold child starts afresh: < 30 s in all)
            cold_ranks = ranks[-1:] if args.quick else ranks
            results += bench(size, ranks, repeats, regimes, root, cold_ranks)
        finally:
            remove(root)
    ok = report(results, repeats, regimes)
    sys.exit(0 if ok or args.quick else 1)


if __name__ == "__main__":
    main()
