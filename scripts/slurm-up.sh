#!/usr/bin/env bash
# Bring up a single-node SLURM cluster on this machine (Debian bookworm, run as
# root, no systemd, no cgroups) for tests and CI.
#
#   bash scripts/slurm-up.sh      # install if needed, start, wait for idle
#   bash scripts/slurm-down.sh    # stop what this script started
#
# Test-only shape (so the repository's own profiles and the README's examples can be exercised on a
# small machine): the node declares at least SHARDFUSE_SLURM_CPUS (default 4) CPUs even when it has
# fewer (SlurmdParameters=config_overrides), two partitions (`debug`, the default, and `gpu`), and
# 8 fake GPUs (gres/gpu backed by empty files: sbatch accepts and records --gres=gpu:N, no job
# sees a device). Never copy these three settings to a real cluster.
#
# All state lives in ${SHARDFUSE_SLURM_DIR:-/tmp/shardfuse-slurm}. The config
# is also installed as /etc/slurm/slurm.conf because sbatch/squeue/scancel/srun
# are spawned by pytest and by snakemake's slurm executor plugin without our
# environment, so SLURM_CONF cannot be relied on; the default path can.
#
# Idempotent: if the daemons started by a previous run are alive, the config
# is unchanged and the node is usable, it exits 0 without touching anything.
set -euo pipefail

STATE_DIR=${SHARDFUSE_SLURM_DIR:-/tmp/shardfuse-slurm}
WAIT_S=${SHARDFUSE_SLURM_WAIT_S:-60}
PARTITION=debug
GPU_PARTITION=gpu
NUM_GPUS=8
MIN_CPUS=${SHARDFUSE_SLURM_CPUS:-4}
ETC_CONF=/etc/slurm/slurm.conf
# First line of every config we write; lets us tell our file from a foreign one.
MARKER="# Managed by shardfuse scripts/slurm-up.sh -- do not edit, rerun the script."

log() { printf 'slurm-up: %s\n' "$*" >&2; }
die() { log "ERROR: $*"; dump_logs; exit 1; }

# Only the logs of the daemons this run manages (old slurmd-<node> logs of a
# different node set would just be noise); apt.log only if apt failed.
APT_FAILED=0
NODES=()
dump_logs() {
    local f files=("$STATE_DIR"/log/munged.{log,stderr} "$STATE_DIR"/log/slurmctld.{log,stderr})
    for f in "${NODES[@]}"; do files+=("$STATE_DIR/log/slurmd-$f".{log,stderr}); done
    ((APT_FAILED)) && files=("$STATE_DIR/log/apt.log")
    for f in "${files[@]}"; do
        [[ -s $f ]] || continue
        printf '\n===== tail -n 40 %s =====\n' "$f" >&2
        tail -n 40 "$f" >&2 || true
    done
}

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

[[ $(id -u) -eq 0 ]] || { echo "slurm-up: must run as root (installs packages, writes /etc)" >&2; exit 1; }

mkdir -p "$STATE_DIR"/{log,ctld,spool,munge}
chmod 0755 "$STATE_DIR"

# Serialise concurrent callers (e.g. two test sessions starting at once).
# Every daemon below is started with 9>&-: munged does not close inherited
# fds, and a munged holding fd 9 would keep this lock forever.
exec 9>"$STATE_DIR/.lock"
flock -w 300 9 || die "could not take $STATE_DIR/.lock"

# --------------------------------------------------------------------------
# 1. Packages, only if a command is missing (apt_install: no daemon starts
#    during the install). slurm-wlm is a metapackage that drags in ~40 plugin
#    packages (hdf5, rrd, influxdb, ...); the four below are all we need.
# --------------------------------------------------------------------------
PKGS=(munge slurmctld slurmd slurm-client)
missing=()
for cmd in munged munge unmunge slurmctld slurmd sbatch srun squeue scancel sinfo scontrol; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if ((${#missing[@]})); then
    log "installing ${PKGS[*]} (missing: ${missing[*]})"
    apt_install "$STATE_DIR/log/apt.log" "${PKGS[@]}" || {
        APT_FAILED=1
        die "apt-get install ${PKGS[*]} failed (see $STATE_DIR/log/apt.log)"
    }
fi

NODE=$(hostname -s)
NODES=("$NODE")

# --------------------------------------------------------------------------
# 2. Config. Hardware from `slurmd -C`: slurmd drains the node if the config
#    claims more CPUs/memory than it detects.
# --------------------------------------------------------------------------
hw=$(slurmd -C 2>/dev/null | head -n1)
get() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$hw"; }
CPUS=$(get CPUs)
BOARDS=$(get Boards)
SOCKETS=$(get SocketsPerBoard)
CORES=$(get CoresPerSocket)
THREADS=$(get ThreadsPerCore)
DETECTED_MB=$(get RealMemory)
[[ -n $CPUS && -n $DETECTED_MB ]] || die "cannot parse 'slurmd -C' output: $hw"
# Leave ~5% (>= 512 MB) to the OS and the daemons.
reserve=$((DETECTED_MB / 20))
((reserve < 512)) && reserve=512
MEM_MB=$((DETECTED_MB - reserve))
# Test-only: declare at least MIN_CPUS CPUs (more cores per socket) so a world-size-4 training's
# --cpus-per-task=4 is accepted on a 2-core machine; config_overrides stops slurmd from draining a
# node that claims more than it detects. The ranks then share the real cores.
[[ $MIN_CPUS =~ ^[1-9][0-9]*$ ]] || die "SHARDFUSE_SLURM_CPUS must be a positive integer (got '$MIN_CPUS')"
if ((CPUS < MIN_CPUS)); then
    CORES=$(((MIN_CPUS + BOARDS * SOCKETS * THREADS - 1) / (BOARDS * SOCKETS * THREADS)))
    CPUS=$((BOARDS * SOCKETS * CORES * THREADS))
fi
# Jobs that do not pass --mem would otherwise get the whole node and serialise.
DEF_MEM_PER_CPU=$((MEM_MB / CPUS))
((DEF_MEM_PER_CPU > 1024)) && DEF_MEM_PER_CPU=1024

new_conf=$(mktemp "$STATE_DIR/slurm.conf.XXXXXX")
cat >"$new_conf" <<EOF
$MARKER
# State dir: $STATE_DIR
ClusterName=shardfuse
SlurmctldHost=$NODE(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=6817
SlurmdPort=6818
AuthType=auth/munge
CredType=cred/munge
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
# No systemd/cgroups here: track processes via /proc, no task binding.
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
# Per-CPU + memory allocation so several small jobs share the node. CR_CPU
# (not CR_Core) so a 1-core/2-thread VM still yields two 1-CPU slots.
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=$DEF_MEM_PER_CPU
# No slurmdbd: job status comes from squeue (plugin: slurm-status-command
# squeue), so keep finished jobs visible for an hour; finished jobs are also
# appended to the jobcomp text log.
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/jobcomp.log
MinJobAge=3600
# Reject impossible requests (e.g. -N2 on one node) at submit time instead of
# leaving them PENDING (Reason=PartitionNodeLimit) forever.
EnforcePartLimits=ALL
# A single node that went away (restart) must come back on its own.
ReturnToService=2
SlurmctldTimeout=30
SlurmdTimeout=60
InactiveLimit=0
KillWait=5
Waittime=0
# Test-only (see the header): the node's declared CPUs win over what slurmd detects, and its
# GPUs are fake (gres.conf below), so --gres=gpu:N is accepted and recorded.
SlurmdParameters=config_overrides
GresTypes=gpu
NodeName=$NODE NodeAddr=127.0.0.1 NodeHostname=$NODE Port=6818 CPUs=$CPUS Boards=$BOARDS SocketsPerBoard=$SOCKETS CoresPerSocket=$CORES ThreadsPerCore=$THREADS RealMemory=$MEM_MB Gres=gpu:$NUM_GPUS State=UNKNOWN
PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP
PartitionName=$GPU_PARTITION Nodes=ALL Default=NO MaxTime=INFINITE State=UP
EOF
# Fake GPUs: slurmd drops GPUs without device files, so each is an empty regular file in the state dir
# (SLURM only checks that it exists; no job can use it as a device). No autodetection.
mkdir -p "$STATE_DIR/fake-gpus"
for ((i = 0; i < NUM_GPUS; i++)); do : >"$STATE_DIR/fake-gpus/gpu$i"; done
new_gres=$(mktemp "$STATE_DIR/gres.conf.XXXXXX")
printf '%s\nAutoDetect=off\nNodeName=%s Name=gpu File=%s/fake-gpus/gpu[0-%s]\n' \
    "$MARKER" "$NODE" "$STATE_DIR" "$((NUM_GPUS - 1))" >"$new_gres"

ETC_GRES=$(dirname "$ETC_CONF")/gres.conf
conf_changed=1
if [[ -f $ETC_CONF ]] && cmp -s "$new_conf" "$ETC_CONF" && [[ -f $ETC_GRES ]] && cmp -s "$new_gres" "$ETC_GRES"; then
    conf_changed=0
fi

# --------------------------------------------------------------------------
# 3. Fast path: everything we started is up and the config is current.
# --------------------------------------------------------------------------
all_slurmd_alive() {
    local n
    for n in "${NODES[@]}"; do pid_alive slurmd "$STATE_DIR/slurmd-$n.pid" || return 1; done
}
if ((conf_changed == 0)) \
    && pid_alive slurmctld "$STATE_DIR/slurmctld.pid" \
    && all_slurmd_alive \
    && munge -n 2>/dev/null | unmunge >/dev/null 2>&1 \
    && nodes_usable "${NODES[@]}"; then
    rm -f "$new_conf" "$new_gres"
    log "already up: $(sinfo -h -N -o '%N=%T' | sort -u | tr '\n' ' ')"
    exit 0
fi

# --------------------------------------------------------------------------
# 4. Install the config. Keep a foreign /etc/slurm/slurm.conf (once) so
#    slurm-down.sh can put it back.
# --------------------------------------------------------------------------
mkdir -p /etc/slurm
if [[ -f $ETC_CONF ]] && [[ $(head -n1 "$ETC_CONF") != "$MARKER" ]] && [[ ! -e $ETC_CONF.pre-shardfuse ]]; then
    log "backing up existing $ETC_CONF to $ETC_CONF.pre-shardfuse"
    cp -p "$ETC_CONF" "$ETC_CONF.pre-shardfuse"
fi
if [[ -f $ETC_GRES ]] && [[ $(head -n1 "$ETC_GRES") != "$MARKER" ]] && [[ ! -e $ETC_GRES.pre-shardfuse ]]; then
    cp -p "$ETC_GRES" "$ETC_GRES.pre-shardfuse"
fi
chmod 0644 "$new_conf" "$new_gres"
cp "$new_conf" "$STATE_DIR/slurm.conf"
mv -f "$new_gres" "$ETC_GRES"
mv -f "$new_conf" "$ETC_CONF"

# If our daemons run with an old config, restart them. The glob also catches
# slurmds of nodes no longer in the config.
if ((conf_changed)); then
    stop_for_new_config "$STATE_DIR"/slurmd*.pid "$STATE_DIR/slurmctld.pid"
fi

# --------------------------------------------------------------------------
# 5. munge. slurm's auth/munge talks to the default socket
#    /run/munge/munge.socket.2, so munged keeps its default socket; its pid
#    file and log go to the state dir. If some other munged already answers
#    (e.g. a system one), use it and do not start another.
# --------------------------------------------------------------------------
if ! munge -n 2>/dev/null | unmunge >/dev/null 2>&1; then
    mkdir -p /etc/munge /run/munge /var/lib/munge /var/log/munge
    if [[ ! -s /etc/munge/munge.key ]]; then
        log "creating /etc/munge/munge.key"
        if command -v mungekey >/dev/null 2>&1; then
            mungekey --create --keyfile=/etc/munge/munge.key --force
        else
            dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none
        fi
    fi
    munge_user=root
    if id munge >/dev/null 2>&1; then munge_user=munge; fi
    chown "$munge_user:$munge_user" /etc/munge /etc/munge/munge.key /run/munge /var/lib/munge /var/log/munge "$STATE_DIR/munge"
    chmod 0700 /etc/munge "$STATE_DIR/munge"
    chmod 0400 /etc/munge/munge.key
    chmod 0755 /run/munge
    log "starting munged as $munge_user"
    munged_args=(--pid-file="$STATE_DIR/munge/munged.pid" --log-file="$STATE_DIR/munge/munged.log")
    if [[ $munge_user == munge ]]; then
        runuser -u munge -- munged "${munged_args[@]}" 2>>"$STATE_DIR/log/munged.stderr" 9>&- \
            || die "munged failed to start"
    else
        # munged refuses to run as root unless forced.
        munged --force "${munged_args[@]}" 2>>"$STATE_DIR/log/munged.stderr" 9>&- \
            || die "munged failed to start"
    fi
    # The munged pid file lives in a munge-owned 0700 dir; mirror it next to
    # the slurm ones so slurm-down.sh finds all three in one place.
    for _ in $(seq 1 50); do [[ -s $STATE_DIR/munge/munged.pid ]] && break; sleep 0.1; done
    cp "$STATE_DIR/munge/munged.pid" "$STATE_DIR/munged.pid" || die "munged wrote no pid file"
    munge -n | unmunge >/dev/null || die "munge -n | unmunge failed"
fi
# Expose munged's log with the others for dump_logs.
ln -sfn ../munge/munged.log "$STATE_DIR/log/munged.log" 2>/dev/null || true

# --------------------------------------------------------------------------
# 6. slurmctld + slurmd. Both daemonise themselves (setsid), so they outlive
#    the calling shell/CI step; they write the pid files named in slurm.conf.
#    stderr is kept because config errors are printed before the log opens.
# --------------------------------------------------------------------------
if ! pid_alive slurmctld "$STATE_DIR/slurmctld.pid"; then
    rm -f "$STATE_DIR/slurmctld.pid"
    log "starting slurmctld"
    slurmctld -f "$ETC_CONF" 2>>"$STATE_DIR/log/slurmctld.stderr" 9>&- || die "slurmctld failed to start"
fi
wait_for_slurmctld "$STATE_DIR/slurmctld.pid"

for n in "${NODES[@]}"; do
    if ! pid_alive slurmd "$STATE_DIR/slurmd-$n.pid"; then
        rm -f "$STATE_DIR/slurmd-$n.pid"
        mkdir -p "$STATE_DIR/spool/$n"
        log "starting slurmd -N $n"
        slurmd -f "$ETC_CONF" -N "$n" 2>>"$STATE_DIR/log/slurmd-$n.stderr" 9>&- || die "slurmd -N $n failed to start"
    fi
done

# --------------------------------------------------------------------------
# 7. Wait until every node is schedulable; resume nodes that come up down or
#    drained (e.g. left so in the saved state of an earlier run).
# --------------------------------------------------------------------------
wait_for_nodes "$WAIT_S" "${NODES[@]}"

pid_alive slurmctld "$STATE_DIR/slurmctld.pid" || die "slurmctld pid file missing or stale"
all_slurmd_alive || die "a slurmd pid file is missing or stale"

log "up: node=$NODE ($(node_state "$NODE")) cpus=$CPUS (detected $(get CPUs)) gpus=$NUM_GPUS (fake) memory=${MEM_MB}MB (detected ${DETECTED_MB}MB) partitions=$PARTITION(default),$GPU_PARTITION state_dir=$STATE_DIR"
