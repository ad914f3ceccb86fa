#!/usr/bin/env bash
# Stop the MLflow tracking server started by scripts/mlflow-server-up.sh.
#
#   bash scripts/mlflow-server-down.sh            # stop it (artifacts and log kept)
#   bash scripts/mlflow-server-down.sh --purge    # ... and delete ${SHARDFUSE_MLFLOW_DIR:-/tmp/shardfuse-mlflow}
#
# Only the process group led by the pid in $STATE_DIR/server.pid is signalled, and only if that pid
# is still an mlflow server (SIGTERM, then SIGKILL after 20 s). Safe when nothing runs.
set -euo pipefail

STATE_DIR=${SHARDFUSE_MLFLOW_DIR:-/tmp/shardfuse-mlflow}
PIDFILE=$STATE_DIR/server.pid
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1

log() { printf 'mlflow-server-down: %s\n' "$*" >&2; }

if [[ ! -d $STATE_DIR ]]; then
    log "nothing to do ($STATE_DIR does not exist)"
    exit 0
fi

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

# group_alive PGID: some non-zombie process is still in the group.
group_alive() {
    local pid
    for pid in $(pgrep -g "$1" 2>/dev/null); do
        running "$pid" && return 0
    done
    return 1
}

pid=""
if [[ -s $PIDFILE ]]; then
    pid=$(<"$PIDFILE")
    if ! [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/cmdline ]] \
        || ! tr '\0' ' ' <"/proc/$pid/cmdline" | grep -q 'mlflow.* server'; then
        pid=""
    fi
fi

if [[ -n $pid ]]; then
    log "stopping mlflow server (process group $pid)"
    kill -TERM -- "-$pid" 2>/dev/null || true
    for _ in $(seq 1 200); do
        group_alive "$pid" || break
        sleep 0.1
    done
    if group_alive "$pid"; then
        log "server did not exit after 20s; sending SIGKILL"
        kill -KILL -- "-$pid" 2>/dev/null || true
        sleep 0.5
    fi
else
    log "no running mlflow server for $STATE_DIR"
fi
rm -f "$PIDFILE"

if ((PURGE)); then
    log "removing $STATE_DIR"
    rm -rf "$STATE_DIR"
fi
log "down"
