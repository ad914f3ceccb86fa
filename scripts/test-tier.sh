#!/usr/bin/env bash
# Run one test tier and print its wall time against its budget (seconds, measured on a 2-core machine):
#   bash scripts/test-tier.sh NAME BUDGET COMMAND...
# The line goes to the console and to $SHARDFUSE_TEST_REPORTS/tiers.tsv (default .test-reports/), where
# scripts/test-report.py finds it with each tier's JUnit XML. Over budget is reported, not failed: a
# slower machine must not turn a green suite red, but every run shows the regression.
set -u
name=$1 budget=$2
shift 2
reports=${SHARDFUSE_TEST_REPORTS:-.test-reports}
mkdir -p "$reports"
start=$(date +%s)
"$@"
status=$?
elapsed=$(($(date +%s) - start))
verdict="within budget"
((elapsed <= budget)) || verdict="OVER BUDGET"
result="passed"
((status == 0)) || result="FAILED (exit status $status)"
printf 'tier %s: %s; %d s wall, budget %d s: %s\n' "$name" "$result" "$elapsed" "$budget" "$verdict"
printf '%s\t%d\t%d\t%d\t%d\t%d\n' "$name" "$elapsed" "$budget" "$status" "$start" "$((start + elapsed))" \
    >>"$reports/tiers.tsv"
exit "$status"
