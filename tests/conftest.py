"""Shared fixtures: small real datasets, shard sets and trainings made with the project's own stages.

Each is built once per test run and shared by every pytest-xdist worker (``built_once``), and the tests
only read it; a test that writes copies what it needs into its own tmp_path first.
Helpers and constants live in tests/support/ (never in a test module).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from xdist.scheduler import LoadFileScheduling

from shardfuse.metrics.system import INTERVAL_ENV
from tests.support import schedule
from tests.support.data import prepare_and_partition
from tests.support.helpers import MEASUREMENTS, built_once, call_stage

DIGITS_SPEC = '{"source": "digits", "test_fraction": 0.2, "seed": 0}'


# The test modules that read a training built once per run (built_once): pytest-xdist runs the modules
# of one training on one worker, which builds it, so the other worker never sits waiting on its lock.
SHARED_TRAINING_MODULES = {
    "tests/stages/test_train.py": "small_trainings",
    "tests/stages/test_trust.py": "small_trainings",
    "tests/stages/test_stage_records.py": "small_trainings",
    "tests/stages/test_align.py": "small_trainings",
    "tests/stages/test_ensemble.py": "small_trainings",
    "tests/slow/test_resume_killed_rank.py": "ddp_resume_reference",
    "tests/slow/test_rank_start.py": "ddp_resume_reference",
    "tests/slow/test_resume_snakemake.py": "ddp_resume_reference",
    "tests/slow/test_resume_fallback.py": "ddp_resume_reference",
    "tests/slow/test_stop_with_a_checkpoint.py": "ddp_resume_reference",
    "tests/slow/test_ownership.py": "ddp_resume_reference",
}


class SharedTrainingScheduling(LoadFileScheduling):
    """`--dist loadfile` (a module and its fixtures on one worker), with the modules of one shared
    training as one unit. (pytest-xdist's own loadgroup renames node ids, which pytest 9.2 ignores.)"""

    def __init__(self, config, log=None) -> None:
        super().__init__(config, log)
        config.option.loadscopereorder = False  # the workers' collection is in order (schedule.py)

    def _split_scope(self, nodeid: str) -> str:
        return scope_of(nodeid)


def scope_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return SHARED_TRAINING_MODULES.get(path, path)


def pytest_xdist_make_scheduler(config, log):
    return SharedTrainingScheduling(config, log) if config.getvalue("dist") == "loadfile" else None


def pytest_collection_modifyitems(config, items) -> None:
    """The modules that train first (tests/support/schedule.py)."""
    schedule.order_items(items, scope_of, set(SHARED_TRAINING_MODULES.values()))


def pytest_itemcollected(item) -> None:
    """A test module that reads a shared training must be in SHARED_TRAINING_MODULES."""
    path = item.nodeid.split("::", 1)[0]
    for name in set(SHARED_TRAINING_MODULES.values()) & set(item.fixturenames):
        if SHARED_TRAINING_MODULES.get(path) != name:
            raise pytest.UsageError(f"{path} uses the fixture {name}: add it to SHARED_TRAINING_MODULES")


def pytest_sessionfinish(session) -> None:
    """A pytest-xdist worker hands its measurements to the controller through a file in the run's
    directory (the controller prints them; its own MEASUREMENTS stay empty)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker and MEASUREMENTS:
        run_dir = session.config._tmp_path_factory.getbasetemp().parent
        (run_dir / f"measurements-{worker}.txt").write_text("\n".join(MEASUREMENTS) + "\n")


def pytest_terminal_summary(terminalreporter) -> None:
    lines = list(MEASUREMENTS)
    if not os.environ.get("PYTEST_XDIST_WORKER"):
        run_dir = terminalreporter.config._tmp_path_factory.getbasetemp()
        for path in sorted(run_dir.glob("measurements-*.txt")):
            lines += path.read_text().splitlines()
    if lines:
        terminalreporter.section("measurements")
        for line in lines:
            terminalreporter.write_line(line)


def prepared(tmp_path_factory, name: str, spec: str) -> tuple[Path, Path]:
    """(dataset dir, 2-shard dir) of ``spec`` made by the prepare and partition stages, once per run."""
    root = built_once(tmp_path_factory, name, lambda out: prepare_and_partition(out, name, spec))
    return root / name, root / f"{name}-shards" / "w2-seed0"


@pytest.fixture(scope="session")
def digits_data(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's digits (64 features, 10 classes), prepared and partitioned into 2 shards."""
    return prepared(tmp_path_factory, "digits", DIGITS_SPEC)


@pytest.fixture(scope="session")
def digits_dataset(digits_data) -> Path:
    return digits_data[0]


@pytest.fixture(scope="session")
def digits_shards(digits_data) -> Path:
    return digits_data[1]


@pytest.fixture(scope="session")
def small_trainings(tmp_path_factory, digits_dataset, digits_shards) -> Path:
    """A working directory holding results/trainings/{ddp,independent,localsgd}/ranks: real 2-rank
    trainings of SMALL_TRAIN_CFG on digits, system metrics off; the independent one also has its
    gather.json with relative paths, as the workflow writes it (a copy of results/ is a working training)."""

    from tests.support.training import SMALL_TRAIN_CFG, SMALL_TRAININGS, launch_training

    def build(root: Path) -> None:
        with pytest.MonkeyPatch.context() as env:
            env.setenv(INTERVAL_ENV, "0")
            for name, keys in SMALL_TRAININGS.items():
                out = root / "results" / "trainings" / name / "ranks"
                launch_training(out, digits_dataset, digits_shards, name, {**SMALL_TRAIN_CFG, **keys})
        gather = call_stage(
            "gather", "--train-dir", "results/trainings/independent/ranks", "--world-size", 2,
            "--out", "results/trainings/independent/gather.json", cwd=root,
        )  # fmt: skip
        assert gather.returncode == 0, gather.stderr

    return built_once(tmp_path_factory, "small-trainings", build)


@pytest.fixture(scope="session")
def ddp_resume_reference(tmp_path_factory, digits_dataset, digits_shards) -> Path:
    """The uninterrupted ddp training (tests/support/training.py DDP_RESUME_CFG) that the kill tests of
    the fast tier must end bitwise identical to."""
    from tests.support.training import DDP_RESUME_CFG, train_reference

    return (
        built_once(
            tmp_path_factory,
            "ddp-resume-reference",
            lambda out: train_reference(out / "ranks", digits_dataset, digits_shards, DDP_RESUME_CFG),
        )
        / "ranks"
    )


@pytest.fixture(scope="session")
def diabetes_data(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's diabetes data (regression, 10 features, one float target), prepared and in 2 shards."""
    return prepared(tmp_path_factory, "diabetes", '{"source": "diabetes"}')


@pytest.fixture(scope="session")
def digits_images_data(tmp_path_factory) -> tuple[Path, Path]:
    """scikit-learn's digits as 1x8x8 images (a tensor column), prepared and in 2 shards."""
    return prepared(tmp_path_factory, "digits_images", '{"source": "digits_images"}')


@pytest.fixture(scope="session")
def stdlib_tokens_data(tmp_path_factory) -> tuple[Path, Path]:
    """The Python standard library's json package as byte tokens in blocks of 33, in 2 shards."""
    spec = '{"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 32, "max_tokens": 40000}'
    return prepared(tmp_path_factory, "stdlib", spec)


@pytest.fixture(scope="module")
def track_store(tmp_path_factory) -> dict:
    """A migrated SQLite MLflow store and its experiment, one per test module (a fresh one costs seconds);
    the tests of a module use distinct run names."""
    from mlflow.tracking import MlflowClient  # here: the pytest-xdist controller never imports MLflow

    from tests.support.tracking import TRACK_EXPERIMENT

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root}/mlflow.db"
    client = MlflowClient(tracking_uri=uri)
    experiment_id = client.create_experiment(TRACK_EXPERIMENT, artifact_location=str(root / "artifacts"))
    return {"uri": uri, "client": client, "experiment_id": experiment_id}
