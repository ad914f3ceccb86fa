"""Build and run the torchrun command for a training run, then publish its outputs atomically.

The train rule calls::

    python -m shardfuse.launch --world-size 2 --out-dir results/runs/ddp/train -- \
        --run-name ddp --shard-dir results/shards/digits/w2-seed0 --dataset-dir results/datasets/digits \
        --config-json '{...}'

Everything after ``--`` goes to ``shardfuse.train``. The ranks write into a staging directory next
to ``--out-dir``; only when torchrun exits 0 and ``train.json`` exists is it renamed onto
``--out-dir``, so an interrupted or failed run never leaves a directory that looks complete.
"""

from __future__ import annotations

import argparse
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from shardfuse.io import StageParser, UserError, replace_dir, run_cli


@dataclass(frozen=True)
class Geometry:
    """Where the ranks run: ``nnodes`` machines with ``nproc_per_node`` ranks each."""

    nnodes: int = 1
    nproc_per_node: int = 1

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node


def torchrun_command(geometry: Geometry, train_args: list[str], python: str = sys.executable) -> list[str]:
    """The torchrun invocation for one node (``python -m torch.distributed.run`` is torchrun)."""
    if geometry.nnodes != 1:
        raise UserError(
            f"nodes={geometry.nnodes}: several nodes need a SLURM allocation; run with "
            "--profile slurm or set nodes to 1"
        )
    return [
        python,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nnodes=1",
        f"--nproc-per-node={geometry.nproc_per_node}",
        "-m",
        "shardfuse.train",
        *train_args,
    ]


def staging_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.partial")


def run_and_forward_signals(cmd: list[str]) -> int:
    """Run ``cmd``; a SIGTERM/SIGINT to us (job cancelled) is passed on so no rank is orphaned."""
    proc = subprocess.Popen(cmd)

    def forward(signum, _frame):
        proc.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def launch(geometry: Geometry, out_dir: Path, train_args: list[str]) -> None:
    staging = staging_dir(out_dir)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    cmd = torchrun_command(geometry, [*train_args, "--out-dir", str(staging)])
    print("launch:", " ".join(cmd), file=sys.stderr, flush=True)
    status = run_and_forward_signals(cmd)
    if status != 0:
        raise UserError(
            f"training failed: torchrun exited with status {status}; the failing rank's error "
            f"is above in this log; partial outputs stay in {staging}"
        )
    if not (staging / "train.json").is_file():
        raise UserError(
            f"torchrun exited 0 but {staging}/train.json is missing; the ranks did not finish — "
            "check the log above"
        )
    replace_dir(staging, out_dir)


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--world-size", type=int, required=True, help="ranks = shards")
    parser.add_argument("--out-dir", type=Path, required=True, help="final directory of the run's outputs")
    parser.add_argument("train_args", nargs=argparse.REMAINDER, help="-- then arguments of shardfuse.train")
    args = parser.parse_args(argv)
    train_args = args.train_args[1:] if args.train_args[:1] == ["--"] else args.train_args
    if args.world_size < 1:
        raise UserError(f"--world-size {args.world_size} must be at least 1")
    launch(Geometry(1, args.world_size), args.out_dir, train_args)


if __name__ == "__main__":
    run_cli(main)
