"""A workflow in which some runs failed still reports the others (README "When a run fails").

Snakemake keeps going past a failed job (profiles/default), but the summary, the comparison figures and
MLflow wait for every run. When the workflow ends with failed jobs, its onerror handler runs those
report jobs itself, with the failed runs named in a file (:data:`FAILED_RUNS_ENV`: {run: the console's
one-line error}): the summary gives each a row with its ``error``, the figures draw the finished runs,
the track stage marks each failed run's MLflow parent FAILED with the line, and the comparison attaches
to the finished runs only. What it writes is dated 1 January 1970, 00:00:01 (:func:`date_partial`),
older than any input, so the next ``snakemake`` writes it again, whatever it changes: a re-run that
fixes the failed runs completes the report, one that drops them from the config reports the rest
without them.

Imported by the Snakefile at every DAG build: torch-free, like the config layer.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from pathlib import Path

from shardfuse.io import UserError, read_json, write_json

# The file of failed runs the report jobs read ({run: one-line error}); stages also take --failed-runs.
FAILED_RUNS_ENV = "SHARDFUSE_FAILED_RUNS"
# The report's jobs, in the order they run (a rule absent from the DAG is skipped).
REPORT_RULES = (
    "summary",
    "compare_merge_methods",
    "compare_communication",
    "compare_heterogeneity",
    "track",
    "track_comparison",
)
# Those that need at least one finished run (a figure or a comparison of nothing is an error).
NEED_FINISHED = (
    "compare_merge_methods",
    "compare_communication",
    "compare_heterogeneity",
    "track_comparison",
)
# A second after the Unix epoch (Snakemake reads an mtime of 0 as none): older than any input.
PARTIAL_MTIME = 1


def failed_runs(path: str | os.PathLike | None = None) -> dict[str, str]:
    """{run: its one-line error} from ``path``, else from the file :data:`FAILED_RUNS_ENV` names; {}
    when neither is given (a complete workflow)."""
    path = path or os.environ.get(FAILED_RUNS_ENV) or None
    if path is None:
        return {}
    failed = read_json(path, "failed runs file")
    if not isinstance(failed, dict) or not all(
        isinstance(run, str) and isinstance(error, str) for run, error in failed.items()
    ):
        raise UserError(
            f"failed runs file {path} must be a JSON object of run names to their one-line errors, "
            'e.g. {"ddp": "shardfuse.launch: error: ..."}; the workflow writes it when a run fails'
        )
    return failed


def write_failed_runs(path: Path, failed: dict[str, str]) -> Path:
    write_json(path, dict(sorted(failed.items())))
    return path


def failure_line(rule: str, logs: Iterable[Path], errors: list[str]) -> str:
    """A failed job's line for its runs: its first one-line error, else where to look."""
    if errors:
        return errors[0]
    where = ", ".join(str(log) for log in logs) or "Snakemake's log"
    return f"{rule} failed without a one-line error; see {where}"


def date_partial(paths: Iterable[str | os.PathLike]) -> list[Path]:
    """Date each existing file :data:`PARTIAL_MTIME` (the next run writes it again); return them."""
    dated = []
    for path in map(Path, paths):
        if path.is_file():
            os.utime(path, (PARTIAL_MTIME, PARTIAL_MTIME))
            dated.append(path)
    return dated


def report_line(finished: list[str], failed: dict[str, str], where: str) -> str:
    """The console's line after the report: what it holds and what to do next."""
    total = len(finished) + len(failed)
    names = ", ".join(sorted(failed))
    return (
        f"shardfuse: reported the {len(finished)} finished run(s) of {total} in {where} and MLflow; "
        f"{names} failed (a row with its error, a FAILED parent run): fix them and run snakemake again "
        "to complete the report"
    )
