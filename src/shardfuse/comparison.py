"""Attach the merge-methods comparison plot to every tracked run's MLflow parent.

By hand::

    python -m shardfuse.comparison --png results/plots/merge_methods.png \\
        --records results/runs/*/mlflow.json --out results/plots/merge_methods.mlflow.json

Each parent gets ``comparison/merge_methods.png`` (re-logging overwrites that one file, so re-runs
never duplicate it), so the side-by-side view of merge methods is one click away from any run.
"""

from __future__ import annotations

from pathlib import Path

from shardfuse.io import StageParser, UserError, read_json, run_cli, write_json
from shardfuse.mlflow_common import exit_now, tracking_client, tracking_errors, writer_lock

ARTIFACT_PATH = "comparison"


def attach(png: Path, records: list[Path]) -> dict:
    if not png.is_file():
        raise UserError(f"{png} does not exist; run the compare_merge_methods rule first")
    attached: dict[str, str] = {}
    by_uri: dict[str, list[dict]] = {}
    for path in records:
        record = read_json(path, "tracking record")
        by_uri.setdefault(record["tracking_uri"], []).append(record)
    for uri, entries in by_uri.items():
        with writer_lock(uri), tracking_errors(uri):
            client = tracking_client(uri)
            for record in entries:
                client.log_artifact(record["parent_run_id"], str(png), artifact_path=ARTIFACT_PATH)
                attached[record["parent_run_id"]] = uri
    return {"png": str(png), "artifact": f"{ARTIFACT_PATH}/{png.name}", "parent_run_ids": sorted(attached)}


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.comparison", description=__doc__.splitlines()[0])
    parser.add_argument("--png", type=Path, required=True, help="the comparison plot")
    parser.add_argument("--records", type=Path, nargs="+", required=True, help="each run's mlflow.json")
    parser.add_argument("--out", type=Path, required=True, help="JSON record of what was attached")
    args = parser.parse_args(argv)
    write_json(args.out, attach(args.png, args.records))


if __name__ == "__main__":
    run_cli(main)
    exit_now()
