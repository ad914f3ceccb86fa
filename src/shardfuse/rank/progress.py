"""Training progress on rank 0: a tqdm bar on a terminal, a line per 10% in a log file, or nothing; and
the workflow's console, when the launcher passes it (:data:`CONSOLE_FD_ENV`), a line at most every
:data:`CONSOLE_SECONDS` and at the last step.

Used by the training loop (rank 0 enabled, the other ranks get a disabled twin)::

    with Progress(total_steps=num_steps, enabled=rank == 0) as progress:
        for ...:
            progress.update(step, loss=loss_value, samples_per_second=throughput, val_score=score)

``update`` is cheap (no formatting) between refreshes, so it can be called every step. A line::

    digits-w2-9c1e: step 400/1000 (40%), 118.3 steps/s, ETA 5s, loss 0.1559, 3,800 samples/s,
        val accuracy 0.9312   (one line)
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from typing import IO, Any

from shardfuse.console.stream import CONSOLE_SECONDS, eta_text

LOG_EVERY_PERCENT = 10
REFRESH_SECONDS = 0.5


class Progress:
    """A context manager; ``update(step, loss, samples_per_second, val_score)`` with the steps done."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        initial_step: int = 0,
        stream: IO[str] | None = None,
        description: str = "train",
        console: IO[str] | None = None,
        score_name: str = "score",
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:
        self.total_steps = max(int(total_steps), 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.description = description
        self.initial_step = initial_step
        self.step = initial_step
        self.loss: float | None = None
        self.samples_per_second: float | None = None
        self.val_score: float | None = None  # the last validation's
        self.score_name = score_name
        self.console = console if enabled else None
        self.clock = clock
        self._bar: Any = None
        self._started = 0.0
        self._next_refresh = 0.0
        self._next_line_step = 0
        self._last_line_step = -1
        self._next_console = 0.0
        self._last_console_step = -1

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        self._started = self.clock()
        self._next_console = self._started + CONSOLE_SECONDS
        isatty = getattr(self.stream, "isatty", None)
        if isatty is not None and isatty():
            from tqdm import tqdm

            self._bar = tqdm(
                total=self.total_steps,
                initial=self.initial_step,
                desc=self.description,
                unit="step",
                file=self.stream,
                dynamic_ncols=True,
                mininterval=REFRESH_SECONDS,
            )
        else:
            self._next_line_step = self._line_step_after(self.initial_step)
        return self

    def _line_step_after(self, step: int) -> int:
        every = max(self.total_steps * LOG_EVERY_PERCENT // 100, 1)
        return (step // every + 1) * every

    def steps_per_second(self) -> float:
        elapsed = self.clock() - self._started
        return (self.step - self.initial_step) / elapsed if elapsed > 0 else 0.0

    def _postfix(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_second is not None:
            parts.append(f"{self.samples_per_second:,.0f} samples/s")
        if self.val_score is not None:
            parts.append(f"val {self.score_name} {self.val_score:.4f}")
        return ", ".join(parts)

    def line(self) -> str:
        """The progress line of the current step (the log's and the console's)."""
        rate = self.steps_per_second()
        remaining = (self.total_steps - self.step) / rate if rate > 0 else math.inf
        percent = 100 * self.step // self.total_steps
        return (
            f"{self.description}: step {self.step}/{self.total_steps} ({percent}%), {rate:.1f} steps/s, "
            f"{eta_text(remaining)}, {self._postfix()}"
        )

    def update(
        self,
        step: int,
        loss: float | None = None,
        samples_per_second: float | None = None,
        val_score: float | None = None,
    ) -> None:
        if not self.enabled:
            return
        self.step, self.loss, self.samples_per_second = step, loss, samples_per_second
        if val_score is not None and not math.isnan(val_score):
            self.val_score = val_score
        if self.console is not None:
            self._echo(step)
        if self._bar is not None:
            now = self.clock()
            if now >= self._next_refresh or step >= self.total_steps:
                self._next_refresh = now + REFRESH_SECONDS
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.update(step - self._bar.n)
            return
        if step >= self._next_line_step or (step == self.total_steps and step != self._last_line_step):
            self._last_line_step = step
            self._next_line_step = self._line_step_after(step)
            print(self.line(), file=self.stream, flush=True)

    def _echo(self, step: int) -> None:
        """A console line every CONSOLE_SECONDS and at the last step; a console that went away (the
        workflow was stopped) is dropped, never the training."""
        last = step >= self.total_steps and step != self._last_console_step
        now = self.clock()
        if not last and now < self._next_console:
            return
        self._last_console_step = step
        self._next_console = now + CONSOLE_SECONDS
        try:
            print(self.line(), file=self.console, flush=True)
        except (OSError, ValueError):
            self.console = None

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(self.step - self._bar.n)
            self._bar.close()
            self._bar = None
        if self.console is not None:  # the caller's stream (rank 0's lives as long as the process)
            with contextlib.suppress(OSError, ValueError):
                self.console.flush()
