"""What users see: the MLflow UI of pushed runs, in a real headless Chromium (Debian's) via Playwright.

A real ``mlflow server`` (SQLite backend, scripts/mlflow-server-up.sh) on a free loopback port holds three
parent runs pushed by the track stage (each rank with real system-metric samples) and the comparison
stage's plots and table. The tests open what a researcher opens: the runs table (its Dataset column),
the chart view (a bar per parent for the merged score), Compare of the three parents (the plots at the
artifact root side by side), a logged model's page (its metrics) and a rank's System metrics tab; each
saves a screenshot under the test's tmp dir (and $SHARDFUSE_SCREENSHOT_DIR if set).
In CI a missing chromium or playwright fails; elsewhere the test is skipped.
"""

from __future__ import annotations

import json
import os
import shutil
import urllib.parse
from pathlib import Path

import pytest

from shardfuse import comparison
from shardfuse.report import figures
from shardfuse.track import sync as track_sync
from tests.support.tracking import make_run_dir, mlflow_service, run_config, service_unavailable

pytestmark = pytest.mark.browser
CHROMIUM = os.environ.get("SHARDFUSE_CHROMIUM", "/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
    "--disable-component-update", "--disable-sync", "--no-first-run",
]  # fmt: skip
EXPERIMENT = "shardfuse-ui"
RUNS = {"ui_uniform": 0.8125, "ui_weighted": 0.8675, "ui_ties": 0.7950}  # run name -> merged accuracy
ML_VIEW = "workflowType=machine_learning"  # the model-training view (MLflow 3.17 ignores the kind tag)


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


def _png(path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(4, 3))
    ax.plot([0, 1, 2], [0.3, 0.7, 0.8])
    ax.set_title(title)
    return figures.save_figure(fig, path)


@pytest.fixture(scope="module")
def populated(tmp_path_factory):
    root = tmp_path_factory.mktemp("ui-runs")
    with mlflow_service(postgres=False) as service:
        results, records = {}, []
        for run_name, accuracy in RUNS.items():
            run_dir, manifest = make_run_dir(root, run_name, num_steps=60, system_metrics=True)
            evaluation = json.loads((run_dir / "eval.json").read_text())
            evaluation["merged"]["accuracy"] = accuracy
            (run_dir / "eval.json").write_text(json.dumps(evaluation))
            plots = run_dir / "plots"
            plots.mkdir()
            for name in ("fusion", "loss"):
                _png(plots / f"{name}.png", f"{run_name}: {name}")
            results[run_name] = track_sync.track_run(
                run_name, run_dir, manifest, run_config(run_name), service["uri"], EXPERIMENT, plots_dir=plots
            )
            records.append(run_dir / "mlflow.json")
            records[-1].write_text(json.dumps(results[run_name]))
        summary = root / "summary.csv"
        summary.write_text(
            "run,merge_method,test_accuracy_merged\n"
            + "".join(f"{run},{run.removeprefix('ui_')},{acc}\n" for run, acc in RUNS.items())
        )
        comparison.attach([_png(root / "merge_methods.png", "merge methods")], records, summary)
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


@pytest.fixture
def page(browser):
    page = browser.new_page(viewport={"width": 1600, "height": 1400})
    yield page
    page.close()


def _experiment_id(populated) -> str:
    return populated["results"]["ui_uniform"]["experiment_id"]


def test_runs_table_shows_each_parent_with_its_dataset(page, populated, tmp_path):
    # The runs table of the experiment ("Model training" view): the parents by name, their Dataset.
    page.goto(
        f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/runs?{ML_VIEW}",
        wait_until="domcontentloaded",
    )
    for run_name in RUNS:
        page.get_by_role("link", name=run_name, exact=True).first.wait_for(timeout=60_000)
    page.get_by_text("synthetic", exact=False).first.wait_for(timeout=30_000)
    text = page.inner_text("body")
    _screenshot(page, tmp_path, "experiment.png")
    assert "Dataset" in text
    # The Dataset column names the prepared dataset (name and digest) on every parent row.
    assert text.count("synthetic") >= len(RUNS)


def test_chart_view_draws_one_bar_per_parent_for_the_merged_score(page, populated, tmp_path):
    page.goto(
        f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/runs?{ML_VIEW}&compareRunsMode=CHART",
        wait_until="domcontentloaded",
    )
    # The chart area lazily renders the cards in view: search for the metric as a user would.
    search = page.get_by_placeholder("Search metric charts")
    search.wait_for(timeout=60_000)
    search.fill("test_accuracy_merged")
    card = page.locator("[data-testid='experiment-view-compare-runs-card']").filter(
        has_text="test_accuracy_merged"
    )
    card.first.wait_for(timeout=60_000)
    bars = card.first.locator("g.trace.bars path")
    bars.first.wait_for(timeout=30_000)
    text = card.first.inner_text()
    _screenshot(page, tmp_path, "chart.png")
    # Summary metrics at step 0: one labelled bar per parent (not dots on a Step axis).
    assert bars.count() == len(RUNS)
    for run_name, accuracy in RUNS.items():
        assert run_name in text and f"{accuracy:.2f}" in text


def test_compare_of_three_parents_lists_the_plots_at_the_artifact_root(page, populated, tmp_path):
    results = populated["results"]
    parent_ids = [results[name]["parent_run_id"] for name in RUNS]
    query = urllib.parse.urlencode(
        {"runs": json.dumps(parent_ids), "experiments": json.dumps([_experiment_id(populated)])}
    )
    page.goto(f"{populated['uri']}/#/compare-runs?{query}", wait_until="domcontentloaded")
    page.get_by_text("Comparing 3 Runs", exact=False).wait_for(timeout=60_000)
    for run_name in RUNS:  # the table of the compare view renders after its header
        page.get_by_text(run_name, exact=True).first.wait_for(timeout=30_000)
    page.get_by_text("merge_methods.png", exact=True).first.wait_for(timeout=30_000)
    page.get_by_text("fusion_gain", exact=True).first.wait_for(timeout=30_000)
    text = page.inner_text("body")
    # Pick the comparison plot: each parent's copy loads side by side (an image per run).
    page.get_by_text("merge_methods.png", exact=True).first.dispatch_event("click")
    images = "document.querySelectorAll('img[src^=\"blob:\"]')"
    distinct = f"new Set(Array.from({images}).map(i => i.src)).size"
    page.wait_for_function(f"{distinct} >= {len(RUNS)}", timeout=30_000)
    page.locator("img[src^='blob:'] >> visible=true").first.scroll_into_view_if_needed()
    _screenshot(page, tmp_path, "compare.png")
    assert "No common artifacts" not in text
    # The metrics table lists the summary metrics of the three side by side (the chart view test
    # checks each parent's merged score).
    assert "fusion_gain" in text.split("\nMetrics\n")[-1]
    for png in ("fusion.png", "loss.png", "merge_methods.png"):
        assert png in text
    assert "fusion_gain" in text and "merge.method" in text  # metrics and config params side by side


def test_logged_model_page_shows_the_merged_models_metrics(page, populated, tmp_path):
    result = populated["results"]["ui_weighted"]
    model_id = result["model_uri"].removeprefix("models:/")
    page.goto(
        f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/models/{model_id}?{ML_VIEW}",
        wait_until="domcontentloaded",
    )
    page.get_by_text("ui_weighted", exact=False).first.wait_for(timeout=60_000)
    page.get_by_text("test_accuracy_merged", exact=True).first.wait_for(timeout=30_000)
    text = page.inner_text("body")
    _screenshot(page, tmp_path, "model.png")
    assert "0.8675" in text  # the value, linked to the model
    assert "synthetic-test" in text  # the dataset the metric was measured on


def test_a_ranks_system_metrics_tab_charts_cpu_and_memory(page, populated, tmp_path):
    result = populated["results"]["ui_uniform"]
    child_id = result["child_run_ids"]["1"]
    page.goto(
        f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/runs/{child_id}/system-metrics",
        wait_until="domcontentloaded",
    )
    page.get_by_text("cpu_utilization_percentage", exact=False).first.wait_for(timeout=60_000)
    page.get_by_text("system_memory_usage_megabytes", exact=False).first.wait_for(timeout=30_000)
    page.get_by_text("process_rss_megabytes", exact=False).first.wait_for(timeout=30_000)
    text = page.inner_text("body")
    _screenshot(page, tmp_path, "system_metrics.png")
    assert "No system metrics" not in text


def test_the_leaderboard_url_lands_on_the_parents_sorted_by_the_merged_score(browser, populated, tmp_path):
    """`make ui` prints this URL (python -m shardfuse.leaderboard): the model-training view, parents
    only, best merged score first, the fusion's score columns in view (a shared view: an experiment tag
    the URL names, as MLflow's Share button writes one)."""
    from mlflow.tracking import MlflowClient

    from shardfuse.track.leaderboard import SHARED_VIEW_TAG, experiment_leaderboard

    url = experiment_leaderboard(populated["uri"], EXPERIMENT, populated["uri"])
    assert url == (
        f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/runs?workflowType=machine_learning"
        "&viewStateShareKey=shardfuse-leaderboard"
    )
    tag = MlflowClient(populated["uri"]).get_experiment(_experiment_id(populated)).tags[SHARED_VIEW_TAG]
    assert experiment_leaderboard(populated["uri"], EXPERIMENT, populated["uri"]) == url  # tag unchanged
    page = browser.new_page(viewport={"width": 2600, "height": 1000})  # every column, beside the assistant
    try:
        page.goto(url, wait_until="domcontentloaded")
        for run_name in RUNS:
            page.get_by_role("link", name=run_name, exact=True).first.wait_for(timeout=60_000)
        page.get_by_text("test_accuracy_best_rank", exact=True).first.wait_for(timeout=30_000)
        text = page.inner_text("body")
        _screenshot(page, tmp_path, "leaderboard.png")
    finally:
        page.close()
    assert "You're viewing a shared view" in text and "Sort: test_accuracy_merged" in text
    order = sorted(RUNS, key=lambda run: text.index(run))
    assert order == sorted(RUNS, key=RUNS.get, reverse=True), order  # 0.8675, 0.8125, 0.7950
    for column in ("test_accuracy_merged", "test_accuracy_best_rank", "fusion_gain"):
        assert column in text and column in tag, column
    assert "0.8675" in text  # the merged score in its column
    assert "Comparison" not in text and "/live" not in text  # parents only


def test_the_comparison_figures_are_one_click_from_the_experiment_page(browser, populated, tmp_path):
    """The comparison stage writes the experiment's description: on its first line (shown folded), a
    link to each figure across runs; one click opens it (in a new tab, as MLflow opens description links)."""
    page = browser.new_page(viewport={"width": 2000, "height": 1200})
    try:
        page.goto(
            f"{populated['uri']}/#/experiments/{_experiment_id(populated)}/runs?{ML_VIEW}",
            wait_until="domcontentloaded",
        )
        link = page.get_by_role("link", name="merge_methods.png").first
        link.wait_for(timeout=60_000)
        assert "Across runs:" in page.inner_text("body")
        _screenshot(page, tmp_path, "experiment-note.png")
        with page.context.expect_page() as opened:
            link.click()
        figure = opened.value
        figure.get_by_text("merge_methods.png", exact=True).first.wait_for(timeout=60_000)
        figure.locator("img[src^='blob:']").first.wait_for(timeout=60_000)  # the PNG, fetched and shown
        _screenshot(figure, tmp_path, "experiment-note-figure.png")
        assert figure.url.endswith("/artifacts/comparison/merge_methods.png")
        figure.close()
    finally:
        page.close()
