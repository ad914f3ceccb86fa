#!/usr/bin/env bash
# Start a private PostgreSQL cluster on 127.0.0.1 as the MLflow tracking server's backend store
# (Debian/Ubuntu, no systemd needed), for tests, CI and single-user setups.
#
#   bash scripts/postgres-up.sh            # install if needed, initdb, start, create role+db, wait
#   bash scripts/mlflow-server-up.sh       # then the tracking server on top of it
#   bash scripts/postgres-down.sh [--purge]
#
# State in ${SHARDFUSE_PG_DIR:-/tmp/shardfuse-pg}: data/ (the cluster, owned by the postgres user),
# run/ (unix socket), log/, and pgpass (mode 0600, owned by the caller): the connection for the role
# `mlflow` and database `mlflow` on port ${SHARDFUSE_PG_PORT:-55432}. Clients read the password
# from that file through PGPASSFILE, so it is never on a command line, in a URI or in a log.
# The password is ${SHARDFUSE_PG_PASSWORD}, else the one already in pgpass, else a random one.
#
# Run as root (installs Debian's postgresql if missing and runs the server as `postgres`) or as
# any user when the PostgreSQL binaries are installed (the server then runs as that user).
# Idempotent: a running cluster is reused; role, password and database are (re)applied.
set -euo pipefail

STATE_DIR=${SHARDFUSE_PG_DIR:-/tmp/shardfuse-pg}
PORT=${SHARDFUSE_PG_PORT:-55432}
WAIT_S=${SHARDFUSE_PG_WAIT_S:-60}
DATA=$STATE_DIR/data
SOCKET_DIR=$STATE_DIR/run
PGPASS=$STATE_DIR/pgpass

log() { printf 'postgres-up: %s\n' "$*" >&2; }
die() {
    log "ERROR: $*"
    if [[ -s $STATE_DIR/log/postgres.log ]]; then
        printf '\n===== tail -n 30 %s =====\n' "$STATE_DIR/log/postgres.log" >&2
        tail -n 30 "$STATE_DIR/log/postgres.log" >&2 || true
    fi
    exit 1
}

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

[[ $PORT =~ ^[0-9]+$ ]] || die "SHARDFUSE_PG_PORT must be a port number (got '$PORT')"

pg_bindir() {
    local dir
    dir=$(find /usr/lib/postgresql -mindepth 2 -maxdepth 2 -type d -name bin 2>/dev/null | sort -V | tail -n1)
    [[ -n $dir && -x $dir/pg_ctl ]] && printf '%s\n' "$dir"
}

# --------------------------------------------------------------------------
# 1. Packages. postgresql's maintainer scripts would create and start a
#    system cluster; apt_install forbids starting anything.
# --------------------------------------------------------------------------
if ! BIN=$(pg_bindir); then
    [[ $(id -u) -eq 0 ]] || die "PostgreSQL is not installed; run this script as root once (it installs Debian's postgresql)"
    mkdir -p "$STATE_DIR/log"
    log "installing postgresql"
    apt_install "$STATE_DIR/log/apt.log" postgresql \
        || die "apt-get install postgresql failed (see $STATE_DIR/log/apt.log)"
    BIN=$(pg_bindir) || die "postgresql installed but no /usr/lib/postgresql/*/bin/pg_ctl found"
fi

# The cluster runs as `postgres` when we are root (postgres refuses to run as root).
if [[ $(id -u) -eq 0 ]]; then
    id postgres >/dev/null 2>&1 || die "no 'postgres' user; reinstall Debian's postgresql package"
    DB_USER=postgres
    as_db() { runuser -u postgres -- "$@"; }
else
    DB_USER=$(id -un)
    as_db() { "$@"; }
fi

mkdir -p "$STATE_DIR"
chmod 0755 "$STATE_DIR"
exec 9>"$STATE_DIR/.lock"
flock -w 120 9 || die "could not take $STATE_DIR/.lock"
mkdir -p "$SOCKET_DIR" "$STATE_DIR/log"
chown "$DB_USER" "$SOCKET_DIR" "$STATE_DIR/log"
chmod 0700 "$SOCKET_DIR"

# --------------------------------------------------------------------------
# 2. Password: never printed. Kept in pgpass (0600) for the clients.
# --------------------------------------------------------------------------
PASSWORD=${SHARDFUSE_PG_PASSWORD:-}
if [[ -z $PASSWORD && -s $PGPASS ]]; then
    PASSWORD=$(head -n1 "$PGPASS" | cut -d: -f5-)
fi
if [[ -z $PASSWORD ]]; then
    PASSWORD=$(head -c 24 /dev/urandom | od -An -tx1 | tr -d ' \n')
fi
[[ $PASSWORD != *[:\\\']* ]] || die "SHARDFUSE_PG_PASSWORD must not contain ':', '\\' or a single quote"
(
    umask 077
    printf '127.0.0.1:%s:mlflow:mlflow:%s\n' "$PORT" "$PASSWORD" >"$PGPASS.tmp"
)
mv -f "$PGPASS.tmp" "$PGPASS"

# --------------------------------------------------------------------------
# 3. Cluster: initdb once; local socket connections by peer (OS user),
#    TCP only on 127.0.0.1 and only with a password (scram-sha-256).
# --------------------------------------------------------------------------
if [[ ! -s $DATA/PG_VERSION ]]; then
    log "initdb $DATA"
    rm -rf "$DATA"
    mkdir -p "$DATA"
    chown "$DB_USER" "$DATA"
    chmod 0700 "$DATA"
    as_db "$BIN/initdb" -D "$DATA" -U "$DB_USER" --auth-local=peer --auth-host=scram-sha-256 \
        -E UTF8 --locale=C.UTF-8 >"$STATE_DIR/log/initdb.log" 2>&1 \
        || { cat "$STATE_DIR/log/initdb.log" >&2; die "initdb failed"; }
fi

pg_running() { as_db "$BIN/pg_ctl" -D "$DATA" status >/dev/null 2>&1; }
ready() { "$BIN/pg_isready" -q -h 127.0.0.1 -p "$PORT" -d postgres >/dev/null 2>&1; }

if pg_running && ! ready; then
    log "a cluster runs from $DATA but not on port $PORT; restarting it"
    as_db "$BIN/pg_ctl" -D "$DATA" stop -m fast -w >/dev/null 2>&1 || true
fi
if ! pg_running; then
    log "starting PostgreSQL on 127.0.0.1:$PORT"
    # pg_ctl -w waits until the server accepts connections; 9>&- keeps our lock out of the server.
    as_db "$BIN/pg_ctl" -D "$DATA" -l "$STATE_DIR/log/postgres.log" -w -t "$WAIT_S" \
        -o "-c listen_addresses=127.0.0.1 -p $PORT -k $SOCKET_DIR -c log_min_error_statement=panic" \
        start >/dev/null 9>&- || die "pg_ctl start failed"
fi
wait_until "$WAIT_S" 0.3 ready "PostgreSQL not ready on 127.0.0.1:$PORT after ${WAIT_S}s"

# --------------------------------------------------------------------------
# 4. Role and database, idempotently. The password goes through stdin, and
#    statements are not logged (log_statement=none, and no error statements).
# --------------------------------------------------------------------------
psql_admin() {
    as_db "$BIN/psql" -X -q -v ON_ERROR_STOP=1 -h "$SOCKET_DIR" -p "$PORT" -U "$DB_USER" -d postgres
}
psql_admin >/dev/null <<SQL || die "could not create role/database mlflow"
SET log_statement = 'none';
SET log_min_error_statement = 'panic';
SELECT 'CREATE ROLE mlflow LOGIN' WHERE NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'mlflow')\gexec
ALTER ROLE mlflow WITH LOGIN PASSWORD '$PASSWORD';
SELECT 'CREATE DATABASE mlflow OWNER mlflow' WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = 'mlflow')\gexec
SQL

PGPASSFILE=$PGPASS "$BIN/psql" -X -q -h 127.0.0.1 -p "$PORT" -U mlflow -d mlflow -c 'SELECT 1' >/dev/null 2>&1 \
    || die "cannot log in as mlflow@127.0.0.1:$PORT with the password in $PGPASS"
log "up: postgresql://mlflow@127.0.0.1:$PORT/mlflow (password in $PGPASS; use PGPASSFILE=$PGPASS) data=$DATA"
