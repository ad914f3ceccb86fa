#!/usr/bin/env bash
# Stop the PostgreSQL cluster started by scripts/postgres-up.sh.
#
#   bash scripts/postgres-down.sh            # stop it (data kept)
#   bash scripts/postgres-down.sh --purge    # ... and delete ${SHARDFUSE_PG_DIR:-/tmp/shardfuse-pg}
#
# Only the postmaster named in $STATE_DIR/data/postmaster.pid is stopped (pg_ctl stop -m fast, then
# SIGKILL after 30 s), and only if that pid is a running postgres. Safe when nothing runs.
set -euo pipefail

STATE_DIR=${SHARDFUSE_PG_DIR:-/tmp/shardfuse-pg}
DATA=$STATE_DIR/data
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1

log() { printf 'postgres-down: %s\n' "$*" >&2; }

if [[ ! -d $STATE_DIR ]]; then
    log "nothing to do ($STATE_DIR does not exist)"
    exit 0
fi

# running PID: exists and is not a zombie (PID 1 may not reap promptly here).
running() {
    local st
    st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    st=${st##*) }
    [[ -n $st && ${st%% *} != [ZX] ]]
}

pid=""
if [[ -s $DATA/postmaster.pid ]]; then
    pid=$(head -n1 "$DATA/postmaster.pid")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == postgres ]] && running "$pid" || pid=""
fi

if [[ -n $pid ]]; then
    log "stopping postgres (pid $pid)"
    BIN=$(dirname "$(readlink -f "/proc/$pid/exe")")
    if [[ $(id -u) -eq 0 ]]; then
        runuser -u "$(stat -c %U "$DATA")" -- "$BIN/pg_ctl" -D "$DATA" stop -m fast -w -t 30 >/dev/null 2>&1 || true
    else
        "$BIN/pg_ctl" -D "$DATA" stop -m fast -w -t 30 >/dev/null 2>&1 || true
    fi
    if running "$pid"; then
        log "postgres did not stop after 30s; sending SIGKILL"
        kill -KILL "$pid" 2>/dev/null || true
        sleep 0.5
    fi
else
    log "no running postgres for $DATA"
fi

if ((PURGE)); then
    log "removing $STATE_DIR"
    rm -rf "$STATE_DIR"
fi
log "down"
