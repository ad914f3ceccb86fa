#!/usr/bin/env bash
# Tear down the namespaced SLURM cluster of scripts/slurm-netns-up.sh: cancel its jobs, stop every
# process inside its node namespaces (slurmd and job steps), stop its slurmctld and munged (by pid
# file, only if the pid still names that program), delete its veth pairs, bridge and namespaces.
#
#   bash scripts/slurm-netns-down.sh            # everything above; keeps the state dir (logs)
#   bash scripts/slurm-netns-down.sh --purge    # ... and deletes the state dir
#
# Everything is found by the names the up script gives (netns sfn-node*, links sfn-h*, bridge
# sfnbr0), so it also cleans up after a crashed or half-finished up. Safe to run when nothing is up.
# The cluster of scripts/slurm-up.sh (its daemons, /etc/slurm, /etc/hosts) is never touched.
set -euo pipefail

STATE_DIR=${SHARDFUSE_NETNS_DIR:-/tmp/shardfuse-slurm-netns}
BRIDGE=sfnbr0
PURGE=0
[[ ${1:-} == --purge ]] && PURGE=1
export SLURM_CONF=$STATE_DIR/slurm.conf

log() { printf 'slurm-netns-down: %s\n' "$*" >&2; }

[[ $(id -u) -eq 0 ]] || { echo "slurm-netns-down: must run as root" >&2; exit 1; }

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

if [[ -d $STATE_DIR ]]; then
    exec 9>"$STATE_DIR/.lock"
    flock -w 30 9 || log "WARNING: $STATE_DIR/.lock still held after 30s; going ahead"
fi

# Our namespaces, by name (ip netns list prints "name" or "name (id: N)").
mapfile -t NAMESPACES < <(ip netns list 2>/dev/null | awk '{print $1}' | grep -E '^sfn-node[0-9]+$' || true)

# 1. Cancel jobs while the controller still answers, so it does not keep them around.
if [[ -f $SLURM_CONF ]] && pid_alive slurmctld "$STATE_DIR/slurmctld.pid"; then
    cancel_jobs netns
fi

# 2. Every process inside a node namespace was started by the up script (slurmd) or by a job on
#    that node (slurmstepd, srun, torchrun, ranks): TERM, then KILL what is left after 10 s.
ns_pids() {
    local ns
    for ns in "${NAMESPACES[@]}"; do ip netns pids "$ns" 2>/dev/null || true; done | sort -u
}
pids=$(ns_pids)
if [[ -n $pids ]]; then
    log "stopping $(wc -w <<<"$pids") processes in ${NAMESPACES[*]}"
    # shellcheck disable=SC2086
    kill -TERM $pids 2>/dev/null || true
    # A stopped process (a test freezes a "hung" node) only acts on SIGTERM once continued.
    # shellcheck disable=SC2086
    kill -CONT $pids 2>/dev/null || true
    for _ in $(seq 1 100); do
        alive=""
        for p in $(ns_pids); do running "$p" && alive+="$p "; done
        [[ -z $alive ]] && break
        sleep 0.1
    done
    if [[ -n $alive ]]; then
        log "sending SIGKILL to $alive"
        # shellcheck disable=SC2086
        kill -KILL $alive 2>/dev/null || true
        sleep 0.5
    fi
fi
rm -f "$STATE_DIR"/slurmd-*.pid

# 3. Host-side daemons, by pid file.
stop_daemon slurmctld "$STATE_DIR/slurmctld.pid"
stop_daemon munged "$STATE_DIR/munged.pid"

# 4. Links and namespaces. Deleting one end of a veth pair deletes both.
for link in $(ip -o link show 2>/dev/null | awk -F': ' '{print $2}' | sed 's/@.*//' | grep -E '^sfn-h[0-9]+$' || true); do
    ip link del "$link" 2>/dev/null || true
done
for ns in "${NAMESPACES[@]}"; do
    log "deleting namespace $ns"
    ip netns del "$ns" 2>/dev/null || log "WARNING: ip netns del $ns failed"
done
if ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "deleting bridge $BRIDGE"
    ip link del "$BRIDGE" || log "WARNING: ip link del $BRIDGE failed"
fi

if ((PURGE)); then
    log "removing $STATE_DIR"
    rm -rf "$STATE_DIR"
fi
log "down"
