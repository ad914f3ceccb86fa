#!/usr/bin/env bash
# Smoke test for the cluster started by scripts/slurm-up.sh. Exits non-zero
# on the first failure. Takes ~25 s.
#
# Checks: sbatch --wait; srun inside an sbatch allocation; squeue; two 1-CPU
# jobs running at the same time (if the node has >= 2 CPUs); scancel ends in
# CANCELLED; and, if <repo>/.venv/bin/python exists, that a job can run it
# (jobs inherit the submitter's environment: sbatch defaults to --export=ALL).
set -euo pipefail

STATE_DIR=${SHARDFUSE_SLURM_DIR:-/tmp/shardfuse-slurm}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
PY=${SHARDFUSE_CHECK_PYTHON:-$REPO/.venv/bin/python}

# Job output must land on a path the job can write; same host, so the state
# dir works. Fresh dir per run so old files cannot fake a pass.
WORK=$(mktemp -d "$STATE_DIR/check.XXXXXX")
JOBS=()
cleanup() {
    # Never leave sleepers behind, even when a check fails midway.
    if ((${#JOBS[@]})); then scancel "${JOBS[@]}" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

pass() { printf 'slurm-check: ok   %s\n' "$*"; }
fail() { printf 'slurm-check: FAIL %s\n' "$*" >&2; exit 1; }

job_state() { scontrol show job "$1" 2>/dev/null | sed -n 's/.*JobState=\([A-Z_]*\).*/\1/p'; }

# wait_state JOBID STATE SECONDS
wait_state() {
    local i
    for ((i = 0; i < $3 * 4; i++)); do
        [[ $(job_state "$1") == "$2" ]] && return 0
        sleep 0.25
    done
    return 1
}

# sbatch_wait ARGS...: blocking submit with an outer bound, so a job stuck in
# PENDING fails the check instead of hanging CI.
sbatch_wait() { timeout 120 sbatch --wait --quiet --chdir="$WORK" "$@"; }

# 0. Controller reachable and node usable.
scontrol ping | grep -q UP || fail "scontrol ping: controller not UP"
node_state=$(sinfo -h -o %T | head -n1)
[[ $node_state =~ ^(idle|mixed|allocated|completing)$ ]] || fail "node state is '$node_state'"
pass "controller up, node $node_state"

# 1. Batch job writes the hostname.
sbatch_wait -J sf-check-hostname -o "$WORK/1.out" --wrap "hostname > $WORK/hostname.txt" \
    || fail "sbatch --wait hostname job ($(cat "$WORK/1.out" 2>/dev/null))"
[[ $(<"$WORK/hostname.txt") == "$(hostname)" ]] || fail "hostname.txt has '$(<"$WORK/hostname.txt")'"
pass "sbatch --wait --wrap hostname"

# 2. srun inside an allocation (how multi-node training launches ranks).
sbatch_wait -J sf-check-srun -N1 -n1 -o "$WORK/2.out" --wrap "srun -N1 -n1 hostname > $WORK/srun.txt" \
    || fail "srun inside sbatch ($(cat "$WORK/2.out" 2>/dev/null))"
[[ $(<"$WORK/srun.txt") == "$(hostname)" ]] || fail "srun.txt has '$(<"$WORK/srun.txt")'"
pass "srun -N1 -n1 hostname inside sbatch"

# 2b. Impossible node counts are refused at submit time (EnforcePartLimits),
#     not left PENDING forever; with >1 (virtual) node, one srun task per node.
nnodes=$(sinfo -h -N -o %N | sort -u | wc -l)
if sbatch -N$((nnodes + 1)) -o /dev/null --wrap true >/dev/null 2>&1; then
    fail "sbatch -N$((nnodes + 1)) on a $nnodes-node cluster was accepted"
fi
pass "sbatch -N$((nnodes + 1)) rejected at submit time"
if ((nnodes >= 2)); then
    sbatch_wait -J sf-check-multi -N2 --ntasks-per-node=1 -o "$WORK/2c.out" \
        --wrap "srun bash -c 'echo \$SLURM_PROCID \$SLURMD_NODENAME' > $WORK/multi.txt" \
        || fail "srun over 2 nodes ($(cat "$WORK/2c.out" 2>/dev/null))"
    [[ $(sort -u "$WORK/multi.txt" | awk '{print $2}' | sort -u | wc -l) -eq 2 ]] \
        || fail "srun -N2 did not run one task per node: $(tr '\n' ';' <"$WORK/multi.txt")"
    pass "srun one task per node on 2 nodes: $(sort "$WORK/multi.txt" | tr '\n' ';')"
fi

# 3. squeue answers (the snakemake plugin polls job status with it).
squeue >/dev/null || fail "squeue"
squeue -h --states=all -j "$(squeue -h --states=all -n sf-check-srun -o %i | tail -n1)" -o %T | grep -q COMPLETED \
    || fail "finished job not visible as COMPLETED in squeue --states=all (MinJobAge?)"
pass "squeue (finished jobs visible)"

# 4. Two 1-CPU jobs run concurrently.
cpus=$(sinfo -h -o %c | head -n1)
if ((cpus >= 2)); then
    a=$(sbatch --parsable -J sf-check-par -c1 --mem=500 -o /dev/null --wrap 'sleep 60')
    b=$(sbatch --parsable -J sf-check-par -c1 --mem=500 -o /dev/null --wrap 'sleep 60')
    JOBS+=("$a" "$b")
    if ! { wait_state "$a" RUNNING 20 && wait_state "$b" RUNNING 20; }; then
        fail "two 1-CPU jobs not running together: $a=$(job_state "$a") $b=$(job_state "$b")"
    fi
    scancel "$a" "$b"
    pass "two -c1 --mem=500 jobs RUNNING concurrently"
else
    pass "concurrency check skipped (node has $cpus CPU)"
fi

# 5. scancel of a running job ends in CANCELLED.
j=$(sbatch --parsable -J sf-check-cancel -o /dev/null --wrap 'sleep 300')
JOBS+=("$j")
wait_state "$j" RUNNING 20 || fail "sleep job $j not RUNNING (state $(job_state "$j"))"
scancel "$j"
wait_state "$j" CANCELLED 20 || fail "job $j not CANCELLED after scancel (state $(job_state "$j"))"
# jobcomp/filetxt appends when the job record completes; give it a moment.
for _ in $(seq 1 20); do
    grep -q "JobId=$j .*JobState=CANCELLED" "$STATE_DIR/jobcomp.log" 2>/dev/null && break
    sleep 0.25
done
grep -q "JobId=$j .*JobState=CANCELLED" "$STATE_DIR/jobcomp.log" \
    || fail "job $j CANCELLED not in $STATE_DIR/jobcomp.log"
pass "scancel -> CANCELLED (scontrol + jobcomp.log)"

# 6. The project venv is usable from a job.
if [[ -x $PY ]]; then
    sbatch_wait -J sf-check-venv -o "$WORK/6.out" --wrap "$PY -c 'import sys; print(sys.version)'" \
        || fail "venv python in job ($(cat "$WORK/6.out" 2>/dev/null))"
    pass "job ran $PY: $(head -n1 "$WORK/6.out")"
else
    pass "venv check skipped ($PY not found)"
fi

echo "slurm-check: all checks passed"
