"""Rank 0's progress bar and the live MLflow logger (real SQLite store, real dead/hanging servers)."""

from __future__ import annotations

import io
import re
import socket
import time

import pytest
from mlflow.tracking import MlflowClient

from shardfuse.rank.progress import Progress
from shardfuse.track import sync as track_sync
from shardfuse.track.live import LiveLogger
from tests.support.helpers import ManualClock
from tests.support.tracking import make_run_dir, run_config

EXPERIMENT = "shardfuse-live"


class TerminalStream(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    root = tmp_path_factory.mktemp("mlflow-live")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(EXPERIMENT, artifact_location=str(root / "artifacts"))
    return {"uri": uri, "client": client, "experiment_id": experiment_id}


def _live_runs(store, run_name):
    return store["client"].search_runs(
        [store["experiment_id"]], f"tags.`shardfuse.live_run` = '{run_name}'"
    )  # active only


def test_progress_off_a_terminal_prints_one_line_per_ten_percent_with_steps_per_second_and_loss():
    stream = io.StringIO()
    with Progress(total_steps=200, enabled=True, stream=stream) as progress:
        for step in range(1, 201):
            progress.update(step, loss=1.0 / step, samples_per_second=1234.0)
    lines = stream.getvalue().splitlines()
    assert len(lines) == 10
    assert lines[0].startswith("train: step 20/200 (10%), ")
    assert lines[-1].startswith("train: step 200/200 (100%), ")
    assert re.search(r"[\d.]+ steps/s, ETA 0s, loss 0\.0050, 1,234 samples/s$", lines[-1])


def test_the_console_gets_a_line_every_ten_seconds_and_the_last_with_the_eta_and_the_val_score():
    """The workflow's console (the launcher's, passed to rank 0): 100 steps a second apart make a line
    at steps 10, 20, ... (ten seconds apart) and at the last; the log keeps its line per 10 %."""
    log, console, clock = io.StringIO(), io.StringIO(), ManualClock()
    with Progress(100, stream=log, description="t", console=console, score_name="accuracy", clock=clock) as p:
        for step in range(1, 101):
            clock.now += 1.0
            p.update(step, loss=0.5, samples_per_second=64.0, val_score=0.9 if step == 30 else float("nan"))
    lines = console.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == [f"t: step {s}/100" for s in range(10, 101, 10)]
    assert lines[0] == "t: step 10/100 (10%), 1.0 steps/s, ETA 1m30s, loss 0.5000, 64 samples/s"
    assert (
        lines[3]
        == "t: step 40/100 (40%), 1.0 steps/s, ETA 1m00s, loss 0.5000, 64 samples/s, val accuracy 0.9000"
    )
    assert lines[-1].startswith("t: step 100/100 (100%), 1.0 steps/s, ETA 0s, ")
    assert log.getvalue().splitlines() == lines  # here the 10 % marks fall ten seconds apart too
    fast, clock = io.StringIO(), ManualClock()
    with Progress(1000, stream=io.StringIO(), description="f", console=fast, clock=clock) as p:
        for step in range(1, 1001):
            clock.now += 0.001  # a second in all: only the last step reaches the console
            p.update(step, loss=0.1)
    assert fast.getvalue().splitlines() == ["f: step 1000/1000 (100%), 1000.0 steps/s, ETA 0s, loss 0.1000"]


def test_eta_text_and_the_console_token_checks_the_file_behind_the_number(tmp_path):
    from shardfuse.console.stream import CONSOLE_FD_ENV, console_fd, console_token, eta_text

    assert [eta_text(s) for s in (0.4, 59.6, 61, 3599, 7620, float("inf"))] == [
        "ETA 0s", "ETA 1m00s", "ETA 1m01s", "ETA 59m59s", "ETA 2h07m", "ETA ?",
    ]  # fmt: skip
    with open(tmp_path / "console", "w") as first, open(tmp_path / "other", "w") as second:
        token = console_token(first.fileno())
        assert console_fd({CONSOLE_FD_ENV: token}) == first.fileno()
        fd, device, _ = token.split(":")
        other = console_token(second.fileno()).split(":")[2]
        # The same number naming another file (a spawned rank, an srun task elsewhere): never written to.
        assert console_fd({CONSOLE_FD_ENV: f"{fd}:{device}:{other}"}) is None
    assert console_fd({CONSOLE_FD_ENV: token}) is None  # closed since
    assert console_fd({}) is None and console_fd({CONSOLE_FD_ENV: "3"}) is None


def test_progress_on_a_terminal_draws_a_tqdm_bar_with_loss_and_rate():
    stream = TerminalStream()
    with Progress(total_steps=50, enabled=True, stream=stream) as progress:
        for step in range(1, 51):
            progress.update(step, loss=0.25, samples_per_second=99.0)
    text = stream.getvalue()
    assert "50/50" in text and "loss 0.2500" in text and "99 samples/s" in text
    assert re.search(r"step/s", text)


def test_progress_disabled_or_on_other_ranks_writes_nothing():
    stream = TerminalStream()
    with Progress(total_steps=10, enabled=False, stream=stream) as progress:
        for step in range(1, 11):
            progress.update(step, loss=1.0, samples_per_second=1.0)
    assert stream.getvalue() == ""


def test_live_logger_sends_points_to_a_separate_tagged_run(store):
    live = LiveLogger(store["uri"], EXPERIMENT, "watched", flush_seconds=0.05, max_rows_per_second=0)
    for step in range(1, 301):
        live.log(step, {"loss": 1.0 / step, "samples_per_second": 100.0})
    assert live.close(timeout=60)
    assert live.stats()["logged"] == 600 and live.stats()["dropped"] == 0
    (run,) = _live_runs(store, "watched")
    assert run.info.run_id == live.run_id
    assert run.info.run_name == "watched/live" and run.info.status == "FINISHED"
    assert run.data.tags["shardfuse.live"] == "true" and "shardfuse.run" not in run.data.tags
    history = store["client"].get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 301))


def test_live_logger_thins_rows_to_its_rate_limit(store):
    now = [100.0]  # a clock the test moves: 10 ms a step, 100 steps, at most 20 rows/s
    live = LiveLogger(
        store["uri"], EXPERIMENT, "thinned", flush_seconds=0.05, max_rows_per_second=20, clock=lambda: now[0]
    )
    for step in range(1, 101):
        live.log(step, {"loss": 1.0})
        now[0] += 0.01
    assert live.close(timeout=60)
    assert live.stats()["logged"] == 20  # one row each 50 ms of the clock: steps 1, 6, 11, ... 96
    assert live.stats()["skipped_rows"] == 80
    (run,) = _live_runs(store, "thinned")
    history = store["client"].get_metric_history(run.info.run_id, "loss")
    assert sorted(m.step for m in history) == list(range(1, 101, 5))


def _hanging_server():
    """A socket that accepts connections and never answers."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(64)
    return server, f"http://127.0.0.1:{server.getsockname()[1]}"


def test_live_logger_never_blocks_the_step_when_the_server_hangs_and_counts_drops(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_TIMEOUT", "1")
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    server, uri = _hanging_server()
    with server:
        live = LiveLogger(uri, EXPERIMENT, "hung", flush_seconds=0.01, max_rows_per_second=0, max_queue=100)
        worst = 0.0
        for step in range(20_000):
            tick = time.perf_counter()
            live.log(step, {"loss": 0.5})
            worst = max(worst, time.perf_counter() - tick)
        # Nothing waits for the server: a call that did would take the 1 s request timeout. (The bound
        # leaves room for the OS descheduling this process on a loaded machine, not for a request.)
        assert worst < 0.2
        started = time.monotonic()
        assert live.close(timeout=0.5) is False
        assert time.monotonic() - started < 1.5
    stats = live.stats()
    assert stats["dropped"] >= 20_000 - 100
    assert stats["logged"] == 0


def test_live_logger_records_errors_of_a_dead_server_and_gives_up(monkeypatch):
    monkeypatch.setenv("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
    live = LiveLogger("http://127.0.0.1:1", EXPERIMENT, "dead", flush_seconds=0.01, max_failures=2)
    deadline = time.monotonic() + 30
    while live.num_errors < 2 and time.monotonic() < deadline:
        live.log(1, {"loss": 1.0})
        time.sleep(0.01)
    live.close(timeout=5)
    assert live.num_errors >= 2
    assert live.last_error.startswith("http://127.0.0.1:1: ")
    live.log(2, {"loss": 1.0})  # after giving up: still returns at once, counted as dropped
    assert live.num_dropped >= 1


def test_disabled_live_logger_starts_no_thread_and_logs_nothing(store):
    live = LiveLogger(store["uri"], EXPERIMENT, "off", enabled=False)
    live.log(1, {"loss": 1.0})
    assert live.close() is True
    assert _live_runs(store, "off") == []


def test_track_deletes_live_runs_of_the_pushed_training_but_not_of_a_newer_one(store, tmp_path):
    def live_run():
        with LiveLogger(store["uri"], EXPERIMENT, "mirrored", flush_seconds=0.01) as live:
            live.log(1, {"loss": 1.0})
        time.sleep(0.05)
        return live.run_id

    old = live_run()
    run_dir, manifest = make_run_dir(tmp_path, "mirrored")  # train.json: the training finished now
    time.sleep(0.05)
    newer = live_run()
    track_sync.track_run("mirrored", run_dir, manifest, run_config("mirrored"), store["uri"], EXPERIMENT)
    assert store["client"].get_run(old).info.lifecycle_stage == "deleted"
    assert [r.info.run_id for r in _live_runs(store, "mirrored")] == [newer]
