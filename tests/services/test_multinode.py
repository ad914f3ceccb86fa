"""Multi-node training for real: a two-node SLURM cluster on this machine (scripts/slurm-netns-up.sh).

Each node's slurmd runs in its own network, UTS and mount namespace (node1 = 10.231.187.11,
node2 = 10.231.187.12, bridged to the host, where slurmctld runs). A run with ``nodes: 2`` goes
through the train rule under the SLURM profile: one srun task per node, each a torchrun agent, the
c10d rendezvous and gloo's all-reduce crossing the namespaces. The cluster is independent of the
one of scripts/slurm-up.sh (own ports, munged, state dir); clients pick it with SLURM_CONF, which
is passed to every subprocess here and never set in this process's environment.

Required in CI (a cluster that does not come up fails there); skipped elsewhere, with the reason.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
import yaml

from shardfuse.checkpoints.weights import load_weights
from tests.support.helpers import (
    MEASUREMENTS,
    REPO,
    SLURM_FAST_STATUS,
    snakemake_command,
    snakemake_failure,
    subprocess_env,
)

pytestmark = pytest.mark.slurm

STATE_DIR = Path(os.environ.get("SHARDFUSE_NETNS_DIR", "/tmp/shardfuse-slurm-netns"))
SLURM_CONF = STATE_DIR / "slurm.conf"
UP = REPO / "scripts" / "slurm-netns-up.sh"
DOWN = REPO / "scripts" / "slurm-netns-down.sh"
NODES = ("node1", "node2")


def cluster_env() -> dict[str, str]:
    """Environment of every client call: sbatch/squeue/scancel (and the jobs) use this cluster."""
    return {**subprocess_env(), "SLURM_CONF": str(SLURM_CONF), "SHARDFUSE_NETNS_DIR": str(STATE_DIR)}


def slurm(*args: str, timeout: float = 30) -> str:
    return subprocess.run(
        list(args), capture_output=True, text=True, env=cluster_env(), timeout=timeout
    ).stdout.strip()


def bring_up() -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(UP)], capture_output=True, text=True, env=cluster_env(), timeout=300)


@pytest.fixture(scope="module")
def netns_cluster():
    """Two namespaced nodes for this module; torn down (every namespace, link, daemon) at its end."""
    started = time.perf_counter()
    reason = None
    if os.geteuid() != 0:
        reason = "needs root (network namespaces, veth pairs, a bridge)"
    else:
        try:
            proc = bring_up()
            if proc.returncode != 0:
                errors = "\n".join(line for line in proc.stderr.splitlines() if "ERROR" in line)
                reason = (
                    f"scripts/slurm-netns-up.sh exited {proc.returncode}: {errors}\n{proc.stderr[-3000:]}"
                )
        except (OSError, subprocess.SubprocessError) as exc:
            reason = f"scripts/slurm-netns-up.sh did not run: {exc}"
    if reason:
        if os.geteuid() == 0:  # remove whatever a failed up left behind
            subprocess.run(["bash", str(DOWN)], capture_output=True, env=cluster_env(), timeout=120)
        if os.environ.get("CI"):
            pytest.fail(f"two-node SLURM cluster unavailable: {reason}")
        pytest.skip(f"two-node SLURM cluster unavailable: {reason}")
    MEASUREMENTS.append(f"two-node cluster up: {time.perf_counter() - started:.1f} s")
    try:
        yield STATE_DIR
    finally:
        if not os.environ.get("SHARDFUSE_NETNS_KEEP"):
            started = time.perf_counter()
            down = subprocess.run(
                ["bash", str(DOWN)], capture_output=True, text=True, env=cluster_env(), timeout=300
            )
            MEASUREMENTS.append(f"two-node cluster down: {time.perf_counter() - started:.1f} s")
            assert down.returncode == 0, down.stderr[-3000:]


def experiment(path: Path, runs: dict[str, dict], **defaults) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    config = {
        "runs": {
            name: {"strategy": "ddp", "merge_method": "consolidate", **run} for name, run in runs.items()
        },
        "datasets": {"digits": {"source": "digits"}},
        "run_defaults": {
            "dataset": "digits",
            "world_size": 2,
            "hidden_sizes": [16],
            "epochs": 2,
            "checkpoint_every": 10,
            **defaults,
        },
        "mlflow": {"tracking_uri": f"sqlite:///{path}/mlflow.db"},
    }
    (path / "config").mkdir()
    (path / "config" / "config.yaml").write_text(yaml.safe_dump(config))
    return path


def snakemake_cmd(workdir: Path, *args: str) -> list[str]:
    return snakemake_command(workdir, "--profile", REPO / "profiles" / "slurm", *SLURM_FAST_STATUS, *args)


# Same world size across two nodes and on one node: (run across nodes, run on one node, ranks per node).
# The last pair shards the model over each node's two ranks (fsdp: 2, a replica per node, HSDP across).
PAIRS = [("multi", "single", 1), ("multi4", "single4", 2), ("multi4_fsdp", "single4_fsdp", 2)]
RUNS = {
    "multi": {"nodes": 2, "nproc_per_node": 1, "world_size": 2},
    "single": {"nodes": 1, "nproc_per_node": 2, "world_size": 2},
    "multi4": {"nodes": 2, "nproc_per_node": 2, "world_size": 4},
    "single4": {"nodes": 1, "nproc_per_node": 4, "world_size": 4},
    "multi4_fsdp": {"nodes": 2, "nproc_per_node": 2, "world_size": 4, "fsdp": 2},
    "single4_fsdp": {"nodes": 1, "nproc_per_node": 4, "world_size": 4, "fsdp": 2},
}


def training_dir(workdir: Path, run: str) -> Path:
    """results/trainings/<training> of a run, found by the launch line its train log starts with."""
    cfg = RUNS[run]
    if cfg["nodes"] == 1:
        launch = f" --standalone --nnodes=1 --nproc-per-node={cfg['nproc_per_node']} "
    else:
        launch = f" --node-step --nodes={cfg['nodes']} --nproc-per-node={cfg['nproc_per_node']} "
    fsdp = f'"fsdp":{cfg["fsdp"]},' if "fsdp" in cfg else None
    found = [
        workdir / "results" / "trainings" / log.stem
        for log in (workdir / "logs" / "train").glob("*.log")
        if ".attempt-" not in log.name
        and launch in (first := log.read_text().split("\n", 1)[0])
        and (fsdp in first if fsdp else '"fsdp"' not in first)
    ]
    assert len(found) == 1, (run, found)
    return found[0]


@pytest.fixture(scope="module")
def two_node_workdir(netns_cluster, tmp_path_factory):
    """One workflow: world size 2 and 4, each across two nodes and on one node."""
    workdir = experiment(tmp_path_factory.mktemp("multinode") / "work", RUNS)
    started = time.perf_counter()
    proc = subprocess.run(
        snakemake_cmd(workdir), capture_output=True, text=True, env=cluster_env(), timeout=720
    )
    seconds = time.perf_counter() - started
    MEASUREMENTS.append(
        f"two-node workflow (2x1, 1x2, 2x2, 1x4, 2x2 and 1x4 with fsdp 2; all rules): {seconds:.1f} s"
    )
    assert proc.returncode == 0, snakemake_failure(workdir, proc)
    return workdir


def test_two_node_runs_complete_the_workflow(two_node_workdir):
    results = two_node_workdir / "results"
    assert len((results / "summary.csv").read_text().splitlines()) == 1 + len(RUNS)
    for run in RUNS:
        assert (results / "runs" / run / "merged.safetensors").is_file()
        assert (results / "runs" / run / "eval.json").is_file()


@pytest.mark.parametrize(("multi", "single", "per_node"), PAIRS)
def test_each_rank_records_the_node_it_ran_on(two_node_workdir, multi, single, per_node):
    ranks = training_dir(two_node_workdir, multi) / "ranks"
    hosts = json.loads((ranks / "train.json").read_text())["hosts"]
    # c10d assigns node ranks in arrival order: node2 may hold ranks 0..per_node-1.
    assert sorted(hosts) == sorted(NODES * per_node)
    assert all(len(set(hosts[r : r + per_node])) == 1 for r in range(0, len(hosts), per_node)), hosts
    train = json.loads((ranks / "train.json").read_text())
    # A checkpoint per rank, or per replica under fsdp: its ranks all on one node (FSDP inside the node).
    members = [entry.get("ranks", [entry["rank"]]) for entry in train["ranks"]]
    assert all(len({hosts[r] for r in group}) == 1 for group in members), (members, hosts)
    sidecars = [json.loads((ranks / f"rank-{r}.json").read_text())["host"] for r in range(len(members))]
    assert sidecars == [hosts[group[0]] for group in members]
    if "fsdp" in RUNS[multi]:
        assert members == [[0, 1], [2, 3]] and train["fsdp"]["hsdp"] is True
    single_hosts = json.loads((training_dir(two_node_workdir, single) / "ranks" / "train.json").read_text())[
        "hosts"
    ]
    assert len(set(single_hosts)) == 1 and single_hosts[0] in NODES


@pytest.mark.parametrize(("multi", "single", "per_node"), PAIRS)
def test_two_node_train_log_shows_srun_and_one_torchrun_agent_per_node(
    two_node_workdir, multi, single, per_node
):
    log = (
        two_node_workdir / "logs" / "train" / f"{training_dir(two_node_workdir, multi).name}.log"
    ).read_text()
    launches = [line for line in log.splitlines() if line.startswith("launch: ")]
    srun = " srun --nodes=2 --ntasks=2 --ntasks-per-node=1 "
    assert any(srun in f"{line} " for line in launches), log[-3000:]
    agents = [line for line in launches if "shardfuse.agent" in line and "--rdzv-backend=c10d" in line]
    assert sorted(a.split("--node-rank=")[1].split()[0] for a in agents) == ["0", "1"], log[-3000:]
    assert all("--rdzv-endpoint=node1:" in a and f"--nproc-per-node={per_node} " in a for a in agents)


@pytest.mark.parametrize(("multi", "single", "per_node"), PAIRS)
def test_ddp_across_two_nodes_is_bitwise_identical_to_one_node(two_node_workdir, multi, single, per_node):
    runs = two_node_workdir / "results" / "runs"
    across, _ = load_weights(runs / multi / "merged.safetensors")
    one_node, _ = load_weights(runs / single / "merged.safetensors")
    assert across.keys() == one_node.keys()
    assert all(torch.equal(across[name], one_node[name]) for name in across)


def wait_for(condition, what: str, timeout: float, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"snakemake exited ({proc.returncode}) while waiting for {what}")
        time.sleep(0.5)
    raise AssertionError(f"no {what} within {timeout} s")


def job_state(job_id: str) -> str:
    return slurm("squeue", "-h", "--states=all", "-j", job_id, "-o", "%T")


def running_train_job(workdir: Path) -> str | None:
    for log in (workdir / ".snakemake" / "slurm_logs" / "rule_train").rglob("*.log"):
        if job_state(log.stem) == "RUNNING":
            return log.stem
    return None


def node_state(node: str) -> str:
    return slurm("sinfo", "-h", "-n", node, "-o", "%T")


def node_pids(namespace: str) -> list[int]:
    """Processes inside a node's network namespace: its slurmd and its job steps."""
    out = subprocess.run(["ip", "netns", "pids", namespace], capture_output=True, text=True).stdout
    return [int(pid) for pid in out.split()]


def signal_all(pids: list[int], signum: int) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signum)


def kill_node2_mid_training(
    workdir: Path, cluster: Path, snakemake: subprocess.Popen
) -> tuple[str, list[int]]:
    """Once the train job runs and one of its checkpoints is complete: node2's slurmd killed (kill -9, by
    pid file) and the rest of the node frozen, as a hung machine. (The train job's id, the frozen pids.)"""
    job_id = wait_for(lambda: running_train_job(workdir), "running train job", 180, snakemake)
    wait_for(
        lambda: list(workdir.glob("results/trainings/*/.ranks.partial/checkpoints/step-*/COMPLETE")),
        "complete checkpoint",
        120,
        snakemake,
    )
    os.kill(int((cluster / "slurmd-node2.pid").read_text()), signal.SIGKILL)
    frozen = node_pids("sfn-node2")
    signal_all(frozen, signal.SIGSTOP)
    return job_id, frozen


def test_losing_a_node_fails_the_job_and_the_retry_resumes_from_its_checkpoint(netns_cluster, tmp_path):
    """node2 dies mid-training: its slurmd is killed (kill -9, by pid file) and the rest of the node
    freezes, as a hung machine would (without that, a fast machine can finish the training before
    the controller notices). The controller declares the node dead after SlurmdTimeout and fails the
    job (NODE_FAIL); Snakemake's --retries resubmits it, the retry waits for the node, and once node2
    is back (processes gone, slurmd restarted) the training resumes from its newest checkpoint."""
    workdir = experiment(
        tmp_path / "work", {"long": {"nodes": 2, "nproc_per_node": 1}}, epochs=60, checkpoint_every=100
    )
    started = time.perf_counter()
    output = tmp_path / "snakemake.out"
    with (
        output.open("w") as out,
        subprocess.Popen(
            snakemake_cmd(workdir, "--until", "train", "--retries", "1"),
            stdout=out,
            stderr=subprocess.STDOUT,
            text=True,
            env=cluster_env(),
        ) as snakemake,
    ):
        try:
            job_id, frozen = kill_node2_mid_training(workdir, netns_cluster, snakemake)
            killed = time.perf_counter()
            wait_for(lambda: job_state(job_id) == "NODE_FAIL", "NODE_FAIL of the train job", 90, snakemake)
            detected = time.perf_counter() - killed
            assert node_state("node2").startswith("down"), node_state("node2")
            signal_all(frozen, signal.SIGKILL)  # the node reboots: its processes are gone
            up = bring_up()  # starts node2's slurmd again; the node rejoins and the retry runs
            assert up.returncode == 0, up.stderr[-3000:]
            snakemake.wait(timeout=300)
        finally:
            if snakemake.poll() is None:
                snakemake.terminate()
    text = output.read_text()
    seconds = time.perf_counter() - started
    MEASUREMENTS.append(f"node loss + retry: {seconds:.1f} s; NODE_FAIL {detected:.1f} s after the kill")
    assert f"SLURM-job '{job_id}' failed due to a node failure, SLURM status is: 'NODE_FAIL'" in text, text[
        -4000:
    ]
    assert snakemake.returncode == 0, text[-4000:]
    (log,) = [log for log in (workdir / "logs" / "train").glob("*.log") if ".attempt-" not in log.name]
    assert "resuming from checkpoint step" in log.read_text()
    # The attempt the node loss killed keeps its own log.
    assert "resuming from checkpoint step" not in log.with_suffix(".attempt-1.log").read_text()
    (train_json,) = workdir.glob("results/trainings/*/ranks/train.json")
    assert sorted(json.loads(train_json.read_text())["hosts"]) == list(NODES)


def test_a_node_lost_for_good_leaves_the_other_node_training_and_the_run_is_fused_and_tracked(
    netns_cluster, tmp_path
):
    """node2 dies for good mid-training (slurmd killed, the rest of the node frozen, never back). The job
    asked for --no-kill (min_ranks 1 on two nodes), so SLURM takes node2 out of the job instead of
    ending it; the srun step ends, the launcher finds node2 gone and starts rank 0 again alone on node1
    from the newest complete checkpoint. The run is merged from the survivor, evaluated and tracked."""
    run = {"strategy": "localsgd", "sync_every": 0, "merge_method": "uniform", "nodes": 2}
    run |= {"nproc_per_node": 1, "min_ranks": 1, "node_timeout": 30}
    workdir = experiment(tmp_path / "work", {"lossy": run}, epochs=60, checkpoint_every=100)
    started = time.perf_counter()
    output = tmp_path / "snakemake.out"
    frozen: list[int] = []
    try:
        with (
            output.open("w") as out,
            subprocess.Popen(
                snakemake_cmd(workdir), stdout=out, stderr=subprocess.STDOUT, text=True, env=cluster_env()
            ) as snakemake,
        ):
            try:
                _, frozen = kill_node2_mid_training(workdir, netns_cluster, snakemake)
                snakemake.wait(timeout=420)
            finally:
                if snakemake.poll() is None:
                    snakemake.terminate()
    finally:
        signal_all(frozen, signal.SIGKILL)  # node2 "reboots" for the tests after this one
        assert bring_up().returncode == 0
    text = output.read_text()
    MEASUREMENTS.append(f"node lost for good, the other node goes on: {time.perf_counter() - started:.1f} s")
    assert snakemake.returncode == 0, text[-4000:]
    (training,) = (workdir / "results" / "trainings").iterdir()
    log = (workdir / "logs" / "train" / f"{training.name}.log").read_text()
    assert "launch: node(s) node2 lost for good" in log and "with rank(s) 1; the other 1 of 2 ranks" in log
    record = json.loads((training / "ranks" / "train.json").read_text())
    membership = record["membership"]
    assert membership["lost_ranks"] == [1] and record["hosts"] == ["node1"]
    lost_at = record["ranks"][1]["lost_at_step"]
    assert lost_at >= 100 and lost_at % 100 == 0 and record["num_steps"] > lost_at
    assert 0 < membership["coverage"] < 1
    evaluation = json.loads((workdir / "results" / "runs" / "lossy" / "eval.json").read_text())
    assert evaluation["ranks_lost"] == 1 and [r["rank"] for r in evaluation["ranks"]] == [0]
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir}/mlflow.db")
    (experiment_id,) = [e.experiment_id for e in client.search_experiments() if e.name != "Default"]
    parents = {r.info.run_name: r for r in client.search_runs([experiment_id], "")}
    assert parents["lossy"].data.metrics["ranks_lost"] == 1.0
    assert parents["lossy/rank-1"].data.tags["shardfuse.lost"] == "true"
