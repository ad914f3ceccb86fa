"""Faults injected from outside a training (never by a key users would set): a rank killed every time it
runs past a step, as a node that is gone for good or a GPU that keeps failing would end it."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

from shardfuse.launch import staging_dir
from tests.support.training import rank_pids


class KillRankPast:
    """SIGKILL rank ``rank`` (its rank in the training's first world: its process name) of the launch
    into ``out`` whenever it runs while a complete checkpoint of step ``step`` or later exists: it dies
    at that step in every torchrun attempt. ``kills`` lists the pids it killed."""

    def __init__(self, out: Path | None, rank: int, step: int, workdir: Path | None = None) -> None:
        """``out``: the training's ranks folder; or ``workdir``: every training a workflow runs there."""
        self.stagings = [staging_dir(out)] if out is not None else None
        self.workdir, self.rank, self.step = workdir, rank, step
        self.kills: list[int] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def __enter__(self) -> KillRankPast:
        self._thread.start()
        return self

    def __exit__(self, *_) -> None:
        self._stop.set()
        self._thread.join()

    def _past_step(self, staging: Path) -> bool:
        done = [int(path.parent.name.split("-")[1]) for path in staging.glob("checkpoints/step-*/COMPLETE")]
        return bool(done) and max(done) >= self.step

    def _watch(self) -> None:
        while not self._stop.is_set():
            stagings = self.stagings or list(self.workdir.glob("results/trainings/*/.ranks.partial"))
            for staging in stagings:
                if not self._past_step(staging):
                    continue
                # the ranks' command line names it as the launcher was given it (a workflow: relative)
                marker = staging.relative_to(self.workdir) if self.workdir is not None else staging
                for pid in rank_pids(str(marker), self.rank):
                    if pid not in self.kills:
                        try:
                            os.kill(pid, signal.SIGKILL)
                            self.kills.append(pid)
                        except ProcessLookupError:
                            pass
            time.sleep(0.02)
