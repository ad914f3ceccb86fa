"""Run the benchmarks and write bench/RESULTS.md (machine info, one table each, PASS/FAIL).

    .venv/bin/python bench/run_all.py                 # full sizes (minutes: see RESULTS.md's first line)
    .venv/bin/python bench/run_all.py --smoke --out /tmp/RESULTS.md   # tiny sizes (CI): checks they run

Each benchmark can also run alone (bench/partition.py, reader.py, scaling.py, pipeline.py,
logging_overhead.py, and on GPU machines gpu.py, which run_all adds there). Work files go to a fresh
directory under --work-dir (default: the system temp dir) and are deleted afterwards.
Exit status: 0 when every benchmark ran (a FAIL is reported in the file, not as an error), 1 when one
crashed; with --strict also 1 when a target fails.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tempfile
import time
import traceback
from pathlib import Path

import common
import gpu
import logging_overhead
import partition
import pipeline
import reader
import scaling

FULL = {
    "partition": {"base_rows": 1_400_000, "factors": [1, 4, 16], "num_features": 16, "reps": 3},
    "reader": {
        "rows": 4_000_000,
        "features": 32,
        "batch_size": 32,
        "batches": 10_000,
        "steps": 3_000,
        "reps": 3,
        "model_rows": 65_536,
        "model_steps": 200,
    },
    "scaling": {"rows": 60_000, "features": 32, "epochs": 2, "reps": 3, "strategies": ["ddp", "localsgd"]},
    "pipeline": {"epochs": 4, "reps": 3, "runs": list(pipeline.RUNS)},
    "logging": {"rows": 100_000, "features": 32, "epochs": 1, "reps": 12},
    "gpu": {
        "rows": 2_000_000,
        "features": 64,
        "epochs": 2,
        "batch_size": 512,
        "reps": 3,
    },  # GPU machines only
}
SMOKE = {
    "partition": {"base_rows": 5_000, "factors": [1, 4, 16], "num_features": 4, "reps": 1},
    "reader": {
        "rows": 20_000,
        "features": 8,
        "batch_size": 32,
        "batches": 100,
        "steps": 100,
        "reps": 1,
        "model_rows": 1_000,
        "model_steps": 10,
    },
    "scaling": {"rows": 2_000, "features": 8, "epochs": 1, "reps": 1, "strategies": ["localsgd-nosync"]},
    "pipeline": {"epochs": 1, "reps": 1, "runs": ["ddp"], "default": False},
    "logging": {"rows": 4_000, "features": 8, "epochs": 1, "reps": 1},
    "gpu": {"rows": 50_000, "features": 8, "epochs": 1, "batch_size": 512, "reps": 1},
}
NOT_MEASURED = (
    "## 6. GPU\n\nNot measured: this machine has no GPU (CPU-only torch build, gloo). On a GPU machine "
    "run_all.py adds this section by running bench/gpu.py (the train stage under torchrun with NCCL, "
    "precision fp32 vs auto = bf16 autocast, samples/s and peak GPU memory); the device, backend and "
    "precision selection it relies on is unit-tested on any machine (tests/unit/rank/test_dist.py). The "
    "reader's share of step time is the figure to re-check there, since a GPU step is far shorter than a "
    "CPU one."
)


def run_benchmarks(sizes: dict, work_dir: Path) -> list[dict]:
    jobs = {
        "partition": lambda s: partition.run(work_dir=work_dir / "partition", **s),
        "reader": lambda s: reader.run(argparse.Namespace(work_dir=work_dir / "reader", **s)),
        "scaling": lambda s: scaling.run(work_dir=work_dir / "scaling", **s),
        "pipeline": lambda s: pipeline.run(work_dir=work_dir / "pipeline", **s),
        "logging": lambda s: logging_overhead.run(work_dir=work_dir / "logging", **s),
    }
    import torch

    if torch.cuda.is_available():
        jobs["gpu"] = lambda s: gpu.run(work_dir=work_dir / "gpu", **s)
    sections = []
    for name, job in jobs.items():
        started = time.perf_counter()
        print(f"--- {name} ...", flush=True)
        try:
            section = job(sizes[name])
        except Exception:  # one broken benchmark must not hide the others' results
            section = {
                "title": name,
                "markdown": "```\n" + traceback.format_exc()[-3000:] + "```",
                "checks": [(f"{name} benchmark ran", "crashed", False)],
                "crashed": True,
            }
        finally:
            common.remove(work_dir / name)
        section["seconds"] = time.perf_counter() - started
        print(section["markdown"], flush=True)
        sections.append(section)
    return sections


EXPERIMENTS_MARKER = "<!-- experiments run on their own: kept by run_all.py -->"


def render(sections: list[dict], info: dict[str, str], smoke: bool, total_seconds: float) -> str:
    lines = [
        "# Benchmark results",
        "",
        "Written by `bench/run_all.py`"
        + (" --smoke (tiny sizes: the figures mean nothing)" if smoke else "")
        + f" in {total_seconds / 60:.1f} min. Every timed command ran in its own process; baselines "
        "ran interleaved with what they are compared to; figures are medians of the repetitions, and "
        "ratios are paired per repetition (a busy machine slows both sides alike).",
        "",
        "## Machine",
        "",
        common.table(["", ""], [[key, value] for key, value in info.items()]),
        "",
        "## Targets",
        "",
        common.table(
            ["benchmark", "target", "measured", "verdict"],
            [
                [section["title"], name, value, "reported" if ok is None else common.verdict(ok)]
                for section in sections
                for name, value, ok in section["checks"]
            ],
        ),
        "",
    ]
    for section in sections:
        lines += [f"## {section['title']}", "", f"({section['seconds']:.0f} s)", "", section["markdown"], ""]
    if not any(section["title"] == "6. GPU" for section in sections):
        lines += [NOT_MEASURED, ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks that everything runs")
    parser.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "RESULTS.md")
    parser.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()))
    parser.add_argument("--strict", action="store_true", help="exit 1 when a target fails")
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the clean-up below when killed
    info = common.machine_info()
    started = time.perf_counter()
    args.work_dir.mkdir(parents=True, exist_ok=True)
    work_dir = Path(tempfile.mkdtemp(prefix="shardfuse-bench-", dir=args.work_dir))
    try:
        sections = run_benchmarks(SMOKE if args.smoke else FULL, work_dir)
    finally:
        common.remove(work_dir)
    text = render(sections, info, args.smoke, time.perf_counter() - started)
    # Experiments that run on their own (bench/communication.py) keep their section below the marker.
    previous = args.out.read_text() if args.out.is_file() else ""
    if EXPERIMENTS_MARKER in previous:
        text += "\n" + previous[previous.index(EXPERIMENTS_MARKER) :]
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(text)
    print(f"wrote {args.out}")
    crashed = any(section.get("crashed") for section in sections)
    failed = any(ok is False for section in sections for _, _, ok in section["checks"])
    raise SystemExit(1 if crashed or (args.strict and failed) else 0)


if __name__ == "__main__":
    main()
