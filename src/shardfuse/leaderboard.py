"""Print the MLflow UI URL of an experiment's leaderboard (``make ui`` runs it before the UI starts).

The library: :mod:`shardfuse.track.leaderboard` (what the URL opens, and the shared view it writes)::

    python -m shardfuse.leaderboard --tracking-uri sqlite:///mlflow.db --experiment shardfuse \\
        --ui http://127.0.0.1:5000
"""

from __future__ import annotations

from shardfuse.console.errors import run_cli
from shardfuse.io import StageParser
from shardfuse.track.leaderboard import experiment_leaderboard


def main(argv: list[str] | None = None) -> None:
    parser = StageParser(prog="python -m shardfuse.leaderboard", description=__doc__.splitlines()[0])
    parser.add_argument("--tracking-uri", default="sqlite:///mlflow.db", help="the store (%(default)s)")
    parser.add_argument("--experiment", default="shardfuse", help="mlflow.experiment (%(default)s)")
    parser.add_argument("--ui", default="http://127.0.0.1:5000", help="where the UI is served (%(default)s)")
    args = parser.parse_args(argv)
    print(experiment_leaderboard(args.tracking_uri, args.experiment, args.ui))


if __name__ == "__main__":
    run_cli(main)
