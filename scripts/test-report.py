"""Print the test tiers' wall times against their budgets and the slowest tests over every tier.

Reads what `make test`, `make test-slow` and `make test-services` leave in .test-reports/ (or
$SHARDFUSE_TEST_REPORTS): tiers.tsv from scripts/test-tier.sh and one JUnit XML per tier; .ci/run adds
its install time ($SHARDFUSE_INSTALL_SECONDS), its start ($SHARDFUSE_CI_START: the whole run is timed
from it) and the whole run's budget (30 min). A test's time is
its setup, call and teardown together, so a fixture shows at the first test that uses it. Standard
library only: .ci/run calls it with any python3, also after a failed tier.

    python3 scripts/test-report.py [--slowest N]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import xml.etree.ElementTree as ET
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slowest", type=int, default=10, help="how many of the slowest tests to list")
    args = parser.parse_args(argv)
    reports = Path(os.environ.get("SHARDFUSE_TEST_REPORTS", ".test-reports"))
    tiers = reports / "tiers.tsv"
    if not tiers.is_file():
        print(f"test-report: no tier has run yet ({tiers} is missing)", file=sys.stderr)
        return 1
    print(f"{'tier':<10} {'wall s':>7} {'budget s':>9}  result")
    total = 0
    installs = os.environ.get("SHARDFUSE_INSTALL_SECONDS")  # set by .ci/run
    if installs:
        total += int(installs)
        print(f"{'installs':<10} {installs:>7} {'':>9}  (packages, the cluster, the mergekit venv)")
    spans = []
    for line in tiers.read_text().splitlines():
        name, elapsed, budget, status, start, end = line.split("\t")
        spans.append((int(start), int(end)))
        verdict = "passed" if status == "0" else f"FAILED (exit status {status})"
        over = "  OVER BUDGET" if int(elapsed) > int(budget) else ""
        print(f"{name:<10} {elapsed:>7} {budget:>9}  {verdict}{over}")
    # Tiers that ran side by side (make test-all: the slow and the service tier) count once: the whole
    # run is the wall time from the first tier's start to the last one's end, not the sum of the tiers;
    # under .ci/run, from its start to now (what it waited for between the tiers included).
    ci_start = os.environ.get("SHARDFUSE_CI_START")
    total = int(time.time()) - int(ci_start) if ci_start else total + wall_seconds(spans)
    ci_budget = " 1800" if installs else ""
    over = "  OVER BUDGET" if installs and total > 1800 else ""
    print(f"{'all':<10} {total:>7} {ci_budget:>9}{over}")
    cases = []
    for xml in sorted(reports.glob("*.xml")):
        for case in ET.parse(xml).getroot().iter("testcase"):
            test = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
            cases.append((float(case.get("time") or 0), xml.stem, test))
    print(f"\nthe {args.slowest} slowest tests (setup + call + teardown):")
    for seconds, tier, test in sorted(cases, reverse=True)[: args.slowest]:
        print(f"{seconds:8.1f} s  {tier:<9} {test}")
    return 0


def wall_seconds(spans: list[tuple[int, int]]) -> int:
    """Seconds covered by the union of [start, end) spans (tiers run one after another or side by side)."""
    covered, reach = 0, None
    for start, end in sorted(spans):
        if reach is None or start >= reach:
            covered += end - start
            reach = end
        elif end > reach:
            covered += end - reach
            reach = end
    return covered


if __name__ == "__main__":
    sys.exit(main())
