"""The files by which the launcher and the ranks tell each other about a stop (torch-free: the launcher
reads them): :mod:`shardfuse.rank.stop`, :mod:`shardfuse.cluster.deadline`."""

from __future__ import annotations

import json
from pathlib import Path

from shardfuse.io import write_json

STOP_FILE = "STOP"  # written by the launcher into the staging directory: stop at the next check
STOPPED_FILE = "STOPPED.json"  # written by rank 0 once the stopping step's checkpoint is complete


def record_stop(staging: Path, step: int, reason: str) -> None:
    """Rank 0, after the stopping step's checkpoint is complete: the launcher reads this."""
    write_json(staging / STOPPED_FILE, {"step": step, "reason": reason})


def read_stop(staging: Path) -> dict | None:
    """What the ranks recorded when they stopped (None when they did not)."""
    path = staging / STOPPED_FILE
    try:
        record = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    return record if isinstance(record, dict) and isinstance(record.get("step"), int) else None
