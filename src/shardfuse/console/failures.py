"""What a failed workflow tells the user last (the Snakefile's onerror handler): each failed job's
own one-line error (:data:`shardfuse.console.errors.ERROR_LINE`), read back from its log and printed
after Snakemake's messages, and a warning per failed ddp baseline naming the runs it served.

Imported by the Snakefile at every DAG build: torch-free, like the config layer.
"""

from __future__ import annotations

import re
from pathlib import Path

from shardfuse.console.errors import ERROR_LINE

RULE_LINE = re.compile(r"^Error in rule ([A-Za-z0-9_]+):")
LOG_LINE = re.compile(r"^\s+log: (.+?)(?: \(check log file\(s\) for error details\))?$")


def stage_errors(log: Path) -> list[str]:
    """The distinct one-line errors in a job's log, in order (a rank's and the launcher's)."""
    try:
        lines = log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    found = []
    for line in lines:
        match = ERROR_LINE.match(line.strip())
        if match and match.group(1) not in found:
            found.append(match.group(1))
    return found


def failed_jobs(snakemake_log: Path) -> list[tuple[str, list[Path]]]:
    """(rule, log files) of every failed job in a Snakemake log."""
    try:
        lines = snakemake_log.read_text(errors="replace").splitlines()
    except OSError:
        return []
    jobs: list[tuple[str, list[Path]]] = []
    for index, line in enumerate(lines):
        rule = RULE_LINE.match(line)
        if not rule:
            continue
        logs: list[Path] = []
        for following in lines[index + 1 : index + 12]:
            match = LOG_LINE.match(following)
            if match:
                logs = [Path(part.strip()) for part in match.group(1).split(",") if part.strip()]
                break
        if (rule.group(1), logs) not in jobs:
            jobs.append((rule.group(1), logs))
    return jobs


def baseline_warnings(failed_logs: list[Path], baselines: dict[str, tuple[str, str]]) -> list[str]:
    """One warning per failed ddp baseline: the runs it serves (``baselines``: run -> (its ddp
    baseline run, that run's training)) whose evaluation did not wait for it. A job is the baseline's
    when its log is named after the baseline run or its training (logs/<stage>/<name>.log)."""
    failed = {log.stem for log in failed_logs}
    served: dict[str, list[str]] = {}
    for run, (baseline, training) in baselines.items():
        if run != baseline and (baseline in failed or training in failed):
            served.setdefault(baseline, []).append(run)
    return [
        f"shardfuse: warning: ddp run {baseline} failed, so {', '.join(runs)} "
        f"{'is' if len(runs) == 1 else 'are'} evaluated without a ddp baseline (empty baseline metrics); "
        f"their plots wait for {baseline}"
        for baseline, runs in served.items()
    ]


def failed_job_errors(snakemake_log: Path, workdir: Path = Path(".")) -> list[str]:
    """Lines to print after a failed workflow: per failed job, its log and its one-line errors."""
    out = []
    for rule, logs in failed_jobs(snakemake_log):
        errors = [error for log in logs for error in stage_errors(workdir / log)]
        where = ", ".join(str(log) for log in logs) or "no log"
        if errors:
            out.append(f"shardfuse: {rule} failed ({where}):")
            out.extend(f"  {error}" for error in errors)
        else:
            out.append(f"shardfuse: {rule} failed; no one-line error in {where}: read it for the cause")
    return out
