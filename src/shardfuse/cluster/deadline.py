"""A SLURM job's time limit, watched by the launcher, so that no step is lost to it.

SLURM ends a job at its limit with SIGTERM and, KillWait seconds later (30 by default), SIGKILL; a
training would lose every step since its last periodic checkpoint. Instead the launcher reads the job's
end time from ``squeue`` (again every half minute: an admin may extend the limit), and ``stop_before``
seconds before it writes ``STOP`` into the staging directory; the ranks stop at their next check (about
a second later), save a checkpoint of that step and exit (:mod:`shardfuse.rank.stop`). The launcher then
requeues the job (``scontrol requeue``: the same job id goes back to the queue, so Snakemake's status
checks see it pending, then running again, and it resumes from that step) — no Snakemake retry is used
up, and a training that fails for another reason is not submitted again. Signals from ``sbatch
--signal`` are not used: they reach either the batch shell only (``B:``), which dies of them, or every
process of the job's steps, including Snakemake's, which die of them too.
"""

from __future__ import annotations

import datetime
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

POLL_SECONDS = 30.0


def job_end_time(job_id: str) -> float | None:
    """The job's end time (seconds since the epoch) as SLURM has it now; None without a limit or an
    answer."""
    if shutil.which("squeue") is None:
        return None
    try:
        out = subprocess.run(
            ["squeue", "-h", "-j", job_id, "-o", "%e"], capture_output=True, text=True, timeout=30
        ).stdout.strip()
        return datetime.datetime.fromisoformat(out).timestamp()
    except (OSError, subprocess.SubprocessError, ValueError):
        return None


class DeadlineWatcher:
    """Writes ``stop_file`` ``stop_before`` seconds before the job's end time (a thread)."""

    def __init__(self, job_id: str, stop_before: float, stop_file: Path, poll: float = POLL_SECONDS):
        self.job_id, self.stop_before, self.stop_file, self.poll = job_id, stop_before, stop_file, poll
        self.fired = False
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="slurm-deadline", daemon=True)

    def __enter__(self) -> DeadlineWatcher:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._done.set()
        self._thread.join(timeout=5)

    def _watch(self) -> None:
        while not self._done.is_set():
            end = job_end_time(self.job_id)
            wait = self.poll if end is None else end - self.stop_before - time.time()
            if wait <= 0:
                left = max(0, round(end - time.time()))
                self.stop_file.write_text(f"the SLURM job's time limit is {left} s away\n")
                print(
                    f"launch: SLURM job {self.job_id} reaches its time limit in {left} s: the ranks stop "
                    "at their next step with a checkpoint",
                    file=sys.stderr,
                    flush=True,
                )
                self.fired = True
                return
            self._done.wait(min(wait, self.poll))


def requeue(job_id: str) -> str | None:
    """Put the job back in the queue (it starts again from its batch script); None when done, else
    SLURM's reason."""
    try:
        proc = subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return str(exc)
    return None if proc.returncode == 0 else (proc.stderr.strip() or f"exit status {proc.returncode}")
