"""Attach the comparison plots across runs to every tracked run's MLflow parent.

By hand::

    python -m shardfuse.comparison \\
        --png results/plots/merge_methods.png results/plots/communication.png \\
        --summary results/summary.csv \\
        --records results/runs/*/mlflow.json --out results/plots/comparison.mlflow.json

Each parent gets ``comparison/<name>.png`` for every PNG (``merge_methods.png``: the merge methods side
by side; ``communication.png``: merged score vs bytes all-reduced per rank), the same PNGs at the artifact
root (MLflow's Compare view lists top-level artifacts only, so there they show side by side), and with
``--summary`` the table of all runs as ``comparison_table.json`` (MLflow's table artifact: summary.csv's
columns, one row per run; the artifact view shows it as a table). Re-logging replaces those files, so
re-runs never duplicate them, and the views across runs are one click away from any run. The
experiment's description (shown above its runs table) gets a link to each figure, so they are one click
from the experiment page too; a description the user wrote is never replaced (:func:`describe_experiments`).

The records of runs that failed in the workflow (``--failed-runs FILE``, or the file
``SHARDFUSE_FAILED_RUNS`` names; a record ``<run>/mlflow.json`` is its folder's run) are left out: those
runs were not tracked (:mod:`shardfuse.experiment.outcome`).
"""

from __future__ import annotations

import csv
from pathlib import Path

from shardfuse.console.errors import exit_now, run_cli
from shardfuse.experiment.outcome import failed_runs
from shardfuse.io import StageParser, UserError, read_json, write_json
from shardfuse.track.client import tracking_client, tracking_errors, writer_lock

ARTIFACT_PATH = "comparison"
TABLE_FILE = "comparison_table.json"
LOGGED_ARTIFACTS_TAG = "mlflow.loggedArtifacts"  # how the UI knows a JSON artifact is a table


def read_table(summary: Path) -> dict[str, list]:
    """summary.csv as columns (numbers as floats, empty cells as None) for ``MlflowClient.log_table``."""

    def cell(text: str):
        if text == "":
            return None
        try:
            return float(text)
        except ValueError:
            return text

    try:
        with summary.open(newline="") as handle:
            rows = list(csv.DictReader(handle))
    except OSError as exc:
        raise UserError(f"cannot read {summary} ({exc.strerror}); run `snakemake {summary}` first") from None
    if not rows:
        raise UserError(f"{summary} has no runs; re-run the summary rule (snakemake -R summary)")
    return {name: [cell(row[name] or "") for row in rows] for name in rows[0]}


def _log_table(client, run_id: str, table: dict[str, list]) -> None:
    """Log the table as MLflow's table artifact, replacing the previous one (MlflowClient.log_table
    would append its rows to it): the JSON layout and the run tag that log_table writes."""
    import json
    import tempfile

    columns = list(table)
    rows = [list(row) for row in zip(*(table[c] for c in columns), strict=True)]
    with tempfile.TemporaryDirectory(prefix="shardfuse-table-") as tmp:
        path = Path(tmp) / TABLE_FILE
        path.write_text(json.dumps({"columns": columns, "data": rows}))
        client.log_artifact(run_id, str(path))
    tags = client.get_run(run_id).data.tags
    logged = json.loads(tags.get(LOGGED_ARTIFACTS_TAG, "[]"))
    if {"path": TABLE_FILE, "type": "table"} not in logged:
        logged.append({"path": TABLE_FILE, "type": "table"})
        client.set_tag(run_id, LOGGED_ARTIFACTS_TAG, json.dumps(logged))


NOTE_TAG = "mlflow.note.content"  # an experiment's description, shown at the top of its page
NOTE_MARK = "<!-- shardfuse: the comparison stage writes this description -->"


def experiment_note(experiment_id: str, run_id: str, pngs: list[Path]) -> str:
    """The experiment's description: on its first line (what the page shows folded), a link to each
    comparison figure in the first parent's artifacts, so the figures across runs are one click from
    the experiment page."""
    links = " · ".join(
        f"[{png.name}](#/experiments/{experiment_id}/runs/{run_id}/artifacts/{ARTIFACT_PATH}/{png.name})"
        for png in pngs
    )
    return (
        f"**Across runs:** {links}\n\n{NOTE_MARK}\nWritten by shardfuse's comparison stage; every parent run "
        f"holds these figures under `{ARTIFACT_PATH}/`, and `make ui` prints the leaderboard's URL.\n"
    )


def describe_experiments(client, records: list[dict], pngs: list[Path]) -> None:
    """Write :func:`experiment_note` as each records' experiment's description, unless the experiment
    has a description of its own (one not written here): that one is never replaced."""
    first: dict[str, str] = {}
    for record in records:
        if isinstance(record.get("experiment_id"), str):
            first.setdefault(record["experiment_id"], record["parent_run_id"])
    for experiment_id, run_id in first.items():
        note = experiment_note(experiment_id, run_id, pngs)
        have = client.get_experiment(experiment_id).tags.get(NOTE_TAG)
        if have != note and (have is None or NOTE_MARK in have):
            client.set_experiment_tag(experiment_id, NOTE_TAG, note)


def attach(pngs: list[Path], records: list[Path], summary: Path | None = None) -> dict:
    """Log every PNG (and the summary table) to every record's parent run; return what ``--out`` records."""
    for png in pngs:
        if not png.is_file():
            raise UserError(f"{png} does not exist; run the rule that draws it (snakemake {png}) first")
    table = read_table(summary) if summary is not None else None
    attached: dict[str, str] = {}
    by_uri: dict[str, list[dict]] = {}
    for path in records:
        record = read_json(path, "tracking record")
        if not isinstance(record, dict) or not all(
            isinstance(record.get(key), str) for key in ("tracking_uri", "parent_run_id")
        ):
            raise UserError(
                f"tracking record {path} has no tracking_uri and parent_run_id strings; re-run the track "
                "stage (snakemake -R track)"
            )
        by_uri.setdefault(record["tracking_uri"], []).append(record)
    for uri, entries in by_uri.items():
        with tracking_errors(uri), writer_lock(uri):
            client = tracking_client(uri)
            for record in entries:
                for png in pngs:
                    client.log_artifact(record["parent_run_id"], str(png), artifact_path=ARTIFACT_PATH)
                    client.log_artifact(record["parent_run_id"], str(png))  # the root: Compare shows it
                if table is not None:
                    _log_table(client, record["parent_run_id"], table)
                attached[record["parent_run_id"]] = uri
            describe_experiments(client, entries, pngs)
    artifacts = [f"{ARTIFACT_PATH}/{png.name}" for png in pngs] + [png.name for png in pngs]
    return {
        "pngs": [str(png) for png in pngs],
        "artifacts": artifacts + ([TABLE_FILE] if table is not None else []),
        "parent_run_ids": sorted(attached),
    }


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.comparison", description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, nargs="+", required=True, help="the comparison plots")
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="each run's mlflow.json")
    parser.add_argument("--summary", type=Path, help="summary.csv: logged as the table of all runs")
    parser.add_argument("--out", type=Path, required=True, help="JSON record of what was attached")
    parser.add_argument(
        "--failed-runs",
        type=Path,
        help="JSON {run: one-line error} of runs that failed in the workflow "
        "(default: the file $SHARDFUSE_FAILED_RUNS names, if set): their records are left out",
    )
    args = parser.parse_args(argv)
    failed = failed_runs(args.failed_runs)
    records = [path for path in args.records if path.parent.name not in failed]
    write_json(args.out, attach(args.png, records, args.summary))


if __name__ == "__main__":
    run_cli(main)
    exit_now()
