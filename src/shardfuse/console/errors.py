"""The console's one-line error: what a stage prints when it stops on bad input or a broken
environment, instead of a traceback.

:func:`run_cli` runs a stage's ``main``: a :class:`shardfuse.io.UserError`, or a foreign exception that
means a broken input or environment (a full or read-only disk, bytes that are not UTF-8, an SQL store,
a safetensors file: :func:`foreign_error`), is one line ``shardfuse.<stage>: error: ...`` on stderr and
exit status 2 (75 for an interruption); a bug keeps its traceback. Lines leave in one write each, so
ranks sharing a console never interleave (:func:`write_line`).
"""

from __future__ import annotations

import errno
import os
import re
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from shardfuse.io import NO_SPACE, NOT_WRITABLE, UserError, destination, error_reason


def _os_error_line(exc: OSError) -> str | None:
    """An OSError about a file (disk full, read-only, permissions, a directory where a file belongs):
    the file it concerns (a temporary sibling named as its destination) and the fix for that file's
    own filesystem."""
    if exc.filename is None and exc.errno not in (*NO_SPACE, *NOT_WRITABLE):
        return None  # a socket, a pipe, a bug: not a file the user can fix
    path = destination(exc.filename) if exc.filename is not None else None
    where = str(path) if path is not None else "the output"
    reason = exc.strerror or type(exc).__name__
    if exc.errno in NO_SPACE:
        place = f"the filesystem of {path.parent}" if path is not None else "its filesystem"
        return (
            f"cannot write {where} ({reason}); free space on {place} or point results at another filesystem"
        )
    if exc.errno == errno.EROFS:
        return (
            f"cannot write {where}: its filesystem is read-only ({reason}); choose a writable results "
            "directory"
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return (
            f"cannot use {where}: it is not writable or readable by this user ({reason}); fix its "
            "permissions or choose another results directory"
        )
    if isinstance(exc, IsADirectoryError):
        return f"{where} is a directory where a file is expected ({reason}); remove or rename it"
    if isinstance(exc, (NotADirectoryError, FileExistsError)):
        return f"cannot write {where} ({reason}); choose a writable, existing results directory"
    if isinstance(exc, FileNotFoundError):
        return f"{where} does not exist ({reason}); run the stage that produces it first"
    if exc.errno == errno.EIO:
        return f"cannot read or write {where} ({reason}); check the disk or filesystem it is on"
    return None


def _named(exc: BaseException, *names: str) -> bool:
    """``exc`` is an instance of a class called one of ``names``, or comes from a module under one of
    them (matched by name: shardfuse's plumbing never imports safetensors, sqlalchemy or mlflow)."""
    return any(kind.__name__ in names or kind.__module__.split(".")[0] in names for kind in type(exc).__mro__)


def foreign_error(exc: BaseException) -> str | None:
    """The one-line message for an exception that is not shardfuse's own check but a broken input or
    environment: the filesystem (disk full, read-only, a directory where a file belongs), bytes that are
    not UTF-8, an SQL store, a safetensors file. None for anything else: a bug keeps its traceback.
    Readers that know the file say more (they catch these where they read); this is the last net."""
    reason = error_reason(exc)[:300]
    if isinstance(exc, UnicodeDecodeError):
        return f"a file is not UTF-8 text ({reason}); save it as UTF-8, or re-run the stage that wrote it"
    if isinstance(exc, OSError):
        return _os_error_line(exc)
    if _named(exc, "sqlalchemy"):
        return (
            f"the SQL tracking store cannot be used ({reason}); check mlflow.tracking_uri and the "
            "store's file"
        )
    if _named(exc, "SafetensorError", "safetensors_rust", "HeaderTooLarge"):
        return f"a checkpoint is not a readable safetensors file ({reason}); re-run the stage that wrote it"
    return None


# The line :func:`error_line` writes, as a log holds it (a rank's lines carry torchrun's prefix): read
# back by the workflow's failure report (shardfuse.console.failures) and the init check.
ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(shardfuse\.[a-z_]+: error: .*)$")


def error_line(prog: str, message: str) -> str:
    """The console's one-line error (:data:`ERROR_LINE` reads it back from a log)."""
    return f"{prog}: error: {message}"


def write_line(line: str, stream: Any = None) -> None:
    """``line`` and its newline in one write, so the lines of ranks sharing a console or a log never
    interleave (``print`` writes the text and the newline separately)."""
    stream = sys.stderr if stream is None else stream
    data = (line.rstrip("\n") + "\n").encode(errors="replace")
    try:
        fd = stream.fileno()
    except (AttributeError, OSError, ValueError):  # captured (tests): no descriptor of its own
        stream.write(data.decode())
        stream.flush()
        return
    stream.flush()
    os.write(fd, data)


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message of a UserError or of a foreign exception :func:`foreign_error` maps; None
    for anything else (a bug)."""
    return str(exc) if isinstance(exc, UserError) else foreign_error(exc)


def run_cli(main: Callable[[list[str] | None], Any], argv: list[str] | None = None) -> None:
    """Run a stage's ``main``; a UserError, or a broken input or environment (:func:`foreign_error`), is
    one line on stderr and exit status 2. Anything else (a bug) keeps its traceback."""
    prog = main.__module__
    if prog == "__main__":
        prog = "shardfuse." + Path(sys.argv[0]).stem
    try:
        main(argv)
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        write_line(error_line(prog, message))
        sys.exit(getattr(exc, "exit_status", 2))


def exit_now() -> NoReturn:
    """End a stage process that has finished its work, skipping the interpreter's teardown (called in a
    stage's ``__main__`` block, after :func:`run_cli` returned: never from code a test calls in-process).

    Tearing down the thousands of modules torch, MLflow, SQLAlchemy, matplotlib and pandas load is a
    large share of a short stage's wall time: a track job's (bench/tracking.py, bench/RESULTS.md), 0.7 s
    of a 4-rank digits training's agent, 0.3 s of an evaluate job; and a training rank's teardown runs
    torch's C++ destructors, which can abort a finished rank. By then every write is committed, the
    temporary files are gone and the locks are released; only the log handlers and output buffers are
    left to flush.
    """
    import logging

    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)
