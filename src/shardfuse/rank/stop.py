"""Stop at a step boundary with a checkpoint, losing no step: on SIGTERM or SIGINT (Ctrl-C, a cancelled
job, torchrun stopping its workers) and when the launcher asks (``STOP`` in the staging directory: the
SLURM job's time limit is near, :mod:`shardfuse.cluster.deadline`).

The ranks agree at the same step: every rank calls :meth:`StopRequest.due` after each optimiser step, and
every so many steps (about once a second of training, the same count on every rank) they all-reduce
whether any of them was asked to stop. The check never touches the model, so a run that is not stopped
is bitwise the one it was, and a stopped run resumed from its checkpoint ends bitwise identical too.
"""

from __future__ import annotations

import math
import signal
import time
from pathlib import Path

import torch
import torch.distributed as torch_dist

from shardfuse.rank.stop_files import STOP_FILE

CHECK_SECONDS = 1.0  # about this much training between two checks
MAX_CHECK_STEPS = 256


def steps_between_checks(seconds_per_step: float) -> int:
    """Steps until the next check: about CHECK_SECONDS of training, at least 1, at most MAX_CHECK_STEPS."""
    if not seconds_per_step > 0 or math.isinf(seconds_per_step):
        return 1
    return max(1, min(MAX_CHECK_STEPS, int(CHECK_SECONDS / seconds_per_step)))


class StopRequest:
    """This rank's stop request (a signal, or the launcher's STOP file), agreed by all ranks at a step."""

    def __init__(self, staging: Path, device: torch.device, first_step: int):
        self.reason: str | None = None
        self._file = staging / STOP_FILE
        self._device = device
        self._next = first_step + 1
        self._since = (first_step, time.perf_counter())
        self._previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}

    def _on_signal(self, signum: int, _frame) -> None:
        self.reason = self.reason or signal.Signals(signum).name

    def _asked(self) -> str | None:
        if self.reason is None and self._file.exists():
            self.reason = self._file.read_text().strip() or "the launcher asked"
        return self.reason

    def due(self, step: int) -> bool:
        """Whether every rank stops after ``step`` (a collective on check steps; call it on every rank)."""
        if step < self._next:
            return False
        now = time.perf_counter()
        seconds_per_step = (now - self._since[1]) / max(step - self._since[0], 1)
        local = torch.tensor([1.0 if self._asked() else 0.0, seconds_per_step], dtype=torch.float64)
        agreed = local.to(self._device)
        torch_dist.all_reduce(agreed, op=torch_dist.ReduceOp.MAX)
        agreed = agreed.cpu()
        self._next = step + steps_between_checks(float(agreed[1]))
        self._since = (step, now)
        if agreed[0] > 0 and self.reason is None:
            self.reason = "another rank was asked to stop"
        return bool(agreed[0] > 0)

    def __enter__(self) -> StopRequest:
        return self

    def __exit__(self, *exc) -> None:
        """The signals' earlier handlers again (after the loop, also when it raised)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
