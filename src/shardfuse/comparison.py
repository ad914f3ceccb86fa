"""Attach the comparison plots across runs to every tracked run's MLflow parent.

By hand::

    python -m shardfuse.comparison \\
        --png results/plots/merge_methods.png results/plots/communication.png \\
        --records results/runs/*/mlflow.json --out results/plots/comparison.mlflow.json

Each parent gets ``comparison/<name>.png`` for every PNG (``merge_methods.png``: the merge methods side
by side; ``communication.png``: merged score vs bytes all-reduced per rank). Re-logging overwrites those
files, so re-runs never duplicate them, and the views across runs are one click away from any run.
"""

from __future__ import annotations

from pathlib import Path

from shardfuse.io import StageParser, UserError, read_json, run_cli, write_json
from shardfuse.mlflow_common import exit_now, tracking_client, tracking_errors, writer_lock

ARTIFACT_PATH = "comparison"


def attach(pngs: list[Path], records: list[Path]) -> dict:
    """Log every PNG to every record's parent run; return what ``--out`` records (JSON)."""
    for png in pngs:
        if not png.is_file():
            raise UserError(f"{png} does not exist; run the rule that draws it (snakemake {png}) first")
    attached: dict[str, str] = {}
    by_uri: dict[str, list[dict]] = {}
    for path in records:
        record = read_json(path, "tracking record")
        by_uri.setdefault(record["tracking_uri"], []).append(record)
    for uri, entries in by_uri.items():
        with writer_lock(uri), tracking_errors(uri):
            client = tracking_client(uri)
            for record in entries:
                for png in pngs:
                    client.log_artifact(record["parent_run_id"], str(png), artifact_path=ARTIFACT_PATH)
                attached[record["parent_run_id"]] = uri
    return {
        "pngs": [str(png) for png in pngs],
        "artifacts": [f"{ARTIFACT_PATH}/{png.name}" for png in pngs],
        "parent_run_ids": sorted(attached),
    }


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.comparison", description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, nargs="+", required=True, help="the comparison plots")
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="each run's mlflow.json")
    parser.add_argument("--out", type=Path, required=True, help="JSON record of what was attached")
    args = parser.parse_args(argv)
    write_json(args.out, attach(args.png, args.records))


if __name__ == "__main__":
    run_cli(main)
    exit_now()
