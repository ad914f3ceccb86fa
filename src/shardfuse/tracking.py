"""Push finished runs (config, per-rank step metrics, results, plots, merged model) to MLflow.

Run by hand (from the workflow's working directory)::

    python -m shardfuse.tracking --run NAME --run-dir results/runs/NAME \\
        [--train-dir results/trainings/T/ranks --gather results/trainings/T/gather.json] \\
        --manifest results/shards/D/w2-seed0/manifest.json --config-json '{"model": {...}, ...}' \\
        --tracking-uri sqlite:///mlflow.db --experiment shardfuse [--registered-model NAME] \\
        [--plots-dir results/runs/NAME/plots] --out results/runs/NAME/mlflow.json

The workflow's one ``track`` job pushes every run in one process (one import of MLflow, one store
connection; unchanged runs cost a search each): ``--runs-json '[{"run": NAME, "run_dir": ...,
"manifest": ..., "config": {...}, "out": ...}, ...]'`` instead of the single-run flags.

A run named in ``--failed-runs FILE`` (or the file ``SHARDFUSE_FAILED_RUNS`` names: {run: its one-line
error}, written by the workflow when runs failed; :mod:`shardfuse.experiment.outcome`) is not pushed: its
parent run is marked FAILED with the error (:mod:`shardfuse.track.failed`) and no ``--out`` is written.

Each run is one :func:`shardfuse.track.sync.track_run`: what a run looks like in MLflow (a parent run
and a child per rank) is described there, and how a push of a run MLflow already holds is a sync
(unchanged, updated or replaced) in :mod:`shardfuse.track.plan`. The stage imports no torch: the model
spec comes from the merged weights' JSON header, and the model is logged without loading it.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from shardfuse.console.errors import error_line, exit_now, run_cli, user_error_message, write_line
from shardfuse.experiment.outcome import failed_runs
from shardfuse.io import StageParser, UserError, check_content_name, parse_json_arg, read_json, write_json
from shardfuse.track.failed import record_failed_run
from shardfuse.track.sync import track_run
from shardfuse.track.ui import source_tags

# The per-run options of --runs-json (each entry): the single-run flags without their dashes.
RUN_FIELDS = (
    "run", "run_dir", "manifest", "config", "out", "train_dir", "gather", "plots_dir", "ddp_baseline",
    "hf_dir", "adapter_dir",
)  # fmt: skip
REQUIRED_RUN_FIELDS = ("run", "run_dir", "manifest", "config", "out")


def runs_from_json(text: str) -> list[dict[str, Any]]:
    """The runs of ``--runs-json``: a JSON list of objects with RUN_FIELDS (paths as text), inline or, as
    ``@PATH``, in a file (the workflow's: a command line holds at most 128 KiB, a sweep's configs more)."""
    if text.startswith("@"):
        entries = read_json(text[1:], "--runs-json file")
        check_content_name(text[1:], entries, "--runs-json file")
    else:
        entries = parse_json_arg(text, "--runs-json")
    if not isinstance(entries, list) or not entries:
        raise UserError('--runs-json must be a non-empty JSON list of runs, e.g. \'[{"run": "ddp", ...}]\'')
    names = []
    for index, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise UserError(f"--runs-json entry {index} is not a JSON object; give one object per run")
        missing = [key for key in REQUIRED_RUN_FIELDS if not entry.get(key)]
        unknown = sorted(set(entry) - set(RUN_FIELDS))
        if missing or unknown:
            problem = f"lacks {', '.join(missing)}" if missing else f"has unknown keys {', '.join(unknown)}"
            raise UserError(
                f"--runs-json entry {index} {problem}; each run needs {', '.join(REQUIRED_RUN_FIELDS)} "
                f"and may have {', '.join(RUN_FIELDS[len(REQUIRED_RUN_FIELDS) :])}"
            )
        names.append(entry["run"])
    if len(set(names)) != len(names):
        raise UserError(f"--runs-json names a run twice ({', '.join(names)}); give each run once")
    return entries


def track_and_record(entry: dict[str, Any], args) -> None:
    """Sync one run (an entry of RUN_FIELDS) and write its ``--out`` record; one line on stderr."""
    started = time.perf_counter()
    result = track_run(
        entry["run"], entry["run_dir"], entry["manifest"], entry["config"], args.tracking_uri,
        args.experiment, registered_model=args.registered_model, plots_dir=entry.get("plots_dir"),
        train_dir=entry.get("train_dir"), gather_path=entry.get("gather"), snakefile=args.snakefile,
        hf_dir=entry.get("hf_dir"), ddp_baseline=entry.get("ddp_baseline") or None,
        adapter_dir=entry.get("adapter_dir"),
    )  # fmt: skip
    write_json(entry["out"], result)
    print(
        f"shardfuse.tracking: {result['action']} parent run {result['parent_run_id']} of {entry['run']} "
        f"with {len(result['child_run_ids'])} rank runs in experiment '{args.experiment}' "
        f"({result['num_points_pushed']} metric points in {time.perf_counter() - started:.1f} s)",
        file=sys.stderr,
    )


def mark_failed(entry: dict[str, Any], error: str, args) -> None:
    """A run that failed in the workflow: its FAILED parent run, and one line on stderr."""
    source = source_tags(args.snakefile)
    marked = record_failed_run(
        args.tracking_uri, args.experiment, entry["run"], entry["config"], error, source
    )
    print(
        f"shardfuse.tracking: {marked.action} FAILED parent run {marked.parent_run_id} of {entry['run']} "
        f"in experiment '{args.experiment}' ({error})",
        file=sys.stderr,
    )


def track_all(entries: list[dict[str, Any]], args, failed_in_workflow: dict[str, str] | None = None) -> None:
    """Sync every run in one process (one import of MLflow, one store connection): a run that fails
    is one error line naming it, and the others are still pushed; then one error if any failed. A run
    that failed in the workflow (``failed_in_workflow``: {run: error}) gets its FAILED parent instead."""
    failed_in_workflow = failed_in_workflow or {}
    failed = []
    for entry in entries:
        try:
            baseline = entry.get("ddp_baseline")
            if entry["run"] in failed_in_workflow:
                mark_failed(entry, failed_in_workflow[entry["run"]], args)
            elif baseline and Path(baseline).parent.name in failed_in_workflow:  # <run>/eval.json
                track_and_record({**entry, "ddp_baseline": None}, args)  # evaluated without it
            else:
                track_and_record(entry, args)
        except Exception as exc:
            # a UserError, or a broken file or store (shardfuse.console.errors.foreign_error)
            message = user_error_message(exc)
            if message is None:
                raise  # a bug: its traceback
            failed.append(entry["run"])
            write_line(error_line("shardfuse.tracking", f"run {entry['run']}: {message}"))
    if failed:
        raise UserError(
            f"{len(failed)} of {len(entries)} runs were not tracked ({', '.join(failed)}; their errors are "
            "above); the others are in MLflow, and re-running pushes only what is missing"
        )


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="shardfuse.tracking", description=__doc__.splitlines()[0])
    parser.add_argument("--run", help="run name (the {run} wildcard)")
    parser.add_argument("--run-dir", type=Path, help="results/runs/{run}")
    parser.add_argument("--train-dir", type=Path, help="train.json + metrics/ (default: RUN_DIR/train)")
    parser.add_argument(
        "--gather", type=Path, help="the training's gather.json (default: RUN_DIR/gather.json)"
    )
    parser.add_argument("--manifest", type=Path, help="the shards' manifest.json")
    parser.add_argument("--config-json", help="the run's resolved config as a JSON object")
    parser.add_argument(
        "--runs-json",
        help="several runs in one process instead of --run ... --out: a JSON list of objects with "
        f"the keys {', '.join(RUN_FIELDS)}, or @FILE holding it (the workflow's track job)",
    )
    parser.add_argument("--tracking-uri", required=True, help="e.g. sqlite:///mlflow.db or http://host:5000")
    parser.add_argument("--experiment", default="shardfuse", help="MLflow experiment (created if missing)")
    parser.add_argument("--registered-model", help="also register the merged model under this name")
    parser.add_argument("--plots-dir", type=Path, help="upload its *.png under plots/ (skipped if missing)")
    parser.add_argument(
        "--ddp-baseline", nargs="?", default="", help="eval.json of the ddp run trained alike, if any"
    )
    parser.add_argument(
        "--hf-dir", type=Path, help="model hf: the run's transformers export (shardfuse.export)"
    )
    parser.add_argument(
        "--adapter-dir", type=Path, help="merge_adapter: the run's PEFT adapter (shardfuse.export_adapter)"
    )
    parser.add_argument(
        "--snakefile", type=Path, help="the workflow's Snakefile, the runs' Source (default: ./Snakefile)"
    )
    parser.add_argument("--out", type=Path, help="where to write the run ids (JSON)")
    parser.add_argument(
        "--failed-runs",
        type=Path,
        help="JSON {run: one-line error} of runs that failed in the workflow "
        "(default: the file $SHARDFUSE_FAILED_RUNS names, if set): marked FAILED, not pushed",
    )
    args = parser.parse_args(argv)
    failed_in_workflow = failed_runs(args.failed_runs)
    single = {"--run": args.run, "--run-dir": args.run_dir, "--manifest": args.manifest}
    single |= {"--config-json": args.config_json, "--out": args.out}
    if args.runs_json is not None:
        given = [flag for flag, value in single.items() if value is not None]
        if given:
            raise UserError(
                f"--runs-json replaces {', '.join(given)}; give either --runs-json or one run's flags"
            )
        track_all(runs_from_json(args.runs_json), args, failed_in_workflow)
        return
    missing = [flag for flag, value in single.items() if value is None]
    if missing:
        raise UserError(
            f"the following arguments are required: {', '.join(missing)} (or --runs-json for several "
            "runs); see shardfuse.tracking --help"
        )
    entry = {
        "run": args.run, "run_dir": args.run_dir, "manifest": args.manifest,
        "config": parse_json_arg(args.config_json, "--config-json"), "out": args.out,
        "train_dir": args.train_dir, "gather": args.gather, "plots_dir": args.plots_dir,
        "ddp_baseline": args.ddp_baseline, "hf_dir": args.hf_dir, "adapter_dir": args.adapter_dir,
    }  # fmt: skip
    if args.run in failed_in_workflow:
        mark_failed(entry, failed_in_workflow[args.run], args)
    else:
        track_and_record(entry, args)


if __name__ == "__main__":
    run_cli(main)
    exit_now()
