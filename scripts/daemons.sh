#!/usr/bin/env bash
# Shared by the up/down scripts (sourced, not run): find and stop the daemons they started, by pid file.
# The sourcing script defines log() first.

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
