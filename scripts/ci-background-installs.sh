#!/usr/bin/env bash
# What only the slow and service tiers use, installed by .ci/run in the background beside the fast
# tier: Debian's chromium for the MLflow UI test (Playwright drives it), iproute2 for the two-node
# cluster in network namespaces, and mergekit 0.1.5 in a virtual environment of its own (it pulls
# transformers; torch stays on the CPU build of constraints.txt): the second reference for the merge
# methods (tests/services/test_mergekit_reference.py runs bench/mergekit_check.py with it).
#   bash scripts/ci-background-installs.sh MERGEKIT_VENV
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$1
started=$(date +%s)
missing=()
for pkg in chromium iproute2; do
    dpkg -s "$pkg" >/dev/null 2>&1 || missing+=("$pkg")
done
if ((${#missing[@]})); then
    # .ci/run ran apt-get update; slurm-up.sh's installs have ended (the lock timeout is a safeguard).
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
        -o DPkg::Lock::Timeout=600 "${missing[@]}"
fi
if ! "$venv/bin/python" -c "import mergekit" 2>/dev/null; then
    made=
    if [ "${CI_INSTALLER:-pip}" = uv ]; then  # scripts/ci-python.sh: uv, pinned to the disk's CPU torch
        "$CI_UV" venv -q --seed --allow-existing --python "${CI_PYTHON:-python3}" "$venv" &&
            grep '^torch==' constraints.txt >"$venv/constraints.txt" &&
            "$CI_UV" pip install -q --python "$venv/bin/python" -c "$venv/constraints.txt" \
                torch mergekit==0.1.5 && made=uv
        [ -n "$made" ] || { echo "uv could not make $venv; pip makes it instead" && rm -rf "$venv"; }
    fi
    if [ -z "$made" ]; then
        "${CI_PYTHON:-python3}" -m venv "$venv"
        grep '^torch==' constraints.txt >"$venv/constraints.txt"
        "$venv/bin/pip" install -q -c "$venv/constraints.txt" torch mergekit==0.1.5
    fi
fi
echo "ci-background-installs: $(($(date +%s) - started)) s"
