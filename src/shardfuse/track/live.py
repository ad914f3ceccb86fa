"""Optional live view of a training run in MLflow (``mlflow.live: true``), from rank 0, never blocking it.

    live = LiveLogger(tracking_uri, experiment, run_name, enabled=rank == 0 and live_enabled)
    try:
        for ...:
            live.log(step, {"loss": loss_value, "samples_per_second": throughput})
    finally:
        live.close(timeout=10)

``log`` only appends to an in-memory queue (well under a microsecond); a background thread creates the
run, sends the points with log_batch once per ``flush_seconds`` (5) and finishes the run on ``close``.
Rows beyond ``max_rows_per_second`` (2) are skipped: a live view needs no more, the track rule pushes
every step later, and the thread, which shares the GIL, then costs training well under 1% (a point
costs MLflow's SQL store ~0.1-0.3 ms of CPU; ``stats()["thread_cpu_seconds"]`` tells). Points that
find the queue full are dropped and counted, server errors are counted and kept (``last_error``), and
after ``max_failures`` failed requests in a row the logger gives up and drops the rest. Nothing here
raises into the training loop.

The live run is separate from what the track rule writes: its own run named ``{run}/live``, tagged
``shardfuse.live=true`` and ``shardfuse.live_run={run}`` (not ``shardfuse.run``), in the same
experiment. Once the track rule has pushed the finished run, it soft-deletes the live runs of that run
name that started before the training finished (restore one with ``mlflow runs restore --run-id ID``).
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable
from typing import Any

from shardfuse.track.client import (
    EXPERIMENT_TAGS,
    LIVE_RUN_TAG,
    LIVE_TAG,
    MAX_METRICS_PER_BATCH,
    redact_uri,
    set_http_defaults,
    tracking_client,
)


class LiveLogger:
    def __init__(
        self,
        tracking_uri: str | None,
        experiment: str,
        run_name: str,
        enabled: bool = True,
        *,
        flush_seconds: float = 5.0,
        max_rows_per_second: float = 2.0,
        max_queue: int = 10_000,
        max_failures: int = 5,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.enabled = bool(enabled and tracking_uri)
        self.tracking_uri, self.experiment, self.run_name = tracking_uri, experiment, run_name
        self.flush_seconds = flush_seconds
        self.min_row_interval = 1.0 / max_rows_per_second if max_rows_per_second > 0 else 0.0
        self.max_queue = max_queue
        self.max_failures = max_failures
        self._clock = clock
        self.run_id: str | None = None
        self.num_logged = self.num_skipped = self.num_dropped = self.num_errors = 0
        self.last_error: str | None = None
        self.cpu_seconds = 0.0
        self.start_cpu_seconds = 0.0
        self._pending: collections.deque = collections.deque()
        self._next_row_at = 0.0
        self._gave_up = False
        self._failures = 0
        self._final_status = "FINISHED"
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        if not self.enabled:
            return
        set_http_defaults()
        self._thread = threading.Thread(target=self._run, name="shardfuse-live", daemon=True)
        self._thread.start()

    def log(self, step: int, metrics: dict[str, float]) -> None:
        """Queue ``metrics`` at ``step``; returns at once, whatever the server does."""
        if not self.enabled:
            return
        now = self._clock()
        if now < self._next_row_at:
            self.num_skipped += 1
            return
        self._next_row_at = now + self.min_row_interval
        if self._gave_up or self._stop.is_set() or len(self._pending) >= self.max_queue:
            self.num_dropped += len(metrics)
            return
        self._pending.append((step, int(time.time() * 1000), metrics))

    def stats(self) -> dict[str, Any]:
        return {
            "run_id": self.run_id,
            "logged": self.num_logged,
            "skipped_rows": self.num_skipped,
            "dropped": self.num_dropped,
            "errors": self.num_errors,
            "last_error": self.last_error,
            "thread_cpu_seconds": round(self.cpu_seconds, 4),
        }

    def close(self, timeout: float = 10.0, status: str = "FINISHED") -> bool:
        """Send what is queued and finish the run, waiting at most ``timeout`` s; True if it all went."""
        if self._thread is None:
            return True
        self._final_status = status
        self._stop.set()
        self._thread.join(timeout)
        if self._thread.is_alive():
            self._record(TimeoutError(f"live logging still busy after {timeout:g} s; left behind"))
            return False
        return not self._pending and self.num_errors == 0

    def __enter__(self) -> LiveLogger:
        return self

    def __exit__(self, exc_type, *rest: object) -> None:
        self.close(status="FINISHED" if exc_type is None else "FAILED")

    # Background thread -------------------------------------------------------------------------

    def _record(self, exc: BaseException) -> None:
        self.num_errors += 1
        text = (str(getattr(exc, "message", exc)).strip() or type(exc).__name__).splitlines()[0]
        self.last_error = f"{redact_uri(self.tracking_uri or '')}: {text[:300]}"

    def _give_up(self) -> None:
        self._gave_up = True
        while self._pending:
            self.num_dropped += len(self._pending.popleft()[2])

    def _start_run(self):
        from mlflow.exceptions import MlflowException

        client = tracking_client(self.tracking_uri)
        found = client.get_experiment_by_name(self.experiment)
        if found is None:
            try:
                experiment_id = client.create_experiment(self.experiment, tags=EXPERIMENT_TAGS)
            except MlflowException:  # created meanwhile by another writer
                experiment_id = client.get_experiment_by_name(self.experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        tags = {
            LIVE_TAG: "true",
            LIVE_RUN_TAG: self.run_name,
            "mlflow.note.content": f"Live view while training. The track rule's run '{self.run_name}' "
            "holds every step and replaces this one.",
        }
        run = client.create_run(experiment_id, run_name=f"{self.run_name}/live", tags=tags)
        return client, run.info.run_id

    def _failed(self, exc: BaseException) -> None:
        self._record(exc)
        self._failures += 1
        if self._failures >= self.max_failures:
            self._give_up()

    def _flush(self, client) -> None:
        from mlflow.entities import Metric

        while self._pending and not self._gave_up:
            batch = []
            while self._pending and len(batch) < MAX_METRICS_PER_BATCH - 50:
                step, stamp, metrics = self._pending.popleft()
                batch.extend(Metric(k, float(v), stamp, int(step)) for k, v in metrics.items())
            try:
                client.log_batch(self.run_id, metrics=batch)
            except Exception as exc:  # a live view must never take training down
                self.num_dropped += len(batch)
                self._failed(exc)
            else:
                self.num_logged += len(batch)
                self._failures = 0

    def _run(self) -> None:
        client = None
        while True:
            stopping = self._stop.wait(self.flush_seconds)
            if client is None and not self._gave_up:
                try:  # the server may come up later: try again at the next flush
                    client, self.run_id = self._start_run()
                    self.start_cpu_seconds = time.thread_time()  # the one-off part: client, store, run
                except Exception as exc:
                    self._failed(exc)
            if client is not None:
                self._flush(client)
            self.cpu_seconds = time.thread_time()  # this thread's CPU so far: its share of the GIL, at most
            if stopping or (self._gave_up and client is None):
                break
        if client is not None:
            try:
                client.set_terminated(self.run_id, self._final_status)
            except Exception as exc:
                self._record(exc)
        if stopping and client is None:
            self._give_up()
