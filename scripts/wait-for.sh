#!/usr/bin/env bash
# Wait for a background step that writes its exit status to a file when it ends (.ci/run's installs
# beside the fast tier): bash scripts/wait-for.sh STATUS_FILE LOG_FILE. Prints the step's log and exits
# with its status when it failed; exits 0 at once when it succeeded. Gives up after an hour.
set -u
status_file=$1 log=$2
started=$(date +%s)
while [ ! -s "$status_file" ]; do
    if (($(date +%s) - started > 3600)); then
        echo "wait-for: $status_file was not written within an hour; see $log" >&2
        exit 1
    fi
    sleep 1
done
status=$(cat "$status_file")
waited=$(($(date +%s) - started))
if [ "$status" != 0 ]; then
    echo "wait-for: the background step failed (exit status $status); its log, $log:" >&2
    cat "$log" >&2
    exit 1
fi
echo "wait-for: the background step had ended (waited $waited s for it)"
