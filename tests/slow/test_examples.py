"""The README's example experiments, run exactly as it shows them (one command each, in a copy of the
checkout), then its snippet that loads the user model back from MLflow in a fresh Python process."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.support.helpers import checkout_copy, readme_block, run_readme_examples, subprocess_env

# Four whole experiments in one fixture: about 9 min on a 2-core machine shared with the other test
# worker, past the suite's default limit of 900 s (counted with the first test's fixture).
pytestmark = pytest.mark.timeout(1800)


@pytest.fixture(scope="module")
def examples(tmp_path_factory) -> dict:
    """The tabular examples (regression, multi-output, your model, fine-tuning), in one checkout copy."""
    checkout = checkout_copy(tmp_path_factory.mktemp("checkout"))
    return {**run_readme_examples(checkout, "examples"), "checkout": checkout}


def test_every_example_of_the_readme_runs_and_learns(examples):
    assert {"diabetes", "multi_output", "user_model", "finetune"} <= set(examples)
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
