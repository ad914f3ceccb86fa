"""What a failed workflow tells the user last: each failed job's own one-line error.

A failing stage writes ``shardfuse.<stage>: error: <what is wrong and the fix>`` into its log; Snakemake
prints only its CalledProcessError block and "check log file(s)". The Snakefile's ``onerror`` handler
calls :func:`failed_job_errors` with Snakemake's own log, which names every failed rule and its log
files, and prints the stages' lines after Snakemake's, so they are the last thing on the console::

    shardfuse: train failed (logs/train/digits-w2-ddp-65747e84e4.log):
      shardfuse.train: error: warmup_steps 100000 is longer than the run's 20 optimiser steps ...

Snakemake's exit status is unchanged (1 for a failed job).
"""

from __future__ import annotations

import re
from pathlib import Path

ERROR_LINE = re.compile(r"^(?:\[rank\d+\]: )?(shardfuse\.[a-z_]+: error: .*)$")
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
