"""Which training checkpoints are complete: ``checkpoints/step-{N}/`` counts once rank 0 wrote its
``COMPLETE`` marker (:mod:`shardfuse.rank.resume` writes and reads them).

Torch-free, so the launcher can say whether a re-run of a failed training resumes or starts over.
"""

from __future__ import annotations

import re
from pathlib import Path

COMPLETE = "COMPLETE"
STEP_DIR = re.compile(r"^step-(\d+)$")


def complete_steps(checkpoint_dir: Path) -> list[int]:
    """The steps of the complete checkpoints in ``checkpoint_dir``, oldest first (none: [])."""
    if not checkpoint_dir.is_dir():
        return []
    steps = [
        int(m.group(1))
        for p in checkpoint_dir.iterdir()
        if (m := STEP_DIR.match(p.name)) and (p / COMPLETE).is_file()
    ]
    return sorted(steps)
