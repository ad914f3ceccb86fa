"""Training progress on rank 0: a tqdm bar on a terminal, a line per 10% in a log file, or nothing.

Used by the training loop (rank 0 enabled, the other ranks get a disabled twin)::

    with Progress(total_steps=num_steps, enabled=rank == 0) as progress:
        for ...:
            progress.update(step, loss=loss_value, samples_per_second=throughput)

``update`` is cheap (no formatting) between refreshes, so it can be called every step.
"""

from __future__ import annotations

import sys
import time
from typing import IO, Any

LOG_EVERY_PERCENT = 10
REFRESH_SECONDS = 0.5


class Progress:
    """A context manager; ``update(step, loss, samples_per_second)`` with the steps done so far."""

    def __init__(
        self,
        total_steps: int,
        enabled: bool = True,
        initial_step: int = 0,
        stream: IO[str] | None = None,
        description: str = "train",
    ) -> None:
        self.total_steps = max(int(total_steps), 1)
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr
        self.description = description
        self.initial_step = initial_step
        self.step = initial_step
        self.loss: float | None = None
        self.samples_per_second: float | None = None
        self._bar: Any = None
        self._started = 0.0
        self._next_refresh = 0.0
        self._next_line_step = 0
        self._last_line_step = -1

    def __enter__(self) -> Progress:
        if not self.enabled:
            return self
        self._started = time.perf_counter()
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
        elapsed = time.perf_counter() - self._started
        return (self.step - self.initial_step) / elapsed if elapsed > 0 else 0.0

    def _postfix(self) -> str:
        parts = []
        if self.loss is not None:
            parts.append(f"loss {self.loss:.4f}")
        if self.samples_per_second is not None:
            parts.append(f"{self.samples_per_second:,.0f} samples/s")
        return ", ".join(parts)

    def update(self, step: int, loss: float | None = None, samples_per_second: float | None = None) -> None:
        if not self.enabled:
            return
        self.step, self.loss, self.samples_per_second = step, loss, samples_per_second
        if self._bar is not None:
            now = time.perf_counter()
            if now >= self._next_refresh or step >= self.total_steps:
                self._next_refresh = now + REFRESH_SECONDS
                self._bar.set_postfix_str(self._postfix(), refresh=False)
                self._bar.update(step - self._bar.n)
            return
        if step >= self._next_line_step or (step == self.total_steps and step != self._last_line_step):
            self._last_line_step = step
            self._next_line_step = self._line_step_after(step)
            percent = 100 * step // self.total_steps
            print(
                f"{self.description}: step {step}/{self.total_steps} ({percent}%), "
                f"{self.steps_per_second():.1f} steps/s, {self._postfix()}",
                file=self.stream,
                flush=True,
            )

    def __exit__(self, *exc_info: object) -> None:
        if self._bar is not None:
            self._bar.set_postfix_str(self._postfix(), refresh=False)
            self._bar.update(self.step - self._bar.n)
            self._bar.close()
            self._bar = None
