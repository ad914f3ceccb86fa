"""torchrun's agent with the ranks forked from it (the stage :mod:`shardfuse.agent` runs it).

torchrun's own launcher (``torch.distributed.run``'s parser and config, ``elastic_launch``: the same
rendezvous, environment, monitoring and restarts), with one difference: the agent imports the training
code once and each rank is a fork of it (``start_method="fork"``) instead of a fresh interpreter that
imports torch again; before forking it also imports what the training module lists in
``FORK_PRELOAD`` (the libraries its ranks would import lazily, each on its own), and after success it
ends without the interpreter's teardown. A rank's start then costs no import: a 4-rank training on
digits takes half the wall time and a third of the CPU (bench/rank_start.py, bench/RESULTS.md), and on
a cluster the ranks of a node stop reading the Python packages from a shared filesystem at once.

A forked rank is made to look like a fresh one: the signal handlers the agent installs are reset to
Python's defaults, its thread pools take the sizes its environment names (``OMP_NUM_THREADS``: the
order of float sums, so the bytes, do not change), an interrupt ends it by SIGINT as it ends a fresh
interpreter, and its process name (``/proc/<pid>/comm``, what ``ps -o comm`` and ``top`` show) is
``rank-<RANK>``. The agent never runs a torch operation or touches a GPU before forking. A rank killed
by a signal (``kill -9``, the kernel's out-of-memory killer) is named in one line of the log: torch's
failure summary names the first failure it sees, which for forked ranks is usually the peer that lost
its connection.

``SHARDFUSE_RANK_START=spawn`` starts every rank as a fresh interpreter instead, exactly as
``torchrun`` does (for a user model whose libraries cannot be forked once imported).

Torch is imported only inside the functions: the launcher imports :func:`rank_start`.
"""

from __future__ import annotations

import contextlib
import ctypes
import importlib
import json
import os
import signal
import sys
import time
import traceback
import uuid
import warnings
from pathlib import Path

RANK_START_ENV = "SHARDFUSE_RANK_START"
RANK_STARTS = ("fork", "spawn")
_PR_SET_NAME = 15
# How long a closing agent waits for its ranks to end by themselves before it signals them (seconds).
CLOSE_GRACE_SECONDS = 5.0
# The signals torch's agent catches (its handler raises in whichever process receives them).
# The agent's record of the ranks killed by a signal, in the training's out dir (shardfuse.rank.loss).
KILLED_RECORD = Path("failures") / "killed.jsonl"
# SIGCHLD: the agent's note of a rank killed by a signal (:func:`_note_killed_ranks`).
_AGENT_SIGNALS = ("SIGTERM", "SIGINT", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2", "SIGCHLD")


def rank_start(environ) -> str:
    value = environ.get(RANK_START_ENV, "fork") or "fork"
    if value not in RANK_STARTS:
        from shardfuse.io import UserError

        raise UserError(
            f"{RANK_START_ENV}={value!r} is not one of {', '.join(RANK_STARTS)}; unset it or pick one"
        )
    return value


def name_process(name: str) -> None:
    """The process's name in ps and /proc/PID/comm (15 characters)."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux: the name is cosmetic
        ctypes.CDLL(None, use_errno=True).prctl(_PR_SET_NAME, name.encode()[:15], 0, 0, 0)


def _as_fresh_rank() -> None:
    """What a fresh interpreter would have: default signal handlers, the environment's thread counts."""
    for name in _AGENT_SIGNALS:
        sig = getattr(signal, name, None)
        if sig is not None:
            signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT else signal.SIG_DFL)
    import torch

    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))


def member_rank(argv: list[str] | tuple[str, ...], process: str) -> str:
    """The rank torch's rank ``process`` is in the training's first world: itself, unless the launcher
    started the survivors of a lost rank (``--membership FILE``: the k-th alive member is process k)."""
    if "--membership" not in argv[:-1] or not process.isdigit():
        return process
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, IndexError):
        recorded = json.loads(Path(argv[argv.index("--membership") + 1]).read_text())
        alive = [entry["rank"] for entry in recorded["ranks"] if entry["alive"]]
        return str(alive[int(process)])
    return process


def _run_rank(module_name: str, *argv: str) -> None:
    """One rank, in a fork of the agent: the module's ``main`` under :func:`run_cli` (one-line errors,
    exit status 2; any other exception's traceback on stderr, exit status 1), as ``python -m <module>``
    runs it. Named ``rank-<its member rank>`` (ps, and the agent's line if a signal kills it)."""
    _as_fresh_rank()
    name_process(f"rank-{member_rank(argv, os.environ.get('RANK', ''))}")
    from shardfuse.console.errors import run_cli

    module = importlib.import_module(module_name)
    try:
        run_cli(module.main, list(argv))
    except Exception:
        # A fresh interpreter prints an uncaught exception's traceback and exits with status 1; torch's
        # fork wrapper would only pickle it for the agent's summary instead.
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        # A fresh interpreter dies of the SIGINT it did not handle; so does this rank (exit status -2),
        # rather than torch's fork wrapper taking the interrupt for a clean exit.
        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)


def _note_killed_ranks(record: Path | None = None) -> None:
    """On SIGCHLD, look at the exited child without reaping it (torch's agent reaps it) and, if a
    signal killed it, say which rank in one line; and append it to ``record`` (JSON lines: rank, pid,
    signal), where the launcher reads which rank died in each attempt (shardfuse.rank.loss)."""
    noted: set[int] = set()

    def on_child(_signum, _frame) -> None:
        try:
            info = os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return
        if info is None or info.si_pid in noted or info.si_code not in (os.CLD_KILLED, os.CLD_DUMPED):
            return
        noted.add(info.si_pid)
        try:
            name = Path(f"/proc/{info.si_pid}/comm").read_text().strip()
        except OSError:
            name = "a rank"
        reason = signal.Signals(info.si_status).name if info.si_status in signal.valid_signals() else ""
        hint = "; the kernel's out-of-memory killer sends it too" if info.si_status == signal.SIGKILL else ""
        print(
            f"shardfuse.agent: {name.replace('-', ' ')} (pid {info.si_pid}) was killed by signal "
            f"{info.si_status} ({reason}{hint})",
            file=sys.stderr,
            flush=True,
        )
        rank = name.removeprefix("rank-")
        if record is not None and rank.isdigit():
            with contextlib.suppress(OSError):
                record.parent.mkdir(parents=True, exist_ok=True)
                with open(record, "a") as fh:
                    fh.write(
                        json.dumps({"rank": int(rank), "pid": info.si_pid, "signal": info.si_status}) + "\n"
                    )

    signal.signal(signal.SIGCHLD, on_child)


def _release_returned_ranks_on_close() -> None:
    """In torch's fork context a rank whose function returned waits for the agent to read its return
    value before it exits. An agent that shuts down (a SIGTERM or Ctrl-C, which it also sends on to the
    ranks) reads none: a rank that finishes its checkpoint after the signal, as ours do, would wait out
    the agent's 30 s grace and be killed. Closing the context first lets such ranks go, as a fresh
    interpreter exits when its main returns, and waits up to CLOSE_GRACE_SECONDS for the ranks to end
    by themselves before torch's close signals them. (torch's own close, wrapped; skipped where a torch
    version lacks either name.)"""
    from torch.distributed.elastic.multiprocessing import api

    context = getattr(api, "MultiprocessContext", None)
    close = getattr(context, "_close", None)
    if close is None or getattr(close, "releases_returned_ranks", False):
        return

    def release_then_close(self, death_sig, timeout: int = 30) -> None:
        finished = getattr(self, "_worker_finished_event", None)
        if finished is not None:
            finished.set()
        # A forked rank that fails exits at once (no interpreter teardown); give its peers, failing on
        # the broken connection in turn, the moment a fresh interpreter's teardown gave them to print
        # their own traceback before the agent's signal ends them.
        deadline = time.monotonic() + CLOSE_GRACE_SECONDS
        for proc in getattr(getattr(self, "_pc", None), "processes", ()):
            proc.join(max(0.0, deadline - time.monotonic()))
        close(self, death_sig, timeout)

    release_then_close.releases_returned_ranks = True
    context._close = release_then_close


def run_agent(argv: list[str] | None = None) -> None:
    """torchrun's command line (``--standalone`` or ``--nnodes/--node-rank/--rdzv-*``,
    ``--nproc-per-node``, ``--max-restarts``, ``-m <module>`` and its arguments)."""
    from torch.distributed.run import get_args_parser, run

    args = get_args_parser().parse_args(argv)
    if rank_start(os.environ) == "spawn" or not args.module:
        run(args)  # torchrun itself
        return
    from torch.distributed.launcher.api import elastic_launch
    from torch.distributed.run import config_from_args

    from shardfuse.console.errors import exit_now

    if args.standalone:  # as torch.distributed.run.run does
        args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    if args.master_port is None:
        args.master_port = 29500
    args.start_method = "fork"
    # Python 3.12+ warns of any fork in a process with threads (torch's agent has its store's); the
    # ranks touch none of the agent's threads' state.
    warnings.filterwarnings(
        "ignore", message=r".*fork\(\) may lead to deadlocks", category=DeprecationWarning
    )
    # torchrun's config first: it sets OMP_NUM_THREADS=1 for several ranks when unset, which the
    # libraries read as they load.
    config, _, _ = config_from_args(args)
    module = importlib.import_module(args.training_script)  # once, here: every rank inherits it
    for name in getattr(module, "FORK_PRELOAD", ()):  # and the libraries its ranks import lazily
        importlib.import_module(name)
    script_args = list(args.training_script_args)
    out_dir = script_args[script_args.index("--out-dir") + 1] if "--out-dir" in script_args[:-1] else None
    _note_killed_ranks(None if out_dir is None else Path(out_dir) / KILLED_RECORD)
    _release_returned_ranks_on_close()
    elastic_launch(config=config, entrypoint=_run_rank)(args.training_script, *args.training_script_args)
    # Every rank has ended and written its files: the agent ends as each forked rank does, without the
    # interpreter's teardown of torch, dynamo, sympy and pandas (0.7 s of a 4-rank digits training's
    # 4.2 s). Only after success: a failure keeps torch's error path.
    exit_now()
