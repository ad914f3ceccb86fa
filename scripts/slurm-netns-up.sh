#!/usr/bin/env bash
# Bring up a SECOND, independent SLURM cluster of several nodes on this one machine (default 2):
# each slurmd runs in its own network + UTS + mount namespace (its own address and host name),
# joined by veth pairs to a bridge on the host, where slurmctld and a private munged run.
# Needs root, iproute2, util-linux (unshare) and Debian's munge/slurm packages; no systemd.
#
#   bash scripts/slurm-netns-up.sh              # start (idempotent), wait until all nodes are idle
#   export SLURM_CONF=/tmp/shardfuse-slurm-netns/slurm.conf   # clients on the host pick this cluster
#   sbatch -N2 --wrap 'srun hostname'           # -> node1, node2
#   bash scripts/slurm-netns-down.sh            # remove every namespace, link, file and daemon
#
# Layout (defaults; see scripts/README-netns.md):
#   bridge sfnbr0 10.231.187.1/24 on the host: slurmctld (port 6827) and munged (own socket)
#   netns sfn-node<i>: interface sfn0 = 10.231.187.<10+i>/24, host name node<i>, slurmd (port 6828)
#   host-side veth ends sfn-h<i>, enslaved to the bridge
#
# Each slurmd also gets a private mount namespace in which $STATE_DIR/nodes/<node>/hosts and
# .../slurm are bind-mounted over /etc/hosts and /etc/slurm; slurmd's job steps inherit it, so jobs
# find this cluster's config at the default path. That matters because the Snakemake job-step
# plugin strips SLURM_CONF (with all SLURM_* variables) before a rule's `srun` runs. The host's
# /etc/hosts and /etc/slurm are never touched: the cluster of scripts/slurm-up.sh keeps running.
# (`ip netns exec` would do those bind mounts from /etc/netns/<ns>, but it also remounts /sys,
# which hides /sys/fs/cgroup, and slurmd 22.05 refuses to start without it.)
set -euo pipefail

STATE_DIR=${SHARDFUSE_NETNS_DIR:-/tmp/shardfuse-slurm-netns}
NNODES=${SHARDFUSE_NETNS_NODES:-2}
# First three octets of the /24 the harness creates; it must not exist on this machine.
NET=${SHARDFUSE_NETNS_NET:-10.231.187}
CTLD_PORT=${SHARDFUSE_NETNS_CTLD_PORT:-6827}
SLURMD_PORT=${SHARDFUSE_NETNS_SLURMD_PORT:-6828}
WAIT_S=${SHARDFUSE_NETNS_WAIT_S:-60}
# CPUs each node declares; default: what slurmd detects, but at least 4, so one node can run a
# 4-rank job (world size 4 on one node vs 2 x 2) even on a 2-core machine (oversubscribed).
NODE_CPUS=${SHARDFUSE_NETNS_CPUS:-}
BRIDGE=sfnbr0
IFACE=sfn0
PARTITION=netns
CONF=$STATE_DIR/slurm.conf
MUNGE_SOCKET=$STATE_DIR/munge/munge.socket
export SLURM_CONF=$CONF

log() { printf 'slurm-netns-up: %s\n' "$*" >&2; }
# Daemon logs are worth showing only once daemons are involved (section 3 on).
SHOW_LOGS=0
die() {
    log "ERROR: $*"
    ((SHOW_LOGS)) || exit 1
    local f
    for f in "$STATE_DIR"/log/*; do
        [[ -s $f ]] || continue
        printf '\n===== tail -n 30 %s =====\n' "$f" >&2
        tail -n 30 "$f" >&2 || true
    done
    exit 1
}
# A step without its own message (e.g. an `ip` call the sandbox refuses) still says what failed.
trap 'log "ERROR: line $LINENO: \`$BASH_COMMAND\` failed"' ERR

# Names derive from the index only, so the down script finds everything without a record.
ns_of() { echo "sfn-node$1"; }
node_of() { echo "node$1"; }
addr_of() { echo "$NET.$((10 + $1))"; }
CTL_ADDR=$NET.1

# shellcheck source=scripts/daemons.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemons.sh"

[[ $(id -u) -eq 0 ]] || { echo "slurm-netns-up: must run as root (namespaces, links)" >&2; exit 1; }
[[ $NNODES =~ ^[2-8]$ ]] || { echo "slurm-netns-up: SHARDFUSE_NETNS_NODES must be 2..8" >&2; exit 1; }
[[ $NET =~ ^[0-9]+\.[0-9]+\.[0-9]+$ ]] || { echo "slurm-netns-up: SHARDFUSE_NETNS_NET must look like 10.231.187" >&2; exit 1; }

mkdir -p "$STATE_DIR"/{log,ctld,spool,munge}
chmod 0755 "$STATE_DIR"
# Serialise concurrent up/down calls. Daemons get 9>&- so they do not inherit the lock.
exec 9>"$STATE_DIR/.lock"
flock -w 300 9 || die "could not take $STATE_DIR/.lock"

# --------------------------------------------------------------------------------------------
# 1. Packages, only if a command is missing (apt_install: no daemon starts during the install).
# --------------------------------------------------------------------------------------------
missing=()
for cmd in ip unshare nsenter flock munged munge unmunge slurmctld slurmd sbatch srun squeue scontrol sinfo; do
    command -v "$cmd" >/dev/null 2>&1 || missing+=("$cmd")
done
if ((${#missing[@]})); then
    PKGS=(iproute2 util-linux munge slurmctld slurmd slurm-client)
    log "installing ${PKGS[*]} (missing: ${missing[*]})"
    apt_install "$STATE_DIR/log/apt.log" "${PKGS[@]}" || die "apt-get install ${PKGS[*]} failed ($STATE_DIR/log/apt.log)"
fi

# --------------------------------------------------------------------------------------------
# 2. Network: bridge on the host, one namespace + veth pair per node. Each step checks first,
#    so a rerun repairs a partial setup (e.g. a node whose namespace was removed).
# --------------------------------------------------------------------------------------------
# Refuse a subnet that already exists here on anything but our bridge: only addresses this
# harness creates may be used.
if ip -4 -o addr show | awk -v b="$BRIDGE" '$2 != b {print $4}' | grep -q "^$NET\." \
    || ip -4 route show | grep -v " dev $BRIDGE " | grep -q "^$NET\."; then
    die "$NET.0/24 is already in use on this machine (address or route); pick another with SHARDFUSE_NETNS_NET"
fi
if ! ip link show "$BRIDGE" >/dev/null 2>&1; then
    log "creating bridge $BRIDGE $CTL_ADDR/24"
    ip link add "$BRIDGE" type bridge || die "cannot create a bridge (ip link add type bridge)"
fi
ip -4 -o addr show dev "$BRIDGE" | grep -q " $CTL_ADDR/24 " || ip addr add "$CTL_ADDR/24" dev "$BRIDGE"
ip link set "$BRIDGE" up

# Every namespace sees the same /etc/hosts: its own name resolves to its own bridge address
# (gloo and torchrun's c10d store pick addresses by resolving host names), never to 127.0.0.1.
hosts_file=$(mktemp)
{
    printf '127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n'
    printf '%s\t%s\n' "$CTL_ADDR" "$(hostname -s)"
    for ((i = 1; i <= NNODES; i++)); do printf '%s\t%s\n' "$(addr_of "$i")" "$(node_of "$i")"; done
} >"$hosts_file"

for ((i = 1; i <= NNODES; i++)); do
    ns=$(ns_of "$i")
    host_end=sfn-h$i
    if ! ip netns list | grep -qw "^$ns"; then
        log "creating namespace $ns ($(node_of "$i") $(addr_of "$i"))"
        ip netns add "$ns" || die "ip netns add $ns failed"
    fi
    if ! ip netns exec "$ns" ip link show "$IFACE" >/dev/null 2>&1; then
        ip link del "$host_end" 2>/dev/null || true
        ip link add "$host_end" type veth peer name "sfn-n$i" || die "cannot create veth $host_end"
        ip link set "sfn-n$i" netns "$ns"
        # Same interface name in every node: GLOO_SOCKET_IFNAME=sfn0 works on all of them.
        ip netns exec "$ns" ip link set "sfn-n$i" name "$IFACE"
    fi
    ip link set "$host_end" master "$BRIDGE"
    ip link set "$host_end" up
    ip netns exec "$ns" ip -4 -o addr show dev "$IFACE" | grep -q " $(addr_of "$i")/24 " \
        || ip netns exec "$ns" ip addr add "$(addr_of "$i")/24" dev "$IFACE"
    ip netns exec "$ns" ip link set lo up
    ip netns exec "$ns" ip link set "$IFACE" up
    mkdir -p "$STATE_DIR/nodes/$(node_of "$i")/slurm"
    cp "$hosts_file" "$STATE_DIR/nodes/$(node_of "$i")/hosts"
done
rm -f "$hosts_file"

# --------------------------------------------------------------------------------------------
# 3. munge: a private munged with its own key and socket (AuthInfo=socket=...), so this cluster
#    neither depends on nor disturbs the munged of scripts/slurm-up.sh. The socket is a file on
#    the shared filesystem, reachable from every network namespace.
# --------------------------------------------------------------------------------------------
SHOW_LOGS=1
munge_ok() { munge -S "$MUNGE_SOCKET" -n 2>/dev/null | unmunge -S "$MUNGE_SOCKET" >/dev/null 2>&1; }
if ! pid_alive munged "$STATE_DIR/munged.pid" || ! munge_ok; then
    chmod 0700 "$STATE_DIR/munge"
    if [[ ! -s $STATE_DIR/munge/munge.key ]]; then
        dd if=/dev/urandom of="$STATE_DIR/munge/munge.key" bs=1024 count=1 status=none
    fi
    chmod 0400 "$STATE_DIR/munge/munge.key"
    rm -f "$MUNGE_SOCKET" "$MUNGE_SOCKET.lock" "$STATE_DIR/munged.pid"
    log "starting munged (socket $MUNGE_SOCKET)"
    # --force: munged refuses to run as root otherwise (and warns about /tmp's permissions).
    munged --force --socket="$MUNGE_SOCKET" --key-file="$STATE_DIR/munge/munge.key" \
        --pid-file="$STATE_DIR/munged.pid" --log-file="$STATE_DIR/log/munged.log" \
        --seed-file="$STATE_DIR/munge/munged.seed" 2>>"$STATE_DIR/log/munged.stderr" 9>&- \
        || die "munged failed to start"
    for _ in $(seq 1 50); do munge_ok && break; sleep 0.1; done
    munge_ok || die "munge -S $MUNGE_SOCKET -n | unmunge failed"
fi
for ((i = 1; i <= NNODES; i++)); do
    ip netns exec "$(ns_of "$i")" sh -c "munge -S '$MUNGE_SOCKET' -n | unmunge -S '$MUNGE_SOCKET' >/dev/null" \
        || die "munge does not work from inside namespace $(ns_of "$i")"
done

# --------------------------------------------------------------------------------------------
# 4. Config. Every node declares NODE_CPUS CPUs and a share of the memory (neither is enforced:
#    no cgroups). Claiming more CPUs than slurmd detects needs SlurmdParameters=config_overrides,
#    without which slurmd would drain the node.
# --------------------------------------------------------------------------------------------
hw=$(slurmd -C 2>/dev/null | head -n1)
get() { sed -n "s/.* $1=\([0-9]*\).*/\1/p" <<<"$hw"; }
DETECTED_CPUS=$(get CPUs)
DETECTED_MB=$(get RealMemory)
[[ -n $DETECTED_CPUS && -n $DETECTED_MB ]] || die "cannot parse 'slurmd -C' output: $hw"
CPUS=${NODE_CPUS:-$((DETECTED_CPUS > 4 ? DETECTED_CPUS : 4))}
[[ $CPUS =~ ^[1-9][0-9]*$ ]] || die "SHARDFUSE_NETNS_CPUS must be a positive integer (got '$CPUS')"
if ((CPUS == DETECTED_CPUS)); then
    layout="Boards=$(get Boards) SocketsPerBoard=$(get SocketsPerBoard) CoresPerSocket=$(get CoresPerSocket) ThreadsPerCore=$(get ThreadsPerCore)"
    overrides=""
else
    layout="Sockets=1 CoresPerSocket=$CPUS ThreadsPerCore=1"
    overrides="SlurmdParameters=config_overrides"
fi
MEM_MB=$((DETECTED_MB * 9 / 10 / NNODES))
node_line() {
    echo "NodeName=$(node_of "$1") NodeAddr=$(addr_of "$1") NodeHostname=$(node_of "$1") CPUs=$CPUS" \
        "$layout RealMemory=$MEM_MB State=UNKNOWN"
}
new_conf=$(mktemp "$STATE_DIR/slurm.conf.XXXXXX")
cat >"$new_conf" <<EOF
# Managed by shardfuse scripts/slurm-netns-up.sh -- do not edit, rerun the script.
# Clients on the host: export SLURM_CONF=$CONF. Inside the node namespaces this file is
# bind-mounted at /etc/slurm/slurm.conf.
ClusterName=shardfuse-netns
# slurmctld only starts on a host listed here by its own short name; clients use the address.
SlurmctldHost=$(hostname -s)($CTL_ADDR)
SlurmctldPort=$CTLD_PORT
SlurmdPort=$SLURMD_PORT
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket=$MUNGE_SOCKET
StateSaveLocation=$STATE_DIR/ctld
SlurmdSpoolDir=$STATE_DIR/spool/%n
SlurmctldPidFile=$STATE_DIR/slurmctld.pid
SlurmdPidFile=$STATE_DIR/slurmd-%n.pid
SlurmctldLogFile=$STATE_DIR/log/slurmctld.log
SlurmdLogFile=$STATE_DIR/log/slurmd-%n.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
SwitchType=switch/none
SchedulerType=sched/backfill
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU_Memory
DefMemPerCPU=1024
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/filetxt
JobCompLoc=$STATE_DIR/jobcomp.log
MinJobAge=3600
EnforcePartLimits=ALL
# A lost node must fail the job (NODE_FAIL), not requeue it behind Snakemake's back; Snakemake's
# --retries resubmits, and the node rejoins on its own when its slurmd registers again.
JobRequeue=0
ReturnToService=2
# Notice a dead slurmd within seconds (the controller pings every SlurmdTimeout/3).
SlurmdTimeout=10
SlurmctldTimeout=30
InactiveLimit=0
KillWait=5
Waittime=0
MessageTimeout=10
EOF
[[ -n $overrides ]] && printf '# Nodes declare %s CPUs; slurmd detects %s.\n%s\n' "$CPUS" "$DETECTED_CPUS" "$overrides" >>"$new_conf"
for ((i = 1; i <= NNODES; i++)); do node_line "$i"; done >>"$new_conf"
echo "PartitionName=$PARTITION Nodes=ALL Default=YES MaxTime=INFINITE State=UP" >>"$new_conf"
chmod 0644 "$new_conf"

conf_changed=1
if [[ -f $CONF ]] && cmp -s "$new_conf" "$CONF"; then conf_changed=0; fi
mv -f "$new_conf" "$CONF"
for ((i = 1; i <= NNODES; i++)); do cp "$CONF" "$STATE_DIR/nodes/$(node_of "$i")/slurm/slurm.conf"; done

if ((conf_changed)); then
    stop_for_new_config "$STATE_DIR"/slurmd-*.pid "$STATE_DIR/slurmctld.pid"
fi

# --------------------------------------------------------------------------------------------
# 5. slurmctld on the host; one slurmd per node namespace, each with its own host name.
# --------------------------------------------------------------------------------------------
if ! pid_alive slurmctld "$STATE_DIR/slurmctld.pid"; then
    rm -f "$STATE_DIR/slurmctld.pid"
    log "starting slurmctld ($CTL_ADDR:$CTLD_PORT)"
    slurmctld -f "$CONF" 2>>"$STATE_DIR/log/slurmctld.stderr" 9>&- || die "slurmctld failed to start"
fi
wait_for_slurmctld "$STATE_DIR/slurmctld.pid" "port $CTLD_PORT in use?"

for ((i = 1; i <= NNODES; i++)); do
    node=$(node_of "$i")
    pid_alive slurmd "$STATE_DIR/slurmd-$node.pid" && continue
    rm -f "$STATE_DIR/slurmd-$node.pid"
    mkdir -p "$STATE_DIR/spool/$node"
    log "starting slurmd -N $node in $(ns_of "$i")"
    # The node's network namespace, plus new UTS (own host name: socket.gethostname() in a job
    # says node<i>) and mount namespaces (private by default: the bind mounts stay inside).
    # slurmd daemonises and stays in all three, and so do its job steps.
    nsenter --net="/run/netns/$(ns_of "$i")" unshare --uts --mount sh -c \
        "mount --bind '$STATE_DIR/nodes/$node/hosts' /etc/hosts \
        && mount --bind '$STATE_DIR/nodes/$node/slurm' /etc/slurm \
        && hostname '$node' && exec slurmd -f /etc/slurm/slurm.conf -N '$node'" \
        2>>"$STATE_DIR/log/slurmd-$node.stderr" 9>&- || die "slurmd -N $node failed to start"
done

# --------------------------------------------------------------------------------------------
# 6. Wait until every node is schedulable; resume nodes left down/drained by an earlier run.
# --------------------------------------------------------------------------------------------
nodes=()
for ((i = 1; i <= NNODES; i++)); do nodes+=("$(node_of "$i")"); done
wait_for_nodes "$WAIT_S" "${nodes[@]}"
log "up: $(sinfo -h -N -o '%N=%T' | sort -u | tr '\n' ' ')cpus=$CPUS (detected $DETECTED_CPUS) mem=${MEM_MB}MB per node; export SLURM_CONF=$CONF"
