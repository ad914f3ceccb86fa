"""The first exception of a training's ranks, kept for the launcher's one-line error.

torchrun tells the launcher only that a rank failed (its exit status); the exception is in the rank's
traceback, deep in the log. So each rank that raises records the exception before it leaves the process
group, in ``<staging>/failures/attempt-<N>.json`` (N: torchrun's restart count), and only the first rank
to fail writes it (the file is created exclusively): the others' errors (a peer closed the connection,
a collective broke) follow from that one, and they come only after it left the group, so after the
record exists. Once torchrun has exited, the launcher reads the last attempt's record and says in one
line which rank raised what, where the traceback is, and whether a re-run resumes from a complete
checkpoint or starts over (:func:`failure_message`).

Not torchrun's own error files (``@record``, ``TORCHELASTIC_ERROR_FILE``): they stamp a failure in whole
seconds, so the failing rank and the peer it takes down tie for "first"; they are written after the
process group is gone; and they sit in torchrun's temporary log directory, named by local rank.

Torch-free: the launcher imports it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from shardfuse.console.errors import user_error_message
from shardfuse.rank.checkpoint_steps import complete_steps

FAILURES_DIR = "failures"
MAX_MESSAGE_CHARS = 300
# What a rank raises when a peer vanished under a collective (gloo, NCCL, the c10d store): the effect of
# another rank's end, not a cause. Such a failure is kept apart (``attempt-N.peer.json``), so the rank that
# really failed, or the agent's line of a rank killed by a signal, is the one named.
PEER_LOST = (
    "connection reset by peer",
    "connection closed by peer",
    "broken pipe",
    "connection refused",
    "socket closed",
    "distnetworkerror",
    "read error",
    "timed out",
)
# shardfuse.agent's line for a rank killed by a signal (cluster/agent.py _note_killed_ranks).
KILLED_LINE = re.compile(r"shardfuse\.agent: rank (\d+) \(pid \d+\) was killed by signal (\d+) \(([^)]*)\)")


# The record of a rank that waited in vain for the others to join (shardfuse.rank.dist.RanksDidNotJoin;
# torch-free here, a test holds the name): the launcher starts such an attempt again, once.
JOIN_FAILURE = "shardfuse.rank.dist.RanksDidNotJoin"


def did_not_join(staging: Path, attempt: int) -> bool:
    """Whether ``attempt`` failed because some rank never joined the process group."""
    failure = read_failure(staging, attempt)
    return failure is not None and failure.exception == JOIN_FAILURE


@dataclass(frozen=True)
class RankFailure:
    """The first rank that raised in one torchrun attempt, and what."""

    rank: int
    attempt: int
    exception: str  # the type, qualified by its module unless a builtin: RuntimeError, torch.OutOfMemoryError
    message: str  # the first line of the message (shortened), "" if it has none
    # a UserError or a broken input (shardfuse.console.errors.foreign_error): the rank printed its own
    # one line already
    user_error: bool
    peer_lost: bool = False  # the exception says a peer vanished (PEER_LOST): an effect, not the cause

    def describe(self) -> str:
        return f"{self.exception}: {self.message}" if self.message else self.exception


def failure_path(out_dir: Path, attempt: int, peer_lost: bool = False) -> Path:
    return out_dir / FAILURES_DIR / f"attempt-{attempt}{'.peer' if peer_lost else ''}.json"


def _restart_count() -> int:
    return int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))


def rank_failure(rank: int, exc: BaseException, attempt: int) -> RankFailure:
    kind = type(exc)
    name = kind.__qualname__ if kind.__module__ == "builtins" else f"{kind.__module__}.{kind.__qualname__}"
    lines = str(exc).strip().splitlines()
    message = lines[0].strip() if lines else ""
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 1] + "…"
    said = f"{name} {message}".lower()
    peer_lost = any(pattern in said for pattern in PEER_LOST)
    return RankFailure(rank, attempt, name, message, user_error_message(exc) is not None, peer_lost)


def record_failure(out_dir: Path, failure: RankFailure) -> bool:
    """Write ``failure`` unless a rank already recorded this attempt's; True if it was written. Never
    raises: the rank's own exception is what matters."""
    path = failure_path(out_dir, failure.attempt, failure.peer_lost)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError:  # FileExistsError: another rank failed first
        return False
    with contextlib.suppress(OSError), os.fdopen(fd, "w") as fh:
        fh.write(json.dumps(asdict(failure)) + "\n")
    return True


@contextlib.contextmanager
def failures_recorded(out_dir: Path, rank: int, only: type[Exception] = Exception) -> Iterator[None]:
    """Record an exception raised in the block (:func:`record_failure`; only those of type ``only``),
    then let it propagate. Enter it inside the process group's block, so the record is written before this
    rank leaves the group."""
    try:
        yield
    except only as exc:
        record_failure(out_dir, rank_failure(rank, exc, _restart_count()))
        raise


def record_start(out_dir: Path, step: int) -> None:
    """Rank 0: the step this torchrun attempt resumed from (``attempt-N.start.json``), so the launcher
    can tell a rank that fails again and again at one step from one that makes progress in between."""
    path = out_dir / FAILURES_DIR / f"attempt-{_restart_count()}.start.json"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"step": step}) + "\n")


def node_name() -> str:
    """The SLURM node this process runs on (its name in the job's node list), else the host name."""
    return os.environ.get("SLURMD_NODENAME") or socket.gethostname()


def record_host(out_dir: Path, member_rank: int) -> None:
    """Every rank, as it starts: the node it runs on (``host-<member rank>.txt``), so the launcher knows
    which ranks a lost node took with it (:mod:`shardfuse.cluster.node_loss`)."""
    path = out_dir / FAILURES_DIR / f"host-{member_rank}.txt"
    with contextlib.suppress(OSError):
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(node_name() + "\n")


def read_hosts(out_dir: Path) -> dict[int, str]:
    """Member rank -> the node it last started on (:func:`record_host`)."""
    hosts = {}
    with contextlib.suppress(OSError):
        for path in (out_dir / FAILURES_DIR).glob("host-*.txt"):
            with contextlib.suppress(OSError, ValueError):
                hosts[int(path.stem.split("-", 1)[1])] = path.read_text().strip()
    return hosts


def read_start(out_dir: Path, attempt: int) -> int | None:
    """The step ``attempt`` resumed from (:func:`record_start`); None if it recorded none."""
    try:
        return int(json.loads((out_dir / FAILURES_DIR / f"attempt-{attempt}.start.json").read_text())["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def read_failure(out_dir: Path, attempt: int) -> RankFailure | None:
    """The recorded first failure of ``attempt`` (a rank's own exception before a peer's loss); None if
    there is none or it cannot be read."""
    for peer_lost in (False, True):
        try:
            record = json.loads(failure_path(out_dir, attempt, peer_lost).read_text())
            return RankFailure(
                rank=int(record["rank"]),
                attempt=int(record["attempt"]),
                exception=str(record["exception"]),
                message=str(record["message"]),
                user_error=bool(record["user_error"]),
                peer_lost=bool(record.get("peer_lost", False)),
            )
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return None


def killed_rank(log: Path | None) -> tuple[int, str] | None:
    """(rank, "signal 9 (SIGKILL…)") of the last rank shardfuse.agent saw killed by a signal in ``log``
    (its last 1 MB); None if none."""
    if log is None:
        return None
    try:
        with open(log, "rb") as fh:
            fh.seek(max(0, fh.seek(0, os.SEEK_END) - 1_000_000))
            text = fh.read().decode(errors="replace")
    except OSError:
        return None
    found = KILLED_LINE.findall(text)
    if not found:
        return None
    rank, number, reason = found[-1]
    return int(rank), f"signal {number} ({reason})"


def failure_message(status: int, staging: Path, max_restarts: int, log: Path | None) -> str:
    """The launcher's one line after torchrun failed: the first rank that raised and its exception
    (unless that was a UserError, whose own line the rank printed), where the traceback is, and what a
    re-run does."""
    steps = complete_steps(staging / "checkpoints")
    if steps:
        rerun = (
            f"a re-run with unchanged config and code resumes from the checkpoint of step {steps[-1]} "
            f"in {staging / 'checkpoints'}"
        )
    else:
        rerun = "no checkpoint was complete, so a re-run starts over"
    # torchrun gives up after its last restart: that attempt's failure is the one to report.
    failure = read_failure(staging, max_restarts)
    if failure is None or failure.peer_lost:  # a rank that raised nothing: killed (the agent saw it)?
        killed = killed_rank(log)
        if killed is not None:
            rank, how = killed
            after = (
                ""
                if failure is None or failure.rank == rank
                else f"; rank {failure.rank} then lost its connection to it ({failure.describe()})"
            )
            return f"rank {rank} was killed by {how}{after} (full log: {log}); {rerun}"
    if failure is None or failure.user_error:  # no record (a rank killed) or the rank's own line
        return (
            f"training failed: exit status {status}; the failing rank's error is above in this log; {rerun}"
        )
    where = f"full traceback: {log}" if log is not None else "full traceback above"
    return f"rank {failure.rank} failed: {failure.describe()} ({where}); {rerun}"
