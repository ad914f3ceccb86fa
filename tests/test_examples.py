"""The README's example experiments, run exactly as it shows them (one command each, in a copy of the
checkout), then its snippet that loads the user model back from MLflow in a fresh Python process."""

from __future__ import annotations

import csv
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import REPO, run_in, snakemake_failure, subprocess_env
from tests.test_slurm import checkout_copy

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def readme_block(marker: str) -> str:
    text = (REPO / "README.md").read_text()
    match = re.search(rf"<!-- {marker} -->\n```\w*\n(.*?)```", text, flags=re.DOTALL)
    assert match, f"README.md has no block after <!-- {marker} -->"
    return match.group(1)


def summary(checkout: Path) -> dict[str, dict[str, str]]:
    with open(checkout / "results" / "summary.csv", newline="") as fh:
        return {row["run"]: row for row in csv.DictReader(fh)}


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict[str, dict[str, dict[str, str]]]:
    """Each example command of the README, in one checkout copy (as a user runs them one after the
    other): its summary rows by example name."""
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    found = {}
    lines = [*readme_block("examples").splitlines(), *readme_block("examples-kinds").splitlines()]
    for line in lines:
        command = shlex.split(line.split("#")[0])
        if not command:
            continue
        assert command[0] == "snakemake"
        proc = run_in(checkout, command)
        assert proc.returncode == 0, snakemake_failure(checkout, proc)
        found[Path(command[-1]).stem] = summary(checkout)
    found["checkout"] = checkout
    return found


def test_every_example_of_the_readme_runs_and_learns(examples):
    assert {"diabetes", "multi_output", "user_model", "finetune", "digits_cnn", "stdlib_lm"} <= set(examples)
    diabetes = examples["diabetes"]
    assert all(float(row["test_r2_merged"]) > 0.4 for row in diabetes.values())
    assert float(diabetes["diabetes_soup"]["fusion_gain"]) > 0  # the soup beats its best rank's mse
    assert "test_accuracy_merged" not in diabetes["diabetes_soup"]  # a regression-only summary
    assert all(float(row["test_r2_merged"]) > 0.9 for row in examples["multi_output"].values())
    assert all(float(row["test_accuracy_merged"]) > 0.9 for row in examples["user_model"].values())
    finetune = examples["finetune"]
    assert all(float(finetune[run]["test_accuracy_merged"]) > 0.9 for run in ("ft_ddp", "ft_ties"))
    # Fine-tuning starts from the pretrained model, which knows half the classes.
    assert 0.3 < float(finetune["ft_uniform"]["test_accuracy_base"]) < 0.7
    cnn = examples["digits_cnn"]
    assert float(cnn["cnn_ddp"]["test_accuracy_merged"]) > 0.9
    assert float(cnn["cnn_soup"]["test_accuracy_merged"]) > 0.7
    language = examples["stdlib_lm"]
    for run in ("lm_ddp", "lm_localsgd", "lm_soup"):
        # Bytes are 8 bits; an untrained model is near log2(256) = 8 bits, a trained one well below.
        assert float(language[run]["test_bits_per_byte_merged"]) < 4.5
        # Synchronised training halves the initial loss; a soup of independently trained transformers
        # loses part of that (README figures).
        bound = 0.6 if run == "lm_soup" else 0.5
        assert float(language[run]["test_loss_merged"]) < float(language[run]["test_loss_base"]) * bound


def test_the_readme_loads_the_user_model_back_from_mlflow_in_a_fresh_process(examples):
    proc = subprocess.run(
        [sys.executable, "-c", readme_block("load-user-model")],
        cwd=examples["checkout"],
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [line.split() for line in proc.stdout.splitlines()[1:6]]
    assert [row[1] for row in rows] == ["0", "1", "2", "3", "4"]  # the first five digits, recognised
