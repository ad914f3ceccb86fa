#!/usr/bin/env bash
# Shared by the up/down scripts (sourced, not run): find and stop the daemons they started, by pid file;
# install their packages; wait for a daemon to answer; restart SLURM daemons for a new config.
# The sourcing script defines log() and die() (log, show what helps, exit 1) first.

# running PID: true if PID exists and is not a zombie. The daemons reparent to PID 1, which on these
# VMs/containers is not always a reaping init, so a dead daemon can linger as a zombie with its /proc
# entry (and name) intact.
running() {
    local st
    st=$(cat "/proc/$1/stat" 2>/dev/null) || return 1
    st=${st##*) }
    [[ -n $st && ${st%% *} != [ZX] ]]
}

# pid_of NAME PIDFILE: print the pid in PIDFILE if it is a running process called NAME (checking the
# command name guards against a recycled pid); fail otherwise.
pid_of() {
    local pid
    [[ -s $2 ]] || return 1
    pid=$(<"$2")
    [[ $pid =~ ^[0-9]+$ && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == "$1" ]] || return 1
    running "$pid" && printf '%s\n' "$pid"
}

# pid_alive NAME PIDFILE: true if PIDFILE names a running process called NAME.
pid_alive() { pid_of "$1" "$2" >/dev/null; }

# stop_daemon NAME PIDFILE: SIGTERM the daemon, SIGKILL it if it is still there after 10 s; the pid
# file goes either way.
stop_daemon() {
    local pid
    if pid=$(pid_of "$1" "$2"); then
        log "stopping $(basename "$2" .pid) (pid $pid)"
        kill -TERM "$pid" 2>/dev/null || true
        for _ in $(seq 1 100); do
            running "$pid" || break
            sleep 0.1
        done
        if running "$pid"; then
            log "$1 did not exit after 10s; sending SIGKILL"
            kill -KILL "$pid" 2>/dev/null || true
            sleep 0.5
        fi
    fi
    rm -f "$2"
}

# cancel_jobs PARTITION: while the controller still answers, cancel the partition's jobs and wait up to
# 15 s for them to end (a job's slurmstepd is not a child of slurmd and would otherwise run on, orphaned).
cancel_jobs() {
    command -v scancel >/dev/null 2>&1 || return 0
    [[ -n $(squeue -h -o %i 2>/dev/null) ]] || return 0
    log "cancelling remaining jobs"
    scancel --partition="$1" 2>/dev/null || true
    for _ in $(seq 1 30); do
        [[ -z $(squeue -h -t running,completing -o %i 2>/dev/null) ]] && break
        sleep 0.5
    done
}

# not_exited NAME PIDFILE: false only once PIDFILE names a process that is no longer a running NAME
# (a daemon that has not written its pid file yet counts as still starting).
not_exited() { [[ ! -s $2 ]] || pid_alive "$1" "$2"; }

# wait_until TIMEOUT_S INTERVAL_S READY TIMEOUT_MESSAGE [DIED_MESSAGE ALIVE [ARG...]]: run the command
# READY every INTERVAL_S seconds until it succeeds. Dies with TIMEOUT_MESSAGE after TIMEOUT_S seconds
# of wall time, and with DIED_MESSAGE as soon as the command ALIVE ARG... fails (the daemon waited
# for has exited: no point waiting out the timeout).
wait_until() {
    local ready=$3 timeout_message=$4 interval_s=$2 died_message="" deadline=$((SECONDS + $1))
    shift 4
    if (($#)); then
        died_message=$1
        shift
    fi
    until "$ready"; do
        if (($#)) && ! "$@"; then die "$died_message"; fi
        ((SECONDS < deadline)) || die "$timeout_message"
        sleep "$interval_s"
    done
}

# apt_install LOG PACKAGE...: install Debian packages without recommends, apt-get's output in LOG.
# The daemon packages' maintainer scripts would start their services; a temporary policy-rc.d that
# exits 101 forbids that (the scripts start their daemons by hand), unless the machine has its own
# policy-rc.d, which is left alone. Ours goes right after the install and, through an EXIT trap, on
# every other exit path (a failed or interrupted install). The package lists are refreshed only when
# the install cannot proceed without it (fresh image with empty lists, or stale lists pointing at gone
# .debs). Fails when the install does, so that the caller can say what failed.
POLICY_RC_D=/usr/sbin/policy-rc.d
apt_install() {
    local apt_log=$1 our_policy=0 status=0
    shift
    if [[ ! -e $POLICY_RC_D ]]; then
        printf '#!/bin/sh\n# temporary, from shardfuse %s\nexit 101\n' "$(basename "$0")" >"$POLICY_RC_D"
        chmod 0755 "$POLICY_RC_D"
        our_policy=1
        trap 'rm -f "$POLICY_RC_D"' EXIT
    fi
    if ! apt_get_install "$@" >"$apt_log" 2>&1; then
        log "install failed with current package lists; running apt-get update"
        apt-get update -q >>"$apt_log" 2>&1 || true
        apt_get_install "$@" >>"$apt_log" 2>&1 || status=1
    fi
    if ((our_policy)); then
        rm -f "$POLICY_RC_D"
        trap - EXIT
    fi
    return "$status"
}
apt_get_install() {
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends \
        -o Dpkg::Options::=--force-confold "$@"
}

# stop_for_new_config PIDFILE...: the SLURM config changed and a node definition change needs a
# restart (`scontrol reconfigure` is not enough): SIGTERM each daemon still running from these pid
# files (the daemon's name is the file's up to the first '-': slurmd-node1.pid is a slurmd) and wait
# up to 10 s for it; the pid files go, so the start-up that follows starts them with the new config.
stop_for_new_config() {
    local pidfile name
    for pidfile in "$@"; do
        [[ -e $pidfile ]] || continue
        name=$(basename "$pidfile" .pid)
        name=${name%%-*}
        if pid_alive "$name" "$pidfile"; then
            log "config changed: stopping $(basename "$pidfile" .pid)"
            kill -TERM "$(<"$pidfile")" || true
            for _ in $(seq 1 50); do pid_alive "$name" "$pidfile" || break; sleep 0.2; done
        fi
        rm -f "$pidfile"
    done
}

# slurmctld_answers: the controller of SLURM_CONF (or /etc/slurm/slurm.conf) answers a ping.
slurmctld_answers() { scontrol ping 2>/dev/null | grep -q ' is UP'; }

# wait_for_slurmctld PIDFILE [HINT]: wait until slurmctld answers, bounded by wall time (a ping to a
# port that accepts but never answers takes MessageTimeout=10s); stop early if the daemon already died
# (e.g. port in use), HINT in parentheses after the message.
wait_for_slurmctld() {
    wait_until 30 0.3 slurmctld_answers "slurmctld does not answer 'scontrol ping' after 30s" \
        "slurmctld exited during startup${2:+ ($2)}" not_exited slurmctld "$1"
}

# node_state NODE: the node's state as sinfo reports it (empty while the controller does not answer).
node_state() { sinfo -h -n "$1" -o %T 2>/dev/null | head -n1; }

# nodes_usable NODE...: every node is schedulable (running jobs are fine).
nodes_usable() {
    local node
    for node in "$@"; do
        [[ $(node_state "$node") =~ ^(idle|mixed|allocated|completing)$ ]] || return 1
    done
}

# wait_for_nodes TIMEOUT_S NODE...: wait until every node is schedulable, resuming nodes that come up
# down or drained (e.g. left so in the saved state of an earlier run); after TIMEOUT_S seconds, log
# each node's state and reason and die.
wait_for_nodes() {
    local timeout_s=$1 node deadline
    shift
    deadline=$((SECONDS + timeout_s))
    until nodes_usable "$@"; do
        ((SECONDS < deadline)) || break
        for node in "$@"; do
            case $(node_state "$node") in
                down* | drain* | fail*)
                    scontrol update nodename="$node" state=resume >/dev/null 2>&1 || true ;;
            esac
        done
        sleep 1
    done
    if ! nodes_usable "$@"; then
        for node in "$@"; do
            log "node $node: state '$(node_state "$node")' $(scontrol show node "$node" 2>/dev/null | grep -o 'Reason=.*' || true)"
        done
        die "nodes not usable after ${timeout_s}s"
    fi
}
