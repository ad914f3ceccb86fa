"""Load and validate the experiment configuration before any job starts.

The Snakefile calls :func:`load_experiment`; by hand::

    python -m shardfuse.config --configfile config/config.yaml   # every resolved run and its training

A run is ``run_defaults`` overlaid with its row of the runs table, filled with schema defaults and then
validated, so a typo, a wrong type or an impossible value is one error that names the key.
"""

from __future__ import annotations

import json

from shardfuse.console.errors import run_cli
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.schema import read_config_file
from shardfuse.io import StageParser


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.config", description=__doc__.splitlines()[0])
    parser.add_argument(
        "--configfile", default="config/config.yaml", help="YAML config (default: %(default)s)"
    )
    args = parser.parse_args(argv)
    experiment = load_experiment(read_config_file(args.configfile))
    trainings = {run: experiment.training(run) for run in experiment.runs}
    print(
        json.dumps(
            {"tracking_uri": experiment.tracking_uri, "runs": experiment.runs, "trainings": trainings},
            indent=2,
        )
    )


if __name__ == "__main__":
    run_cli(main)
