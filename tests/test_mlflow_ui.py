"""What users see: the MLflow UI of pushed runs, in a real headless Chromium (Debian's) via Playwright.

A real ``mlflow server`` (SQLite backend, scripts/mlflow-server-up.sh) on a free loopback port holds two
parent runs pushed by the track stage; the test opens the experiment page and the compare view of the
two parents and saves screenshots under the test's tmp dir (and $SHARDFUSE_SCREENSHOT_DIR if set).
In CI a missing chromium or playwright fails; elsewhere the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from pathlib import Path

import pytest

from shardfuse import tracking
from tests.tracking_fixtures import make_run_dir, mlflow_service, run_config, service_unavailable

pytestmark = [pytest.mark.integration, pytest.mark.browser]
CHROMIUM = os.environ.get("SHARDFUSE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
EXPERIMENT = "shardfuse-ui"
RUNS = {"ui_uniform": 0.8125, "ui_weighted": 0.8675}  # run name -> merged test accuracy


@pytest.fixture(scope="module")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        service_unavailable("the playwright package is missing: pip install playwright")
    if not os.access(CHROMIUM, os.X_OK):
        service_unavailable(f"no Chromium at {CHROMIUM}: apt-get install -y chromium")
    with sync_playwright() as playwright:
        # Debian's Chromium, never a downloaded one.
        chromium = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-runs")
    with mlflow_service(postgres=False) as service:
        results = {}
        for run_name, accuracy in RUNS.items():
            run_dir, manifest = make_run_dir(root, run_name, num_steps=60)
            evaluation = json.loads((run_dir / "eval.json").read_text())
            evaluation["merged"]["accuracy"] = accuracy
            (run_dir / "eval.json").write_text(json.dumps(evaluation))
            results[run_name] = tracking.track_run(
                run_name, run_dir, manifest, run_config(run_name), service["uri"], EXPERIMENT
            )
        yield {**service, "results": results}


def _screenshot(page, tmp_path: Path, name: str) -> Path:
    path = tmp_path / name
    page.screenshot(path=str(path), full_page=True)
    if os.environ.get("SHARDFUSE_SCREENSHOT_DIR"):
        target = Path(os.environ["SHARDFUSE_SCREENSHOT_DIR"])
        target.mkdir(parents=True, exist_ok=True)
        shutil.copy2(path, target / name)
    assert path.stat().st_size > 10_000
    return path


def test_experiment_page_and_compare_view_show_run_names_and_merged_accuracy(browser, populated, tmp_path):
    results = populated["results"]
    experiment_id = results["ui_uniform"]["experiment_id"]
    page = browser.new_page(viewport={"width": 1600, "height": 1400})
    try:
        # The runs table of the experiment ("Model training" view): both parents by name.
        page.goto(
            f"{populated['uri']}/#/experiments/{experiment_id}/runs?workflowType=machine_learning",
            wait_until="domcontentloaded",
        )
        for run_name in RUNS:
            page.get_by_role("link", name=run_name, exact=True).first.wait_for(timeout=60_000)
        _screenshot(page, tmp_path, "experiment.png")

        parent_ids = [results[name]["parent_run_id"] for name in RUNS]
        query = urllib.parse.urlencode(
            {"runs": json.dumps(parent_ids), "experiments": json.dumps([experiment_id])}
        )
        page.goto(f"{populated['uri']}/#/compare-runs?{query}", wait_until="domcontentloaded")
        page.get_by_text("Comparing 2 Runs", exact=False).wait_for(timeout=60_000)
        for run_name, accuracy in RUNS.items():  # the table of the compare view renders after its header
            page.get_by_text(run_name, exact=True).first.wait_for(timeout=30_000)
            page.get_by_text(f"{accuracy:.5f}", exact=True).first.wait_for(timeout=30_000)
        text = page.inner_text("body")
        _screenshot(page, tmp_path, "compare.png")
    finally:
        page.close()
    for run_name, accuracy in RUNS.items():
        assert run_name in text
        assert f"{accuracy:.5f}" in text  # the compare table's headline metric, e.g. 0.81250
    assert "fusion_gain" in text and "merge.method" in text  # metrics and config params side by side
