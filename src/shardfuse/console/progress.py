"""How far a long stage is (prepare's streamed rows, partition's dealt rows, merge's parameters), on the
workflow's console: nothing for the first :data:`CONSOLE_SECONDS` (most stages end sooner), then a line
every :data:`CONSOLE_SECONDS` and the last one, each also in the stage's log::

    prepare big: 1,835,008/6,000,000 rows (30%), 182,758 rows/s, ETA 23s

The console is the descriptor the workflow's jobs inherit (workflow/rules/common.smk's shell prefix
names it in :data:`shardfuse.console.stream.CONSOLE_FD_ENV`, as the launcher does for its ranks); none by
hand, where the log is the console, and none under ``snakemake --quiet``.
"""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from typing import IO

from shardfuse.console.stream import CONSOLE_SECONDS, QUIET_ENV, console_stream, eta_text


class StageProgress:
    """``advance(n)`` as the work goes (cheap between lines); ``close()`` (or the ``with`` block's end)
    prints the last line when an earlier one was printed."""

    def __init__(
        self,
        what: str,
        total: int | None,
        unit: str,
        *,
        clock: Callable[[], float] = time.monotonic,
        console: IO[str] | None = None,
        log: IO[str] | None = None,
    ) -> None:
        self.what, self.total, self.unit, self.clock = what, total, unit, clock
        if console is None and os.environ.get(QUIET_ENV) != "1":
            console = console_stream()
        self.console = console
        self.log = log if log is not None else sys.stdout
        self.done = 0
        self._started = clock()
        self._next = self._started + CONSOLE_SECONDS
        self._printed = False

    def __enter__(self) -> StageProgress:
        return self

    def __exit__(self, kind, *_) -> None:
        if kind is None:
            self.close()

    def advance(self, amount: int) -> None:
        self.done += amount
        now = self.clock()
        if now >= self._next:
            self._next = now + CONSOLE_SECONDS
            self._print(now)

    def close(self) -> None:
        if self._printed:
            self._print(self.clock())
        if self.console is not None:
            self.console.close()
            self.console = None

    def line(self, now: float) -> str:
        elapsed = max(now - self._started, 1e-9)
        rate = self.done / elapsed
        if self.total:
            left = (self.total - self.done) / rate if rate > 0 else float("inf")
            return (
                f"{self.what}: {self.done:,}/{self.total:,} {self.unit} ({100 * self.done // self.total}%), "
                f"{rate:,.0f} {self.unit}/s, {eta_text(left)}"
            )
        return f"{self.what}: {self.done:,} {self.unit}, {rate:,.0f} {self.unit}/s"

    def _print(self, now: float) -> None:
        text = self.line(now)
        self._printed = True
        print(text, file=self.log, flush=True)
        if self.console is not None:
            try:
                print(text, file=self.console, flush=True)
            except OSError:  # the console went away (Snakemake ended): the log keeps the line
                self.console = None
