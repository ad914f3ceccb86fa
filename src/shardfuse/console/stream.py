"""The workflow's console as a job's processes see it: a descriptor passed down by its number, device
and inode (:data:`CONSOLE_FD_ENV`), so a process where that number is another file never writes to it;
and the ETA text of the progress lines (the trainings' :mod:`shardfuse.rank.progress`, the long stages'
:mod:`shardfuse.console.progress`). Torch-free, standard library only.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import IO

# The launcher's copy of the console it was started from (a Snakemake job's: the workflow's console),
# inherited by the ranks: rank 0 echoes its progress there. Unset: the log file only.
CONSOLE_FD_ENV = "SHARDFUSE_CONSOLE_FD"
CONSOLE_SECONDS = 10.0  # at most one console line per training this often, besides its last step


QUIET_ENV = "SHARDFUSE_QUIET"  # "1" (the workflow under snakemake --quiet): no console progress


def console_token(fd: int) -> str:
    """:data:`CONSOLE_FD_ENV`'s value for descriptor ``fd``: ``FD:DEVICE:INODE``, so a process where that
    number is some other file (an srun task on another node, a spawned rank) never writes to it."""
    info = os.fstat(fd)
    return f"{fd}:{info.st_dev}:{info.st_ino}"


def console_fd(environ: Mapping[str, str] = os.environ) -> int | None:
    """The console descriptor :data:`CONSOLE_FD_ENV` names, when it is still that file here; else None
    (a rank started by hand, by spawn, which closes inherited descriptors, or on another machine)."""
    parts = environ.get(CONSOLE_FD_ENV, "").split(":")
    if len(parts) != 3 or not all(part.isdigit() for part in parts):
        return None
    fd, device, inode = map(int, parts)
    try:
        info = os.fstat(fd)
    except OSError:
        return None
    return fd if (info.st_dev, info.st_ino) == (device, inode) else None


def console_stream(environ: Mapping[str, str] = os.environ) -> IO[str] | None:
    """The console the launcher passed (:func:`console_fd`), line-buffered, or None."""
    fd = console_fd(environ)
    if fd is None:
        return None
    try:
        return os.fdopen(os.dup(fd), "w", buffering=1, encoding="utf-8", errors="replace")
    except OSError:
        return None


def eta_text(seconds: float) -> str:
    """``ETA 42s``, ``ETA 3m05s``, ``ETA 2h07m``; ``ETA ?`` before a rate is known."""
    if not math.isfinite(seconds) or seconds < 0:
        return "ETA ?"
    whole = round(seconds)
    if whole < 60:
        return f"ETA {whole}s"
    if whole < 3600:
        return f"ETA {whole // 60}m{whole % 60:02d}s"
    return f"ETA {whole // 3600}h{whole % 3600 // 60:02d}m"
