"""Launch geometry: build and run the torchrun command for a training run, locally or under SLURM.

The train rule calls::

    python -m shardfuse.launch --nodes 1 --nproc-per-node 2 \\
        --out-dir results/trainings/<training>/ranks --log logs/train/<training>.log -- \\
        --run-name <training> --shard-dir results/shards/digits/w2-seed0 \\
        --dataset-dir results/datasets/digits --config-json '{...}'

``--log`` writes each attempt to ``<training>.attempt-N.log`` and links the declared log to it, so the
log Snakemake deletes before a re-run is only a name: earlier attempts stay readable.

Everything after ``--`` goes to ``shardfuse.train``. Three cases, one code path:

* one node, local or inside a SLURM job: ``torchrun --standalone --nproc-per-node=P``;
* several nodes (inside a SLURM allocation only): ``srun`` starts one task per node, each running
  ``python -m shardfuse.launch --node-step``, which reads ``SLURM_NODEID``/``SLURM_NNODES``/the node
  list *inside the step* (the Snakemake job-step plugin strips most ``SLURM_*`` variables before the
  rule's shell runs) and execs ``torchrun --nnodes=N --node-rank=R`` with a c10d rendezvous on the
  allocation's first host.

The ranks write into a staging directory next to ``--out-dir`` (on the shared filesystem); only when
every rank finished and ``train.json`` exists is it renamed onto ``--out-dir``, so an interrupted or
failed run never leaves a directory that looks complete. When torchrun fails, the one-line error names
the first rank that raised, its exception and the log (:mod:`shardfuse.rank.failure`), and whether a
re-run resumes from a checkpoint or starts over.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping
from pathlib import Path

from shardfuse.cluster.agent import rank_start
from shardfuse.cluster.deadline import DeadlineWatcher, requeue
from shardfuse.cluster.membership import Membership
from shardfuse.cluster.node_loss import NODE_TIMEOUT_DEFAULT
from shardfuse.cluster.ownership import (
    TRAINING_FOLDER,
    keep_published,
    launch_identity,
    own_group_with_parent_death_signal,
    own_training,
    published_by_previous_owner,
    published_copy,
    restore_published,
    snakemake_ancestor,
    watch_ancestor,
)
from shardfuse.cluster.torchrun import (
    Geometry,
    launch_command,
    node_step_command,
    rank_environ,
)
from shardfuse.console.errors import error_line, run_cli, user_error_message
from shardfuse.console.failures import stage_errors
from shardfuse.console.stream import CONSOLE_FD_ENV, QUIET_ENV, console_fd, console_token
from shardfuse.io import Interrupted, StageParser, UserError, error_reason, replace_dir, write_json
from shardfuse.rank.checkpoint_steps import complete_steps
from shardfuse.rank.failure import FAILURES_DIR, did_not_join, failure_message
from shardfuse.rank.loss import (
    MEMBERSHIP_FILE,
    job_node_names,
    min_ranks_problem,
    read_membership,
    survivors_after_loss,
    survivors_after_node_loss,
    survivors_command,
)
from shardfuse.rank.stop_files import STOP_FILE, STOPPED_FILE, read_stop

REQUEUE_WAIT_SECONDS = 120
# Inside a SLURM job the ranks stop this long before the time limit, with a checkpoint (seconds).
STOP_BEFORE_ENV = "SHARDFUSE_STOP_BEFORE_LIMIT"
DEFAULT_STOP_BEFORE = 180.0


def staging_dir(out_dir: Path) -> Path:
    return out_dir.with_name(f".{out_dir.name}.partial")


def run_and_forward_signals(
    cmd: list[str], env: Mapping[str, str] | None = None, watch: tuple[int, str] | None = None
) -> int:
    """Run ``cmd`` in its own process group (with a parent-death signal); a SIGTERM/SIGINT to us (job
    cancelled, Ctrl-C) goes to the whole group, and if ``watch`` (the snakemake that started us) dies
    the group is terminated, so no rank outlives the workflow (:mod:`shardfuse.cluster.ownership`)."""
    print("launch:", shlex.join(cmd), file=sys.stderr, flush=True)
    console = console_fd(env if env is not None else os.environ)
    passed = () if console is None else (console,)  # the ranks inherit the console (rank.progress)
    proc = subprocess.Popen(cmd, env=env, preexec_fn=own_group_with_parent_death_signal, pass_fds=passed)
    if watch is not None:
        watch_ancestor(watch, proc)

    def forward(signum, _frame):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        return proc.wait()
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _shard_world_size(train_args: list[str]) -> int | None:
    if "--shard-dir" not in train_args:
        return None
    from shardfuse.data.manifest import read_manifest  # JSON only: the launcher never imports torch

    return int(read_manifest(train_args[train_args.index("--shard-dir") + 1])["world_size"])


def prepare_staging(staging: Path, train_args: list[str]) -> bool:
    """Reuse the staging directory of an interrupted launch of the same training (to resume from its
    checkpoints); anything else there is stale and goes. Returns True when resuming is possible."""
    identity = {"train_args": [a for a in train_args if a != str(staging)]}
    record = staging / "launch.json"
    try:
        same = record.is_file() and json.loads(record.read_text()) == identity
    except (ValueError, OSError):  # cut or unreadable: not this launch's record, so not resumable
        same = False
    if same:
        return bool(complete_steps(staging / "checkpoints"))
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    write_json(record, identity)
    return False


def launch(
    geometry: Geometry,
    out_dir: Path,
    train_args: list[str],
    environ: Mapping[str, str],
    max_restarts: int = 0,
    log: Path | None = None,
    stop_before_limit: float = 0,
    min_ranks: int | None = None,
    node_timeout: float = NODE_TIMEOUT_DEFAULT,
) -> None:
    TRAINING_FOLDER.check(out_dir)  # never a folder no training wrote (a published one is one)
    shards = _shard_world_size(train_args)
    if shards is not None and shards != geometry.world_size:
        raise UserError(
            f"the shard set has {shards} shards but nodes x nproc_per_node = {geometry.nnodes} x "
            f"{geometry.nproc_per_node} = {geometry.world_size}; make world_size and the "
            "geometry agree"
        )
    rank_start(environ)  # a bad SHARDFUSE_RANK_START fails here, before any file or rank
    if min_ranks is not None and (problem := min_ranks_problem(min_ranks, geometry, train_args)) is not None:
        raise UserError(f"--min-ranks: {problem}")
    staging = staging_dir(out_dir)
    cmd = launch_command(
        geometry, [*train_args, "--out-dir", str(staging)], environ, max_restarts=max_restarts
    )  # checks the geometry before touching files
    workflow = snakemake_ancestor()
    identity = launch_identity(train_args)
    with own_training(out_dir):
        if workflow is not None and published_by_previous_owner(out_dir, identity):
            print(f"launch: {out_dir} was published by its previous owner; nothing to train", file=sys.stderr)
            return
        if workflow is not None and restore_published(out_dir, identity):
            print(
                f"launch: {out_dir} restored from its published copy (same arguments, shards, dataset "
                f"and init; delete {published_copy(out_dir)} to train afresh)",
                file=sys.stderr,
            )
            return
        _train(
            geometry, out_dir, staging, cmd, train_args, environ, workflow, max_restarts, log,
            stop_before_limit, min_ranks, node_timeout,
        )  # fmt: skip
        if workflow is not None:
            keep_published(out_dir, identity)


def _train(
    geometry: Geometry,
    out_dir: Path,
    staging: Path,
    cmd: list[str],
    train_args: list[str],
    environ: Mapping[str, str],
    workflow: tuple[int, str] | None,
    max_restarts: int,
    log: Path | None,
    stop_before_limit: float,
    min_ranks: int | None = None,
    node_timeout: float = NODE_TIMEOUT_DEFAULT,
) -> None:
    """Run the ranks into the staging directory (resuming from its checkpoints) and publish it; with
    ``min_ranks`` below the world size, a rank lost for good leaves the others going on
    (:mod:`shardfuse.rank.loss`), and on several nodes a node lost for good its ranks
    (:mod:`shardfuse.cluster.node_loss`)."""
    if prepare_staging(staging, train_args):
        print(f"launch: resuming from the checkpoints in {staging / 'checkpoints'}", file=sys.stderr)
    shutil.rmtree(staging / FAILURES_DIR, ignore_errors=True)  # an earlier launch's
    for name in (STOP_FILE, STOPPED_FILE):
        (staging / name).unlink(missing_ok=True)
    membership = read_membership(staging)  # the survivors an earlier launch went on with
    job = environ.get("SLURM_JOB_ID")
    planned = geometry
    survives_nodes = bool(
        planned.nnodes > 1 and job and min_ranks is not None and min_ranks < planned.world_size
    )
    nodes = job_node_names(job, environ) if survives_nodes else None
    rejoined = False
    while True:
        if membership is not None:
            geometry, cmd = survivors_command(
                membership, staging, train_args, environ, max_restarts, planned, nodes
            )
            nodes = nodes[: geometry.nnodes] if nodes else nodes  # the nodes this attempt runs on
        # Several nodes: srun's tasks (--node-step) share out the threads where the ranks start.
        env = rank_environ(geometry, environ) if geometry.nnodes == 1 else None
        with (
            DeadlineWatcher(job, stop_before_limit, staging / STOP_FILE)
            if job and stop_before_limit > 0
            else contextlib.nullcontext()
        ) as deadline:
            status = run_and_forward_signals(cmd, env, watch=workflow)
        stopped = read_stop(staging)
        if stopped is not None:
            stop_and_requeue(stopped, job if deadline is not None and deadline.fired else None)
        if status == 0:
            break
        if not rejoined and did_not_join(staging, max_restarts):
            # A rank hung while starting (not at a step of its own): no fault of the run's, so once more.
            rejoined = True
            print(
                "launch: a rank never joined the others (it hung while starting); starting the ranks again, "
                "once",
                file=sys.stderr,
                flush=True,
            )
            shutil.rmtree(staging / FAILURES_DIR, ignore_errors=True)
            continue
        if planned.nnodes > 1:  # the unit of loss is a node (a rank alone would leave nodes uneven)
            after = survivors_after_node_loss(
                membership or Membership.full(planned.world_size), staging, train_args, min_ranks, job,
                nodes or [], node_timeout, planned.nproc_per_node,
            )  # fmt: skip
            membership, nodes = after if after is not None else (None, nodes)
        else:
            membership = survivors_after_loss(
                membership or Membership.full(geometry.world_size), staging, train_args, max_restarts,
                min_ranks,
            )  # fmt: skip
        if membership is None:
            raise UserError(failure_message(status, staging, max_restarts, log))
    if not (staging / "train.json").is_file():
        raise UserError(
            f"training exited 0 but {staging}/train.json is missing; the ranks did not finish — "
            "check the log above"
        )
    # Checkpoints and failed attempts' records are run state only: the published directory holds results.
    shutil.rmtree(staging / "checkpoints", ignore_errors=True)
    shutil.rmtree(staging / FAILURES_DIR, ignore_errors=True)
    (staging / "launch.json").unlink(missing_ok=True)
    (staging / MEMBERSHIP_FILE).unlink(missing_ok=True)  # train.json records who went on
    replace_dir(staging, out_dir, TRAINING_FOLDER)


def stop_and_requeue(stopped: dict, job: str | None) -> None:
    """The ranks stopped at a step with a checkpoint (a signal, or ``job``'s time limit): say so, requeue
    ``job`` (it resumes from that step when it starts again), and end with exit status 75."""
    step, reason = stopped["step"], stopped.get("reason", "asked to stop")
    message = f"training stopped after step {step} ({reason}) with a complete checkpoint of that step"
    if job is None:
        raise Interrupted(f"{message}; a re-run resumes from step {step}, losing no step")
    # Said before the request: SLURM ends this job (this process too) as it requeues it, which may be
    # before `scontrol requeue` returns here.
    print(
        f"launch: requeueing SLURM job {job}: it resumes from step {step} when it starts again",
        file=sys.stderr,
        flush=True,
    )
    refused = requeue(job)
    if refused is not None:
        raise Interrupted(
            f"{message}, but SLURM did not requeue job {job} ({refused}); re-run snakemake to resume from "
            f"step {step}, or ask for a longer runtime (set-resources: train: runtime)"
        )
    time.sleep(REQUEUE_WAIT_SECONDS)  # SLURM ends this job meanwhile; should it not, say so
    raise Interrupted(f"{message}; SLURM job {job} was requeued but did not end")


def attempt_log(log: Path) -> tuple[Path, int]:
    """A new, empty log file for this attempt, ``<name>.attempt-<N>.log`` (N counts up from 1), with
    ``log`` made a hard link to it. Snakemake deletes a job's declared log before every run of the job;
    the attempt file is not declared, so a re-run (resume after a kill, ``scancel``, a --retries
    re-submission) keeps the earlier attempts' tracebacks. Returns the attempt file and N."""
    stem = log.name[: -len(log.suffix)] if log.suffix else log.name
    pattern = re.compile(rf"{re.escape(stem)}\.attempt-(\d+){re.escape(log.suffix)}")
    log.parent.mkdir(parents=True, exist_ok=True)
    taken = [int(m.group(1)) for other in log.parent.iterdir() if (m := pattern.fullmatch(other.name))]
    number = max(taken, default=0) + 1
    attempt = log.with_name(f"{stem}.attempt-{number}{log.suffix}")
    attempt.touch(exist_ok=False)
    log.unlink(missing_ok=True)
    with contextlib.suppress(OSError):  # no hard links here: the declared log is a copy made at exit
        os.link(attempt, log)
    return attempt, number


def log_to(log: Path) -> tuple[Path, int]:
    """Send this process's stdout and stderr (inherited by torchrun and the ranks) to this attempt's
    log file (see :func:`attempt_log`). Returns the attempt file and a copy of the console's stderr,
    where the launcher's own one-line error goes too (by hand, ``--log`` would leave the console
    silent)."""
    attempt, number = attempt_log(log)
    fd = os.open(attempt, os.O_WRONLY | os.O_APPEND)
    sys.stdout.flush()
    sys.stderr.flush()
    console = os.dup(2)
    if os.environ.get(QUIET_ENV) != "1":  # rank 0 echoes its progress to the console (rank.progress)
        os.environ[CONSOLE_FD_ENV] = console_token(console)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    if not log.exists():
        atexit.register(shutil.copyfile, attempt, log)
    if number > 1:
        earlier = ", ".join(
            attempt.with_name(attempt.name.replace(f"-{number}.", f"-{n}.")).name for n in range(1, number)
        )
        print(
            f"launch: attempt {number}; earlier attempts' logs: {earlier} (in {log.parent})", file=sys.stderr
        )
    return attempt, console


# Set by the workflow for its jobs (workflow/rules/common.smk): Snakemake prints each failed job's
# one-line errors at the end of the run (onerror), so the launcher does not echo them too.
ERRORS_AT_END = "SHARDFUSE_ERRORS_AT_END"


@contextlib.contextmanager
def error_on_console(attempt: Path, console: int):
    """A failed launch's one-line errors also on the console the log replaced (by hand): the ranks'
    (read back from the log), then the launcher's, which says where the whole output is."""
    try:
        yield
    except Exception as exc:
        if os.environ.get(ERRORS_AT_END):
            raise
        message = user_error_message(exc)
        if message is None:  # a bug: its traceback goes to the log
            message = f"{type(exc).__name__}: {error_reason(exc)}"
        lines = [line for line in stage_errors(attempt) if not line.startswith("shardfuse.launch:")]
        lines.append(error_line("shardfuse.launch", f"{message} (the whole output: {attempt})"))
        with contextlib.suppress(OSError):
            os.write(console, "".join(f"{line}\n" for line in lines).encode(errors="replace"))
        raise


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.launch", description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=1, help="machines (default: %(default)s)")
    parser.add_argument("--nproc-per-node", type=int, required=True, help="ranks per machine")
    parser.add_argument("--out-dir", type=Path, help="final directory of the run's outputs")
    parser.add_argument(
        "--node-step",
        action="store_true",
        help="internal: this process is one srun task of a multi-node launch",
    )
    parser.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        help="torchrun restarts the ranks this often after a failure (they resume from "
        "the newest checkpoint)",
    )
    parser.add_argument(
        "--log",
        type=Path,
        help="write all output here (a hard link to <name>.attempt-N.log, so every attempt's log is kept)",
    )
    parser.add_argument(
        "--min-ranks",
        type=int,
        help="let the other ranks go on when a rank is lost for good, while at least this many are left "
        "(localsgd, diloco, ddp with orphans reshard; on several nodes, a node and its ranks; default: the "
        "world size, every rank needed)",
    )
    parser.add_argument(
        "--node-timeout",
        type=float,
        default=NODE_TIMEOUT_DEFAULT,
        help="with --min-ranks and several nodes: seconds a node SLURM reports as not responding may take "
        "to come back before its ranks are lost for good (default: %(default)s)",
    )
    parser.add_argument(
        "--stop-before-limit",
        type=float,
        default=None,
        help="inside a SLURM job: this many seconds before its time limit, stop the ranks at a step "
        f"with a checkpoint and requeue the job (shardfuse.cluster.deadline; 0: off; default: "
        f"${STOP_BEFORE_ENV} or {DEFAULT_STOP_BEFORE:.0f})",
    )
    parser.add_argument("train_args", nargs="*", help="-- then the arguments of shardfuse.train")
    args = parser.parse_args(argv)
    if args.log is None:
        run_launch(args)
        return
    attempt, console = log_to(args.log)
    with error_on_console(attempt, console):
        run_launch(args)


def run_launch(args: argparse.Namespace) -> None:
    """What main does once the output goes where ``--log`` says."""
    geometry = Geometry(args.nodes, args.nproc_per_node)
    if args.max_restarts < 0:
        raise UserError(f"--max-restarts {args.max_restarts} must be >= 0")
    if not args.node_timeout > 0:
        raise UserError(f"--node-timeout {args.node_timeout:g} must be a positive number of seconds")
    train_args, init_digest = without_init_digest(args.train_args)
    if args.node_step:
        cmd = node_step_command(geometry, train_args, os.environ, max_restarts=args.max_restarts)
        sys.exit(run_and_forward_signals(cmd, rank_environ(geometry, os.environ)))
    if args.out_dir is None:
        raise UserError("--out-dir is required; pass the run's train directory")
    check_init_digest(train_args, init_digest)
    launch(
        geometry, args.out_dir, train_args, os.environ, args.max_restarts, args.log,
        stop_before_limit(args.stop_before_limit, os.environ), args.min_ranks, args.node_timeout,
    )  # fmt: skip


def without_init_digest(train_args: list[str]) -> tuple[list[str], str | None]:
    """The train arguments less ``--init-sha256 DIGEST`` (the workflow's digest of init_from's files,
    for launch to check; the train stage takes no such flag), and that digest."""
    if "--init-sha256" not in train_args:
        return train_args, None
    at = train_args.index("--init-sha256")
    if at + 1 >= len(train_args):
        raise UserError("--init-sha256 needs a digest after it (the workflow passes it with --init-from)")
    return train_args[:at] + train_args[at + 2 :], train_args[at + 1]


def check_init_digest(train_args: list[str], digest: str | None) -> None:
    """init_from's files are still those the workflow planned the training with (their contents'
    digest), before any rank starts."""
    if digest is None:
        return
    if "--init-from" not in train_args:
        raise UserError("--init-sha256 goes with --init-from; give both or neither")
    path = train_args[train_args.index("--init-from") + 1]
    from shardfuse.data.provenance import init_files_digest

    if init_files_digest(path) != digest:
        raise UserError(
            f"init_from {path} changed since the workflow planned this training (its files' digest is not "
            "the one recorded); run snakemake again, so that the training starts from the weights there now"
        )


def stop_before_limit(flag: float | None, environ: Mapping[str, str]) -> float:
    """Seconds before a SLURM job's time limit at which the ranks stop with a checkpoint: the flag, else
    $SHARDFUSE_STOP_BEFORE_LIMIT (the workflow's knob: sbatch passes the environment to the job), else
    DEFAULT_STOP_BEFORE."""
    where, value = "--stop-before-limit", flag
    if value is None and environ.get(STOP_BEFORE_ENV, "").strip():
        where, text = STOP_BEFORE_ENV, environ[STOP_BEFORE_ENV]
        try:
            value = float(text)
        except ValueError:
            raise UserError(
                f"{where} is {text!r}, not a number of seconds; set e.g. 300, or 0 for off"
            ) from None
    if value is None:
        return DEFAULT_STOP_BEFORE
    if not 0 <= value < float("inf"):
        raise UserError(
            f"{where} is {value:g}; give the seconds before the time limit, e.g. 300, or 0 for off"
        )
    return value


if __name__ == "__main__":
    run_cli(main)
