#!/usr/bin/env bash
# Start an MLflow tracking server on 127.0.0.1, backed by the PostgreSQL of scripts/postgres-up.sh,
# with artifacts on disk served through the server (clients upload over HTTP, never to a path).
#
#   bash scripts/postgres-up.sh && bash scripts/mlflow-server-up.sh
#   # tracking_uri: http://127.0.0.1:5055   (mlflow.tracking_uri in config/config.yaml)
#   bash scripts/mlflow-server-down.sh [--purge]
#
# Settings (environment):
#   SHARDFUSE_MLFLOW_PORT         port (default 5055)
#   SHARDFUSE_MLFLOW_DIR          state: artifacts/, log/server.log, server.pid (default /tmp/shardfuse-mlflow)
#   SHARDFUSE_MLFLOW_BIN          the mlflow executable (default: .venv/bin/mlflow of this checkout, else PATH)
#   SHARDFUSE_MLFLOW_BACKEND_URI  backend store (default postgresql://mlflow@127.0.0.1:$SHARDFUSE_PG_PORT/mlflow,
#                                 password read from $SHARDFUSE_PG_DIR/pgpass via PGPASSFILE, never in the URI)
#   SHARDFUSE_MLFLOW_WORKERS      server workers (default 2)
# Needs psycopg2 (psycopg2-binary) in mlflow's environment for the PostgreSQL backend.
# Idempotent: a running server of ours that answers /health is left alone.
set -euo pipefail

REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
STATE_DIR=${SHARDFUSE_MLFLOW_DIR:-/tmp/shardfuse-mlflow}
PORT=${SHARDFUSE_MLFLOW_PORT:-5055}
WORKERS=${SHARDFUSE_MLFLOW_WORKERS:-2}
WAIT_S=${SHARDFUSE_MLFLOW_WAIT_S:-180}
PG_DIR=${SHARDFUSE_PG_DIR:-/tmp/shardfuse-pg}
PG_PORT=${SHARDFUSE_PG_PORT:-55432}
PIDFILE=$STATE_DIR/server.pid
LOG=$STATE_DIR/log/server.log
URL=http://127.0.0.1:$PORT

log() { printf 'mlflow-server-up: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    if [[ -s $LOG ]]; then
        printf '\n===== tail -n 40 %s =====\n' "$LOG" >&2
        tail -n 40 "$LOG" >&2 || true
    fi
    exit 1
}

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

[[ $PORT =~ ^[0-9]+$ ]] || die "SHARDFUSE_MLFLOW_PORT must be a port number (got '$PORT')"

MLFLOW=${SHARDFUSE_MLFLOW_BIN:-}
if [[ -z $MLFLOW ]]; then
    if [[ -x $REPO/.venv/bin/mlflow ]]; then MLFLOW=$REPO/.venv/bin/mlflow; else MLFLOW=$(command -v mlflow || true); fi
fi
[[ -n $MLFLOW && -x $MLFLOW ]] || die "no mlflow executable; run 'make venv' or set SHARDFUSE_MLFLOW_BIN"

BACKEND=${SHARDFUSE_MLFLOW_BACKEND_URI:-postgresql://mlflow@127.0.0.1:$PG_PORT/mlflow}
if [[ $BACKEND == postgresql* ]]; then
    [[ -r $PG_DIR/pgpass ]] || die "no $PG_DIR/pgpass; start the database first: bash scripts/postgres-up.sh"
    "$(dirname "$MLFLOW")/python" -c 'import psycopg2' 2>/dev/null \
        || die "psycopg2 is missing next to $MLFLOW; pip install psycopg2-binary"
fi

health() { curl -fsS -m 5 "$URL/health" >/dev/null 2>&1; }

# server_alive: the pid file names a running process whose command line is an mlflow server.
server_alive() {
    local pid
    [[ -s $PIDFILE ]] || return 1
    pid=$(<"$PIDFILE")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] || return 1
    tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'mlflow.* server' || return 1
    running "$pid"
}

mkdir -p "$STATE_DIR/artifacts" "$STATE_DIR/log"
exec 9>"$STATE_DIR/.lock"
flock -w 300 9 || die "could not take $STATE_DIR/.lock"

if server_alive && health; then
    log "already up: $URL (pid $(<"$PIDFILE"))"
    exit 0
fi
if server_alive; then
    log "server pid $(<"$PIDFILE") does not answer; restarting it"
    bash "$REPO/scripts/mlflow-server-down.sh" 9>&-
fi
if health; then
    die "something else already answers on $URL; stop it or choose SHARDFUSE_MLFLOW_PORT"
fi

log "starting mlflow server on $URL (backend ${BACKEND%%://*}, artifacts $STATE_DIR/artifacts)"
# setsid: the server and its workers form one process group, which mlflow-server-down.sh stops.
# The backend URI goes through mlflow's own environment variable, not the command line. MLflow's
# job runner (GenAI scorers, 7 extra processes) is off unless MLFLOW_SERVER_ENABLE_JOB_EXECUTION says so.
PGPASSFILE=$PG_DIR/pgpass MLFLOW_BACKEND_STORE_URI=$BACKEND \
    MLFLOW_SERVER_ENABLE_JOB_EXECUTION=${MLFLOW_SERVER_ENABLE_JOB_EXECUTION:-false} setsid "$MLFLOW" server \
    --artifacts-destination "$STATE_DIR/artifacts" \
    --host 127.0.0.1 --port "$PORT" --workers "$WORKERS" \
    >>"$LOG" 2>&1 </dev/null 9>&- &
echo $! >"$PIDFILE"

wait_until "$WAIT_S" 0.5 health "mlflow server does not answer $URL/health after ${WAIT_S}s" \
    "mlflow server exited during startup" server_alive
log "up: $URL (pid $(<"$PIDFILE"), log $LOG)"
