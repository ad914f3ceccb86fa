#!/usr/bin/env bash
# Stop the single-node SLURM cluster started by scripts/slurm-up.sh.
#
#   bash scripts/slurm-down.sh            # cancel jobs, stop our daemons
#   bash scripts/slurm-down.sh --purge    # ... and delete the state dir
#
# Only processes named in the pid files of ${SHARDFUSE_SLURM_DIR:-/tmp/shardfuse-slurm}
# are signalled, and only if the pid still belongs to a process of the
# expected name; a munged that slurm-up.sh did not start (no pid file) is left
# alone. Safe to run when nothing is running.
set -euo pipefail

STATE_DIR=${SHARDFUSE_SLURM_DIR:-/tmp/shardfuse-slurm}
ETC_CONF=/etc/slurm/slurm.conf
MARKER="# Managed by shardfuse scripts/slurm-up.sh -- do not edit, rerun the script."
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1

log() { printf 'slurm-down: %s\n' "$*" >&2; }

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

if [[ ! -d $STATE_DIR ]]; then
    log "nothing to do ($STATE_DIR does not exist)"
    exit 0
fi

# Same lock as slurm-up.sh, so an up and a down never interleave. Teardown
# must not hang CI, so after 30 s go ahead without it.
exec 9>"$STATE_DIR/.lock"
flock -w 30 9 || log "WARNING: $STATE_DIR/.lock still held after 30s; stopping anyway"

# Cancel jobs first while the controller is still there: a job's slurmstepd
# is not a child of slurmd and would otherwise keep running, orphaned.
if pid_alive slurmctld "$STATE_DIR/slurmctld.pid"; then
    cancel_jobs debug,gpu
fi

# slurmd before slurmctld (so the controller does not log the node dying),
# munged last (both slurm daemons need it until they exit).
for f in "$STATE_DIR"/slurmd*.pid; do
    [[ -e $f ]] && stop_daemon slurmd "$f"
done
stop_daemon slurmctld "$STATE_DIR/slurmctld.pid"
stop_daemon munged "$STATE_DIR/munged.pid"
rm -f "$STATE_DIR/munge/munged.pid" 2>/dev/null || true

# Our gres.conf names fake GPU files in the state dir: put back a foreign one, or remove ours.
ETC_GRES=$(dirname "$ETC_CONF")/gres.conf
if [[ $(head -n1 "$ETC_GRES" 2>/dev/null) == "$MARKER" ]]; then
    if [[ -f $ETC_GRES.pre-shardfuse ]]; then
        mv -f "$ETC_GRES.pre-shardfuse" "$ETC_GRES"
    elif ((PURGE)); then
        rm -f "$ETC_GRES"
    fi
fi

# Put back a config that was there before slurm-up.sh replaced it; otherwise
# leave ours in place (clients then fail fast with "Unable to contact slurm
# controller" rather than reading an unrelated cluster's config).
if [[ -f $ETC_CONF.pre-shardfuse ]] && [[ $(head -n1 "$ETC_CONF" 2>/dev/null) == "$MARKER" ]]; then
    log "restoring $ETC_CONF from $ETC_CONF.pre-shardfuse"
    mv -f "$ETC_CONF.pre-shardfuse" "$ETC_CONF"
fi

if ((PURGE)); then
    log "removing $STATE_DIR"
    rm -rf "$STATE_DIR"
fi
log "down"
