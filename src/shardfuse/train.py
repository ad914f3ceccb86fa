"""One rank of a training run; started by torchrun, one process per shard.

Not launched by hand with plain python: use the launcher, which wraps torchrun (locally
``--standalone``; under SLURM see ``shardfuse.launch``), as the train rule does::

    python -m shardfuse.launch --nproc-per-node 2 --out-dir results/trainings/<training>/ranks -- \\
        --run-name <training> --shard-dir results/shards/digits/w2-seed0 \\
        --dataset-dir results/datasets/digits --config-json '{"strategy": "ddp", ...}'

Every rank reads only its own shard (streamed by :class:`shardfuse.data.reader.ShardReader`: training starts
after one row group, the sha256 is checked alongside), starts from the same initial weights (rank 0's,
saved once as ``base.safetensors``) and writes ``rank-{rank}.safetensors`` (+ ``.json``),
``metrics/rank-{rank}.parquet`` (one row per optimiser step) and ``metrics/system-rank-{rank}.parquet``
(CPU, memory and GPU use every 5 s: :mod:`shardfuse.metrics.system`). Rank 0 writes ``train.json`` last.
The first rank to raise records its exception in ``failures/`` (:mod:`shardfuse.rank.failure`) for the
launcher's one-line error. After a rank was lost for good (``--membership FILE``, the launcher's, see
:mod:`shardfuse.cluster.membership`) torchrun starts only the alive ranks: each is the member of its
torch rank and keeps that member's seed, shard and files.

``train_rank`` runs the phases in order (their code is in :mod:`shardfuse.rank`): ``set_up`` (model,
optimiser, seeds), ``resume_or_start``, ``plan_steps`` (precision, DDP), ``train_loop`` (which calls
``save_checkpoint``), ``publish``.
"""

from __future__ import annotations

import os
from pathlib import Path

from shardfuse.cluster.membership import Membership
from shardfuse.console.errors import exit_now, run_cli
from shardfuse.experiment.run_config import TrainConfig
from shardfuse.io import StageParser, parse_json_arg, read_json
from shardfuse.metrics.steps import MetricsLog
from shardfuse.metrics.system import SystemSampler
from shardfuse.rank.dist import DistContext, RanksDidNotJoin, distributed, gate_for
from shardfuse.rank.failure import failures_recorded
from shardfuse.rank.loop import train_loop
from shardfuse.rank.publish import publish
from shardfuse.rank.setup import set_up
from shardfuse.rank.start import resume_or_start
from shardfuse.rank.step_plan import plan_steps
from shardfuse.rank.stop_files import record_stop
from shardfuse.track.live import LiveLogger

# The libraries every rank imports lazily as it trains, which the agent imports once before forking
# the ranks (shardfuse.cluster.agent): torch._dynamo (torch.optim wraps an optimiser's methods in
# dynamo's "disable", which imports it when the first optimiser is made: 2.5 s, sympy included), the
# DTensor and FSDP types the rank's checkpoint code reads, and pandas (the step metrics). Imported in
# each rank instead, a 4-rank training on 2 cores spent 2.5 s of its 5 s there. Nothing here starts a
# thread or touches a device.
FORK_PRELOAD = ("torch._dynamo", "torch.distributed.fsdp", "torch.distributed.tensor", "pandas")


def train_rank(
    ctx: DistContext,
    run: str,
    shard_dir: Path,
    dataset_dir: Path,
    cfg: TrainConfig,
    out_dir: Path,
    live: LiveLogger | None = None,
    step_metrics: bool = True,
    init_weights: Path | None = None,
    membership: Membership | None = None,
) -> None:
    """Train this rank. ``step_metrics=False`` records no per-step metrics, progress or live points
    (the logging-overhead benchmark's baseline; the track stage then has no curves to log)."""
    setup = set_up(ctx, run, shard_dir, dataset_dir, cfg, out_dir, init_weights, membership)
    position = resume_or_start(setup)
    # Rows logged after the checkpoint we resume from (or by an attempt that saved none) are dropped.
    # fsdp > 1: a replica's first rank logs for the replica, under its number (the replica's loss).
    layout = setup.layout
    logs = step_metrics and layout.leader
    metrics = MetricsLog(out_dir / "metrics", layout.replica, resume_step=position.step) if logs else None
    # CPU, memory and GPU use every few seconds, from a thread that only reads /proc and NVML (no torch,
    # so training stays bitwise the same); off with the step metrics. A resumed run appends its samples.
    gpu = ctx.device.index if ctx.device.type == "cuda" else None
    with SystemSampler(out_dir / "metrics", layout.replica, gpu, interval_s=None if logs else 0) as system:
        plan = plan_steps(setup, position)
        end = train_loop(setup, plan, position, metrics, live)
        if end.interrupted:
            # The step's checkpoint is complete (save_checkpoint's barrier): nothing is published, and
            # the launcher reads why the ranks stopped and what a re-run resumes from.
            setup.gate.call(record_stop, out_dir, end.step, end.interrupted)
            return
        publish(setup, plan, end, metrics, system)


def member_rank(membership: Membership | None, process: int) -> int:
    """The rank this process is in the training's first world (torch's while no rank was lost)."""
    return process if membership is None else membership.member_of_process(process).rank


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.train", description="One torchrun rank.")
    parser.add_argument("--run-name", required=True, help="run name (recorded in every output)")
    parser.add_argument("--shard-dir", required=True, type=Path, help="shard set with manifest.json")
    parser.add_argument("--dataset-dir", required=True, type=Path, help="prepared dataset (dataset.json)")
    parser.add_argument("--config-json", required=True, help="the run's resolved config as JSON")
    parser.add_argument("--out-dir", required=True, type=Path, help="where this run's rank files go")
    parser.add_argument(
        "--init-from", type=Path, help="start every rank from these weights (the run's init_from, resolved)"
    )
    parser.add_argument("--live-tracking-uri", help="rank 0 also logs to MLflow while training (optional)")
    parser.add_argument("--live-experiment", default="shardfuse", help="MLflow experiment for live logging")
    parser.add_argument(
        "--no-step-metrics",
        dest="step_metrics",
        action="store_false",
        help="record no per-step metrics, progress or live points (for measuring their overhead: "
        "bench/logging_overhead.py; the track stage then has no curves to log)",
    )
    parser.add_argument(
        "--membership", type=Path, help="who is alive after a rank was lost (the launcher's; default: all)"
    )
    args = parser.parse_args(argv)
    cfg = TrainConfig.from_flat(parse_json_arg(args.config_json, "--config-json"))
    membership = None
    if args.membership is not None:
        fix = "delete the training's .ranks.partial folder to train afresh"
        recorded = read_json(args.membership, "membership file")
        membership = Membership.from_json(recorded, str(args.membership), fix)
    with (
        # A rank that never joined (it hung starting): recorded for the launcher, which starts them again.
        failures_recorded(
            args.out_dir, member_rank(membership, int(os.environ.get("RANK") or 0)), RanksDidNotJoin
        ),
        distributed() as ctx,
        # Inside the process group: the failing rank's record exists before its peers fail in turn.
        # Records and the process's name give its member rank (torch's while no rank was lost).
        failures_recorded(args.out_dir, member_rank(membership, ctx.rank)),
        gate_for(ctx.rank).live_logger(args.live_tracking_uri, args.live_experiment, args.run_name) as live,
    ):
        train_rank(
            ctx,
            args.run_name,
            args.shard_dir,
            args.dataset_dir,
            cfg,
            args.out_dir,
            live,
            args.step_metrics,
            args.init_from,
            membership,
        )


if __name__ == "__main__":
    run_cli(main)
    # Every file is written and closed, the process group destroyed and the sampler and live threads
    # joined: skip the interpreter's teardown, where torch's C++ destructors once aborted a finished rank
    # ("terminate called without an active exception", SIGABRT) under heavy load in CI.
    exit_now()
