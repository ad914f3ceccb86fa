"""What every MLflow writer shares: the client, the writer lock, the error gate, limits and tags.

A library, no command line: the track stage (:mod:`shardfuse.tracking`), the comparison stage
(:mod:`shardfuse.comparison`) and the live logger (:mod:`shardfuse.track.live`) import it; none of them
imports another. Importing it costs no MLflow import; :func:`tracking_client` does that the first time it is
called::

    from shardfuse.track.client import tracking_client, tracking_errors, writer_lock
    with tracking_errors(uri), writer_lock(uri):
        tracking_client(uri).log_artifact(run_id, "plot.png")
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import socket
import urllib.parse
from collections.abc import Iterator
from pathlib import Path

from shardfuse.io import NO_SPACE, NOT_WRITABLE, UserError, destination, error_reason

LIVE_TAG = "shardfuse.live"
LIVE_RUN_TAG = "shardfuse.live_run"
EXPERIMENT_TAGS = {"mlflow.experimentKind": "custom_model_development"}  # the UI's "model training" kind
# MLflow's per-request limits (mlflow.utils.validation); a larger batch is rejected outright.
MAX_PARAMS_PER_BATCH = 100
MAX_METRICS_PER_BATCH = 1000
# MLflow's defaults (7 retries, 120 s timeout) make an unreachable server hang for minutes.
HTTP_DEFAULTS = {
    "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
    "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
    "MLFLOW_HTTP_REQUEST_TIMEOUT": "10",
}
SERVER_PROBE_TIMEOUT = 5  # seconds; a host that does not answer by then is left to MLflow's retries
RERUN_HINT = "start the server or fix mlflow.tracking_uri, then re-run `snakemake -R track`"
# MLflow's answers about a value it was sent (the store is up and answered): a name it refuses...
REFUSED_VALUE_CODES = ("INVALID_PARAMETER_VALUE", "BAD_REQUEST", "INVALID_STATE", "RESOURCE_ALREADY_EXISTS")
REFUSED_VALUE_FIX = (
    "the store is up and refused a value shardfuse sent it; fix the value it names in the config (a run, "
    "experiment or model name), then re-run `snakemake -R track`"
)
DATABASE_SCHEMES = ("postgresql", "mysql", "mssql")  # MLflow's database stores other than sqlite
DB_CONNECT_TIMEOUT = 10  # seconds one connection to a database store may take before it is refused
DATABASE_FIX = (
    "start the database server, or fix mlflow.tracking_uri (host, port, database, user; the password "
    "from PGPASSFILE or the driver's own settings), then re-run `snakemake -R track`"
)


def redact_uri(uri: str) -> str:
    """``scheme://user:secret@host`` -> ``scheme://***@host``: URIs end up in logs and mlflow.json."""
    return re.sub(r"^([A-Za-z][\w+.-]*://)[^/@]*@", r"\1***@", uri)


def check_no_password(tracking_uri: str) -> None:
    """Credentials come from the environment only: a URI ends up in logs, outputs and MLflow's messages."""
    if re.match(r"^[A-Za-z][\w+.-]*://[^/@]*:[^/@]*@", tracking_uri):
        raise UserError(
            f"tracking URI {redact_uri(tracking_uri)} has a password in it; remove it and set "
            "MLFLOW_TRACKING_USERNAME and MLFLOW_TRACKING_PASSWORD (or PGPASSFILE for a database) instead"
        )


def set_http_defaults() -> None:
    for key, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(key, value)


@functools.cache
def tracking_client(tracking_uri: str):
    """The process's one MlflowClient for ``tracking_uri``.

    Building a client opens the store: for a database, an engine plus a check of its schema (and, on
    an empty database, every migration). One client per process pays that once.
    """
    from mlflow.tracking import MlflowClient

    set_http_defaults()
    probe_database(tracking_uri)
    probe_server(tracking_uri)
    return MlflowClient(tracking_uri=tracking_uri)


def database_scheme(tracking_uri: str) -> str | None:
    """``postgresql`` of ``postgresql+psycopg2://...``: a database server MLflow reaches through
    SQLAlchemy (not sqlite, a file); None for every other URI."""
    scheme = tracking_uri.split("://", 1)[0].split("+", 1)[0].lower() if "://" in tracking_uri else ""
    return scheme if scheme in DATABASE_SCHEMES else None


def probe_database(tracking_uri: str) -> None:
    """One connection to a database store, at most ``DB_CONNECT_TIMEOUT`` seconds, before MLflow opens it:
    MLflow retries a store it cannot open 10 times with a growing back-off (about 100 s for a refused
    port, minutes for a host that does not answer). A refusal is one line naming the server's answer."""
    scheme = database_scheme(tracking_uri)
    if scheme is None:
        return
    import sqlalchemy
    from sqlalchemy.pool import NullPool

    connect_args = {"connect_timeout": DB_CONNECT_TIMEOUT} if scheme in ("postgresql", "mysql") else {}
    try:
        engine = sqlalchemy.create_engine(tracking_uri, poolclass=NullPool, connect_args=connect_args)
        with engine.connect():
            pass
        engine.dispose()
    except (sqlalchemy.exc.SQLAlchemyError, ImportError) as exc:
        cause = getattr(exc, "orig", None) or exc
        reason = (str(cause).strip().splitlines() or [type(cause).__name__])[0][:300]
        raise UserError(store_error(tracking_uri, reason, DATABASE_FIX)) from None


def probe_server(tracking_uri: str) -> None:
    """One TCP connection to an http(s) tracking server: a refused port (no server started, a wrong port)
    is one line at once, where MLflow's retries would spend seconds on it. Anything else (a name that
    does not resolve, a host that does not answer) is left to MLflow's own retries and message."""
    parts = urllib.parse.urlsplit(tracking_uri)
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
        socket.create_connection((parts.hostname, port), timeout=SERVER_PROBE_TIMEOUT).close()
    except ConnectionRefusedError:
        raise UserError(
            store_error(tracking_uri, f"connection refused: no server listens on port {port}")
        ) from None
    except (OSError, ValueError):
        return


def connect(tracking_uri: str, experiment: str):
    """Return (the process's client for the URI, experiment id), creating the experiment if missing."""
    client = tracking_client(tracking_uri)
    found = client.get_experiment_by_name(experiment)
    if found is None:
        return client, client.create_experiment(experiment, tags=EXPERIMENT_TAGS)
    if found.lifecycle_stage != "active":
        raise UserError(
            f"experiment '{experiment}' is deleted in {redact_uri(tracking_uri)}; restore it "
            "(mlflow experiments restore) or pass another --experiment"
        )
    return client, found.experiment_id


def _sqlite_path(tracking_uri: str) -> Path | None:
    """The database file of a sqlite:///PATH URI (relative or, with four slashes, absolute)."""
    if not tracking_uri.startswith("sqlite:///"):
        return None
    path = tracking_uri[len("sqlite:///") :].split("?", 1)[0]
    return None if path in ("", ":memory:") else Path(path)


@contextlib.contextmanager
def writer_lock(tracking_uri: str) -> Iterator[None]:
    """Serialise writers of one SQLite store: concurrent writers (and migrations) hit 'database is locked'."""
    db_path = _sqlite_path(tracking_uri)
    if db_path is None:
        yield
        return
    if db_path.is_dir():  # refused here: MLflow retries a store it cannot open for minutes
        raise UserError(store_error(tracking_uri, f"{db_path} is a directory, not a database file", SQL_FIX))
    db_path.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{db_path}.lock", "a") as lock_file:
        fcntl.flock(lock_file, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock_file, fcntl.LOCK_UN)


@contextlib.contextmanager
def tracking_errors(tracking_uri: str) -> Iterator[None]:
    """A dead server or a broken store is one line that names the store, the cause and how to finish
    the job later: an MLflow or HTTP error, the SQL store's (a locked database, a sqlite:/// path that
    is a directory), the filesystem's (a read-only store, a full mlruns/)."""
    import requests
    from mlflow.exceptions import MlflowException

    try:
        yield
    except (MlflowException, requests.RequestException, ConnectionError) as exc:
        text = (str(getattr(exc, "message", exc)).strip() or type(exc).__name__).splitlines()[0][:300]
        if getattr(exc, "error_code", None) in REFUSED_VALUE_CODES:  # the store answered: not a dead server
            raise UserError(store_error(tracking_uri, text, REFUSED_VALUE_FIX)) from None
        raise UserError(store_error(tracking_uri, text)) from None
    except OSError as exc:
        raise UserError(store_error(tracking_uri, _file_reason(exc), _file_fix(exc))) from None
    except Exception as exc:
        if not type(exc).__module__.startswith("sqlalchemy"):
            raise
        fix = SQL_FIX if database_scheme(tracking_uri) is None else DATABASE_FIX
        raise UserError(store_error(tracking_uri, error_reason(exc)[:300], fix)) from None


SQL_FIX = (
    "a sqlite:/// URI must name a database file (not a directory) that no other program holds locked; "
    "fix mlflow.tracking_uri or stop the other program, then re-run `snakemake -R track`"
)


def store_error(tracking_uri: str, reason: str, fix: str = RERUN_HINT) -> str:
    return (
        f"cannot use tracking URI {redact_uri(tracking_uri)} ({reason}); {fix}: the local results are kept "
        "and only what is missing in MLflow is uploaded"
    )


def _file_reason(exc: OSError) -> str:
    where = f": {destination(exc.filename)}" if exc.filename is not None else ""
    return f"{exc.strerror or type(exc).__name__}{where}"


def _file_fix(exc: OSError) -> str:
    """The fix for the store's own filesystem (not the results')."""
    rerun = "then re-run `snakemake -R track`"
    if exc.errno in NO_SPACE:
        return f"free space on the store's filesystem or point mlflow.tracking_uri at another, {rerun}"
    if exc.errno in NOT_WRITABLE:
        return (
            "the store is read-only or not writable by this user: make it writable or point "
            f"mlflow.tracking_uri at a writable store, {rerun}"
        )
    return f"fix the store or mlflow.tracking_uri, {rerun}"
