"""A rank lost for good, with real faults: a harness outside the training SIGKILLs rank 1 every time it
runs past the checkpoint of step 40 (tests/support/faults.py), so it fails max_restarts + 1 times in a row
at that step. With min_ranks 2 of 3 the other ranks go on from that checkpoint without it:
- an independent training, through the workflow: the survivors end bitwise as they would have without
  the fault (each trains its own shard), gather and merge fuse those two, and train.json, gather.json,
  eval.json, summary.csv and MLflow say a rank was lost, the coverage (the survivors' share of the rows)
  and the steps discarded (all 40 of the lost rank's); its child run is FAILED and tagged lost;
- localsgd (sync_every 5): the survivors average without it, the lost rank's rows count in every
  average before the loss;
- DiLoCo (sync_every 16): the survivors' outer steps go on; the lost rank's 8 steps since its last outer
  step are discarded;
- ddp with orphans: reshard (elastic data parallel): the survivors go on as one model, each of the lost
  rank's micro-batches from step 40 on split between them; nothing discarded, every row seen; twice the
  same loss gives bitwise the same model; gather and merge (consolidate) fuse the survivors.
"""

from __future__ import annotations

import csv
import json
import shlex
import subprocess
import sys

import pytest
import torch
import yaml
from mlflow import MlflowClient

from shardfuse.checkpoints.weights import load_weights
from shardfuse.data.epoch_steps import plan_epochs
from tests.support.data import prepare_and_partition
from tests.support.faults import KillRankPast
from tests.support.helpers import call_stage, run_stage, snakemake, subprocess_env
from tests.support.training import RESUME_CFG

DIGITS = '{"source": "digits", "test_fraction": 0.2, "seed": 0}'
LOSS_CFG = {**RESUME_CFG, "hidden_sizes": [128, 128], "batch_size": 32, "epochs": 6, "checkpoint_every": 40}
LOST_LINE = (
    "launch: rank 1 was lost for good: it failed 2 time(s) in a row at step 40 (max_restarts 1); the other 2 "
    "of 3 ranks go on from step 40 without it (min_ranks 2); its shard 1 is left unseen (orphans: drop)"
)


@pytest.fixture(scope="module")
def three_shards(tmp_path_factory):
    return prepare_and_partition(tmp_path_factory.mktemp("digits3"), "digits", DIGITS, world_size=3)


def launch(out, data, cfg: dict, min_ranks: int | None = 2, kill: bool = True):
    dataset, shards = data
    args = ["--nproc-per-node", 3, "--max-restarts", 1, *(["--min-ranks", min_ranks] if min_ranks else [])]
    args += ["--out-dir", out, "--", "--run-name", "r", "--shard-dir", shards, "--dataset-dir", dataset]
    args += ["--config-json", json.dumps(cfg)]
    if not kill:
        return run_stage("launch", *args)
    with KillRankPast(out, rank=1, step=40) as harness:
        proc = run_stage("launch", *args)
    assert len(harness.kills) == 2, (harness.kills, proc.stderr[-3000:])  # one per torchrun attempt
    return proc


DEALT_LINE = LOST_LINE.replace(
    "is left unseen (orphans: drop)",
    "is dealt to them, each of its micro-batches split 2 ways (orphans: reshard)",
)


def lose_rank_1(tmp_path, data, strategy: str, sync_every: int, orphans: str = "drop") -> dict:
    """A training of ``strategy`` losing rank 1 at step 40, going on with min_ranks 2: its train.json."""
    cfg = {**LOSS_CFG, "strategy": strategy, "sync_every": sync_every, "min_ranks": 2, "orphans": orphans}
    proc = launch(tmp_path / "ranks", data, cfg)
    line = LOST_LINE if orphans == "drop" else DEALT_LINE
    assert proc.returncode == 0 and line in proc.stderr, proc.stderr[-3000:]
    return json.loads((tmp_path / "ranks" / "train.json").read_text())


def rank_files(ranks) -> dict[str, bytes]:
    return {name: (ranks / name).read_bytes() for name in ("rank-0.safetensors", "rank-2.safetensors")}


def test_an_independent_trainings_survivors_end_as_without_the_fault_and_the_fusion_says_what_it_holds(
    tmp_path,
):
    config = {
        "datasets": {"digits": json.loads(DIGITS)},
        "run_defaults": {"dataset": "digits", "world_size": 3, "max_restarts": 1, **LOSS_CFG},
        "runs": {
            "lossy": {"strategy": "localsgd", "sync_every": 0, "merge_method": "uniform", "min_ranks": 2}
        },
        "mlflow": {"tracking_uri": f"sqlite:///{tmp_path}/mlflow.db", "experiment": "lossy"},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    with KillRankPast(None, rank=1, step=40, workdir=tmp_path) as harness:
        proc = snakemake(tmp_path)
    assert len(harness.kills) == 2
    assert LOST_LINE in proc.stderr  # on the workflow's console, not only in the training's log
    (training,) = (tmp_path / "results" / "trainings").iterdir()
    ranks = training / "ranks"
    record = json.loads((ranks / "train.json").read_text())
    membership = record["membership"]
    assert membership["lost_ranks"] == [1] and membership["steps_discarded"] == 40
    manifest = json.loads((tmp_path / "results/shards/digits/w3-seed0/manifest.json").read_text())
    rows = [shard["rows"] for shard in manifest["shards"]]
    coverage = (rows[0] + rows[2]) / sum(rows)  # every epoch: the lost model is gone with its shard
    assert membership["coverage"] == pytest.approx(coverage)
    assert membership["coverage_per_epoch"] == pytest.approx([coverage] * LOSS_CFG["epochs"])
    lost_entry = {"rank": 1, "rows": rows[1], "lost": True, "lost_at_step": 40, "steps_discarded": 40}
    assert record["ranks"][1] == {**lost_entry, "checkpoint": None}
    assert not (ranks / "rank-1.safetensors").exists()
    assert (ranks / "metrics" / "rank-1.parquet").is_file()  # its curve up to the loss stays
    gather = json.loads((training / "gather.json").read_text())
    assert [entry["rank"] for entry in gather["ranks"]] == [0, 2]
    merge = json.loads((tmp_path / "results/runs/lossy/merge.json").read_text())
    assert merge["num_ranks"] == 2 and [i["rank"] for i in merge["ingredients"]] == [0, 2]
    evaluation = json.loads((tmp_path / "results/runs/lossy/eval.json").read_text())
    assert (evaluation["ranks_lost"], evaluation["steps_discarded"]) == (1, 40)
    assert evaluation["coverage"] == pytest.approx(coverage)
    assert [r["rank"] for r in evaluation["ranks"]] == [0, 2]
    with open(tmp_path / "results/experiments/lossy/summary.csv", newline="") as fh:
        (row,) = csv.DictReader(fh)
    assert (row["ranks_lost"], row["steps_discarded"]) == ("1", "40")
    assert float(row["coverage"]) == pytest.approx(coverage)
    client = MlflowClient(f"sqlite:///{tmp_path}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("lossy").experiment_id], "")
    by_name = {run.info.run_name: run for run in runs}
    assert by_name["lossy"].data.metrics["ranks_lost"] == 1.0
    assert by_name["lossy"].data.metrics["coverage"] == pytest.approx(coverage)
    lost = by_name["lossy/rank-1"]
    assert lost.info.status == "FAILED" and lost.data.tags["shardfuse.lost"] == "true"
    assert (
        by_name["lossy/rank-2"].info.status == "FINISHED"
        and "shardfuse.lost" not in by_name["lossy/rank-2"].data.tags
    )

    # The same training's command without min_ranks and without the fault: ranks 0 and 2 end the same.
    shell = next(
        line.removeprefix("Shell command: ")
        for line in (proc.stdout + proc.stderr).splitlines()
        if line.startswith("Shell command: python -m shardfuse.launch")
    )
    words = shlex.split(shell)
    at = words.index("--min-ranks")
    words = words[:at] + words[at + 2 :]
    words[words.index("--out-dir") + 1] = "reference/ranks"
    words[words.index("--log") + 1] = "reference/train.log"
    reference = subprocess.run(
        [sys.executable, *words[1:]], cwd=tmp_path, capture_output=True, text=True, env=subprocess_env()
    )
    assert reference.returncode == 0, (tmp_path / "reference/train.log").read_text()[-3000:]
    assert rank_files(tmp_path / "reference/ranks") == rank_files(ranks)


def test_localsgd_survivors_average_without_the_lost_rank_whose_rows_count_until_its_last_sync(
    tmp_path, three_shards
):
    record = lose_rank_1(tmp_path, three_shards, "localsgd", 5)
    assert record["membership"]["steps_discarded"] == 0  # it synced at step 40, then it was lost
    steps_per_epoch = record["steps_per_epoch"]
    per_epoch = record["membership"]["coverage_per_epoch"]
    assert per_epoch[: 40 // steps_per_epoch] == [1.0] * (40 // steps_per_epoch)  # in every average
    rows = [shard["rows"] for shard in json.loads((three_shards[1] / "manifest.json").read_text())["shards"]]
    assert per_epoch[-1] == pytest.approx((rows[0] + rows[2]) / sum(rows))  # the survivors' shards only


def test_diloco_survivors_go_on_with_their_outer_steps_and_the_lost_rows_dealt_to_them(
    tmp_path, three_shards
):
    """DiLoCo with orphans: reshard (localsgd's test above drops them): the steps since the last outer
    step are discarded, and every row is still seen, the lost shard's dealt to the survivors."""
    record = lose_rank_1(tmp_path, three_shards, "diloco", 16, orphans="reshard")
    assert record["membership"]["lost_ranks"] == [1]
    assert record["membership"]["steps_discarded"] == 40 % 16
    survivors = [entry for entry in record["ranks"] if not entry.get("lost")]
    assert [entry["num_steps"] for entry in survivors] == [record["num_steps"]] * 2
    # Every row in every epoch, but for the lost rank's 8 steps since its last outer step: trained, and
    # reaching no published model.
    per_epoch = record["membership"]["coverage_per_epoch"]
    lost_epoch = 40 // record["steps_per_epoch"]
    assert 0.75 < per_epoch[lost_epoch] < 1.0
    assert per_epoch[:lost_epoch] + per_epoch[lost_epoch + 1 :] == [1.0] * (LOSS_CFG["epochs"] - 1)
    assert all(entry["rows_dealt"] > 0 for entry in survivors)


def test_ddp_with_reshard_deals_the_lost_rows_to_the_survivors_bitwise_the_same_every_time(
    tmp_path, three_shards
):
    cfg = {**LOSS_CFG, "strategy": "ddp", "min_ranks": 2, "orphans": "reshard"}
    dealt_line = DEALT_LINE
    models = []
    for attempt in ("first", "second"):
        proc = launch(tmp_path / attempt / "ranks", three_shards, cfg)
        assert proc.returncode == 0 and dealt_line in proc.stderr, proc.stderr[-3000:]
        models.append(rank_files(tmp_path / attempt / "ranks"))
    assert models[0] == models[1]  # the same loss at the same step: bitwise the same result
    first, _ = load_weights(tmp_path / "first" / "ranks" / "rank-0.safetensors")
    other, _ = load_weights(tmp_path / "first" / "ranks" / "rank-2.safetensors")
    assert first.keys() == other.keys() and all(torch.equal(first[k], other[k]) for k in first)  # one model
    ranks = tmp_path / "first" / "ranks"
    record = json.loads((ranks / "train.json").read_text())
    membership = record["membership"]
    assert membership["lost_ranks"] == [1] and membership["steps_discarded"] == 0
    assert membership["ranks"][1]["orphans"] == "reshard"
    assert membership["coverage_per_epoch"] == [1.0] * LOSS_CFG["epochs"]  # every row, every epoch
    # The survivors took on every row of the lost rank's epochs from step 40 on, in their rows_seen too.
    rows = [shard["rows"] for shard in json.loads((three_shards[1] / "manifest.json").read_text())["shards"]]
    plan = plan_epochs(rows, LOSS_CFG["batch_size"], "min")
    lost_epoch, lost_batch = divmod(40, record["steps_per_epoch"])
    left = plan.shards[1].rows * LOSS_CFG["epochs"] - plan.rows_seen(1, lost_epoch, lost_batch)
    survivors = [entry for entry in record["ranks"] if not entry.get("lost")]
    assert sum(entry["rows_dealt"] for entry in survivors) == left > 0
    assert all(
        entry["rows_seen"] == plan.shards[entry["rank"]].rows * LOSS_CFG["epochs"] + entry["rows_dealt"]
        for entry in survivors
    )
    gather = tmp_path / "gather.json"
    assert call_stage("gather", "--train-dir", ranks, "--world-size", 3, "--out", gather).returncode == 0
    assert json.loads(gather.read_text())["membership"]["coverage"] == 1.0
    merged = call_stage(
        "merge", "--run", "r", "--gather", gather, "--method", "consolidate", "--params-json", "{}",
        "--out-weights", tmp_path / "merged.safetensors", "--out-json", tmp_path / "merge.json",
    )  # fmt: skip
    assert merged.returncode == 0, merged.stderr
    assert json.loads((tmp_path / "merge.json").read_text())["num_ranks"] == 2
