"""The whole DAG with real Snakemake, real torchrun processes and a real MLflow store (tiny config)."""

from __future__ import annotations

import csv
import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.support.helpers import (
    REPO,
    console_of,
    mlflow_state,
    ranks_dir,
    snakemake,
    snakemake_command,
    subprocess_env,
    tiny_config,
    tiny_experiment_run,
)


@pytest.fixture(scope="module")
def workdir(tmp_path_factory) -> Path:
    return tiny_experiment_run(tmp_path_factory.mktemp("workflow"))


def test_the_console_shows_each_trainings_progress_with_an_eta_and_the_log_keeps_every_line(workdir):
    """Rank 0 of each training echoes its progress to the workflow's console (the launcher passes it
    the console Snakemake started it with): at most a line every 10 s, and the last step's line."""
    console = console_of(workdir).read_text()
    finals = re.findall(
        r"^(digits-w2-\S+): step (\d+)/(\d+) \(100%\), [\d.]+ steps/s, ETA 0s, loss [\d.]+, [\d,]+ samples/s",
        console,
        re.MULTILINE,
    )
    trainings = sorted(path.name for path in (workdir / "results" / "trainings").iterdir())
    assert sorted(name for name, _, _ in finals) == trainings and len(trainings) == 2
    for name, step, total in finals:
        assert step == total
        log = (workdir / "logs" / "train" / f"{name}.log").read_text()
        logged = re.findall(rf"^{re.escape(name)}: step \d+/{total} \(\d+%\), .*ETA", log, re.MULTILINE)
        assert len(logged) == 10  # the log keeps its line per 10 %


def test_full_run_writes_summary_row_per_run(workdir):
    rows = list(csv.DictReader((workdir / "results" / "experiments" / "tiny" / "summary.csv").open()))
    assert [r["run"] for r in rows] == ["ddp", "independent", "independent_ties"]
    for row in rows:
        assert row["dataset"] == "digits" and row["world_size"] == "2"
        assert 0.5 < float(row["test_accuracy_merged"]) <= 1.0
    ddp = rows[0]
    assert float(ddp["test_accuracy_merged"]) == float(ddp["test_accuracy_best_rank"])
    assert float(rows[1]["max_abs_diff_between_ranks"]) > 0
    assert rows[1]["test_accuracy_ddp_baseline"] == ddp["test_accuracy_merged"]


def test_runs_differing_only_in_merge_method_share_one_training(workdir):
    assert ranks_dir(workdir, "independent") == ranks_dir(workdir, "independent_ties")
    assert ranks_dir(workdir, "independent") != ranks_dir(workdir, "ddp")
    logs = sorted(log.name for log in (workdir / "logs" / "train").glob("*.log"))
    trainings = sorted(log.removesuffix(".log") for log in logs if ".attempt-" not in log)
    attempts = [f"{name}.attempt-1.log" for name in trainings]
    assert logs == sorted([f"{name}.log" for name in trainings] + attempts)
    assert len(trainings) == 2
    merges = [
        json.loads((workdir / f"results/runs/{r}/merge.json").read_text())
        for r in ("independent", "independent_ties")
    ]
    assert [m["method"] for m in merges] == ["uniform", "ties"]


def test_every_rule_wrote_its_log_and_expensive_rules_a_benchmark(workdir):
    for rule in ("prepare_dataset", "partition", "train", "gather", "merge", "evaluate", "track", "summary"):
        assert list((workdir / "logs" / rule).rglob("*.log")), rule
    for rule in ("prepare_dataset", "partition", "train", "merge", "evaluate"):
        assert list((workdir / "benchmarks" / rule).rglob("*.tsv")), rule


def test_mlflow_has_one_parent_per_run_with_world_size_children(workdir):
    state = mlflow_state(workdir)
    assert sorted(r.info.run_name for r in state["parents"]) == ["ddp", "independent", "independent_ties"]
    assert sorted(r.info.run_name for r in state["children"]) == [
        f"{run}/rank-{rank}" for run in ("ddp", "independent", "independent_ties") for rank in (0, 1)
    ]
    ddp = next(r for r in state["parents"] if r.info.run_name == "ddp")
    assert ddp.data.params["strategy"] == "ddp" and ddp.data.params["merge_method"] == "consolidate"
    assert ddp.data.params["dataset_spec.source"] == "digits"
    assert "test_accuracy_merged" in ddp.data.metrics and "train_seconds" in ddp.data.metrics
    from mlflow.tracking import MlflowClient

    client = MlflowClient(tracking_uri=f"sqlite:///{workdir}/mlflow.db")
    for parent in state["parents"]:
        artifacts = {a.path for a in client.list_artifacts(parent.info.run_id, "comparison")}
        assert artifacts == {"comparison/merge_methods.png", "comparison/communication.png"}, (
            parent.info.run_name
        )
    train = json.loads((ranks_dir(workdir, "ddp") / "train.json").read_text())
    assert len(state["histories"][("ddp/rank-0", "loss")]) == train["num_steps"]


def test_until_partition_stops_before_training_with_one_shard_set_per_alpha_beside_the_iid_one(tmp_path):
    """``--until partition`` on an alpha sweep (runs.tsv rows differing in partition_alpha): one shard set
    per alpha beside the iid one (unchanged: no partition entry), none trained."""
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    sweep = {f"alpha{alpha}": {"partition": "dirichlet", "partition_alpha": alpha} for alpha in (0.1, 10)}
    config["runs"] = {"ddp": config["runs"]["ddp"], **sweep}
    path.write_text(yaml.safe_dump(config))
    snakemake(tmp_path, "--until", "partition")
    assert not (tmp_path / "results" / "runs").exists()
    assert not (tmp_path / "results" / "trainings").exists()
    shards = tmp_path / "results" / "shards" / "digits"
    manifests = {p.parent.name: json.loads(p.read_text()) for p in shards.glob("*/manifest.json")}
    iid = manifests.pop("w2-seed0")
    assert iid["world_size"] == 2 and "partition" not in iid and len(manifests) == 2
    alphas = {m["partition"]["params"]["alpha"]: m["heterogeneity"] for m in manifests.values()}
    assert alphas[0.1]["label_jsd_mean"] > alphas[10.0]["label_jsd_mean"]
    assert all(name.startswith("w2-seed0-dirichlet-") for name in manifests)


def test_invalid_config_fails_before_any_job_with_one_clear_line(tmp_path):
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["runs"]["ddp"]["world_size"] = 0
    path.write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert "config error at runs[ddp].world_size: 0 is less than the minimum of 1" in proc.stderr
    assert not (tmp_path / "results").exists()


def test_a_config_error_in_a_users_configfile_names_that_file_not_config_yaml(tmp_path):
    """Snakemake reads the checkout's config/config.yaml, then --configfile over it."""
    (tmp_path / "config").mkdir()
    shutil.copy(REPO / "config" / "config.yaml", tmp_path / "config" / "config.yaml")
    shutil.copy(REPO / "config" / "runs.tsv", tmp_path / "config" / "runs.tsv")
    mine = tmp_path / "sweep.yaml"
    mine.write_text("run_defaults:\n  lr: -0.1\n")
    proc = subprocess.run(
        [*snakemake_command(tmp_path, "-n", "--configfile", mine)],
        capture_output=True, text=True, env=subprocess_env(), timeout=120,
    )  # fmt: skip
    assert proc.returncode != 0
    assert (
        f"config error at run_defaults.lr (in {mine}): -0.1 is less than or equal to the minimum of 0; "
        f"fix it in {mine}"
    ) in proc.stdout + proc.stderr
    assert not (tmp_path / "results").exists()


def test_several_nodes_with_the_local_executor_fail_before_any_job(tmp_path):
    path = tiny_config(tmp_path)
    config = yaml.safe_load(path.read_text())
    config["runs"]["ddp"].update(nodes=2, nproc_per_node=1)
    path.write_text(yaml.safe_dump(config))
    proc = snakemake(tmp_path, check=False)
    assert proc.returncode != 0
    assert (
        "run(s) ddp ask for several nodes, which needs a SLURM allocation; run with --profile "
        "profiles/slurm or set nodes to 1" in proc.stderr
    )
    assert not (tmp_path / "results").exists()


def test_workflow_draws_the_communication_plot_and_attaches_it_with_the_merge_methods_plot(tmp_path):
    config = {
        "runs": {"ddp": {"strategy": "ddp", "merge_method": "consolidate"},
                 "independent": {"strategy": "localsgd", "sync_every": 0, "merge_method": "uniform"}},
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "epochs": 1},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }  # fmt: skip
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    command = snakemake_command(tmp_path, "--configfile", tmp_path / "config.yaml", "--cores", "1",
                                "--dry-run", "--printshellcmds")  # fmt: skip
    proc = subprocess.run(command, capture_output=True, text=True, env=subprocess_env(), timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (
        "python -m shardfuse.plots communication --summary results/summary.csv"
        " --out results/plots/communication.png > logs/plots/communication.log 2>&1"
    ) in proc.stdout
    assert (
        "python -m shardfuse.comparison --png results/plots/merge_methods.png results/plots/communication.png"
        " --summary results/summary.csv --records results/runs/ddp/mlflow.json"
        " results/runs/independent/mlflow.json --out results/plots/comparison.mlflow.json"
    ) in proc.stdout
    assert (REPO / "workflow" / "report" / "communication.rst").is_file()  # the report's caption


def test_snakemake_refuses_a_config_file_with_a_duplicated_key(tmp_path):
    from tests.support.helpers import snakemake_command, subprocess_env

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(
        "datasets:\n  digits: {source: digits}\nruns:\n  r: {strategy: ddp, merge_method: consolidate}\n"
        "datasets:\n  other: {source: digits}\n"
    )
    proc = subprocess.run(
        snakemake_command(tmp_path, "--dry-run"), capture_output=True, text=True, env=subprocess_env()
    )
    assert proc.returncode != 0
    message = "line 5: key 'datasets' appears twice at the top level (first on line 1)"
    assert message in proc.stdout + proc.stderr


def test_a_sweep_of_many_runs_keeps_the_track_jobs_command_short(tmp_path):
    """The one track job takes every run's config from a file named by its content: a sweep's configs
    would pass the 128 KiB a single command line may hold."""
    runs = {f"sweep_{index:03d}": {"merge_method": "task_arithmetic", "merge_scale": 0.5 + index / 1000}
            for index in range(150)}  # fmt: skip
    config = {
        "runs": runs,
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {"dataset": "digits", "world_size": 2, "strategy": "localsgd", "sync_every": 0},
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    dry = snakemake(tmp_path, "--dry-run")
    (command,) = [line for line in dry.stdout.splitlines() if "python -m shardfuse.tracking" in line]
    assert len(command) < 2000, len(command)
    (runs_file,) = (tmp_path / ".snakemake" / "shardfuse" / "track-runs").glob("*.json")
    assert f"--runs-json @{runs_file.relative_to(tmp_path)}" in command
    entries = json.loads(runs_file.read_text())
    assert [entry["run"] for entry in entries] == list(runs)
    assert len(runs_file.read_bytes()) > 128 * 1024  # what the command line could not have held
    # Edited by hand, the file is written again from the config at the next planning.
    edited = json.loads(runs_file.read_text())
    edited[0]["config"]["merge_method"] = "uniform"
    runs_file.write_text(json.dumps(edited))
    snakemake(tmp_path, "--dry-run")
    assert json.loads(runs_file.read_text()) == entries
