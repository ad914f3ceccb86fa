"""Every file a stage reads from another stage is checked against the record that describes it, before any
work: a split against dataset.json (evaluate's test split, merge's and training's validation split), a
shard set against its manifest and dataset.json, dataset.json's claims against the data, and the base
checkpoint against what training recorded (gather). A mismatch is one line naming the file, what differs
and the stage to re-run; the intact files pass.

The session's prepared digits and small trainings are only read: each test copies what it changes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch

from shardfuse.checkpoints.weights import load_weights, read_metadata, save_weights
from shardfuse.data.dataset_info import read_dataset_info
from shardfuse.data.manifest import read_manifest
from shardfuse.data.verify import check_shard_set, check_split
from shardfuse.io import UserError, sha256_file
from shardfuse.launch import staging_dir
from shardfuse.rank.validation import Validator
from tests.support.helpers import call_stage, run_stage

RERUN_PREPARE = "re-run the prepare stage (snakemake -R prepare_dataset)"
RERUN_PARTITION = "re-run the partition stage (snakemake -R partition)"
RERUN_TRAIN = "re-run training (snakemake -R train)"


def assert_one_line(proc, stage: str, *fragments: str) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"shardfuse.{stage}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def dataset_copy(digits_dataset: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(digits_dataset, tmp_path / "digits"))


def edit_json(path: Path, change) -> None:
    record = json.loads(path.read_text())
    change(record)
    path.write_text(json.dumps(record, indent=2))


# ---------------------------------------------------------------- splits against dataset.json


@pytest.fixture(scope="module")
def merged_run(tmp_path_factory, small_trainings) -> Path:
    """A working directory with the session's independent training, gathered and merged (uniform)."""
    root = tmp_path_factory.mktemp("records")
    shutil.copytree(small_trainings / "results", root / "results", symlinks=True)
    proc = call_stage(
        "merge", "--gather", "results/trainings/independent/gather.json", "--method", "uniform",
        "--out-weights", "merged.safetensors", "--out-json", "merge.json", cwd=root,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    return root


def evaluate(root: Path, test: Path, out: Path):
    return call_stage(
        "evaluate", "--run", "r", "--test", test, "--gather", "results/trainings/independent/gather.json",
        "--merged", "merged.safetensors", "--out", out, cwd=root,
    )  # fmt: skip


def test_evaluate_refuses_a_test_split_that_is_not_the_one_prepare_recorded(
    merged_run, digits_dataset, tmp_path
):
    dataset = dataset_copy(digits_dataset, tmp_path)
    info = read_dataset_info(dataset)
    (dataset / "test.parquet").unlink()
    shutil.copy(dataset / "train.parquet", dataset / "test.parquet")  # the training split in its place
    proc = evaluate(merged_run, dataset / "test.parquet", tmp_path / "eval.json")
    assert_one_line(
        proc, "evaluate", "test.parquet is the dataset's train split (its sha256 is dataset.json's train "
        "entry), not the test split; pass the test.parquet split",
    )  # fmt: skip
    # Another file altogether (the first rows of the training split): what differs, and the stage to re-run.
    rows = pq.read_table(dataset / "train.parquet").slice(0, info["rows"]["test"] + 1)
    pq.write_table(rows, dataset / "test.parquet")
    proc = evaluate(merged_run, dataset / "test.parquet", tmp_path / "eval.json")
    line = assert_one_line(
        proc, "evaluate", f"has {info['rows']['test'] + 1} rows and sha256 ",
        f"records {info['rows']['test']} rows and {info['sha256']['test'][:12]}… for the test split; "
        "re-run the prepare stage (snakemake -R prepare_dataset)",
    )  # fmt: skip
    assert "test split " in line and str(dataset / "test.parquet") in line
    assert not (tmp_path / "eval.json").exists()
    # The split prepare wrote is scored, as before.
    proc = evaluate(merged_run, digits_dataset / "test.parquet", tmp_path / "eval.json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((tmp_path / "eval.json").read_text())["test_rows"] == info["rows"]["test"]


def test_a_split_without_its_dataset_json_or_its_record_is_refused(digits_dataset, tmp_path):
    bare = tmp_path / "bare"
    bare.mkdir()
    shutil.copy(digits_dataset / "test.parquet", bare / "test.parquet")
    with pytest.raises(UserError) as error:
        check_split(bare / "test.parquet", "test")
    expected = f"has no dataset.json beside it ({bare / 'dataset.json'}), so it cannot be checked"
    assert expected in str(error.value)
    dataset = dataset_copy(digits_dataset, tmp_path)
    edit_json(dataset / "dataset.json", lambda info: info["rows"].pop("val"))
    with pytest.raises(UserError, match="records no rows and sha256 for the val split; re-run the prepare"):
        check_split(dataset / "val.parquet", "val")
    with pytest.raises(UserError, match=r"test split .*absent.parquet does not exist; re-run the prepare"):
        check_split(dataset / "absent.parquet", "test")


def test_merge_greedy_soup_refuses_a_validation_split_that_is_not_the_one_prepare_recorded(
    merged_run, digits_dataset, tmp_path
):
    dataset = dataset_copy(digits_dataset, tmp_path)
    (dataset / "val.parquet").unlink()
    shutil.copy(dataset / "train.parquet", dataset / "val.parquet")
    out = tmp_path / "soup.safetensors"
    proc = call_stage(
        "merge", "--gather", "results/trainings/independent/gather.json", "--method", "greedy_soup",
        "--val-split", dataset / "val.parquet", "--out-weights", out, "--out-json", tmp_path / "soup.json",
        cwd=merged_run,
    )  # fmt: skip
    assert_one_line(proc, "merge", "val.parquet is the dataset's train split", "not the val split")
    assert not out.exists()


def test_validation_while_training_refuses_a_validation_split_that_is_not_the_one_prepare_recorded(
    digits_dataset, tmp_path
):
    dataset = dataset_copy(digits_dataset, tmp_path)
    edit_json(dataset / "dataset.json", lambda info: info["sha256"].update(val="0" * 64))
    with pytest.raises(UserError) as error:
        Validator(dataset, None, 64, torch.device("cpu"))
    assert "but " in str(error.value) and "records" in str(error.value)
    assert f"rows and 000000000000… for the val split; {RERUN_PREPARE}" in str(error.value)
    Validator(digits_dataset, None, 64, torch.device("cpu"))  # the split prepare wrote


# ---------------------------------------------------------------- shard sets against their records


def shards_copy(digits_shards: Path, tmp_path: Path) -> Path:
    return Path(shutil.copytree(digits_shards, tmp_path / "shards"))


def launch(shard_dir: Path, dataset: Path, tmp_path: Path):
    """The launcher as the train rule runs it; it reads the manifest before it starts any rank."""
    return call_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", tmp_path / "train", "--", "--run-name", "r",
        "--shard-dir", shard_dir, "--dataset-dir", dataset, "--config-json", "{}",
    )  # fmt: skip


def test_training_refuses_a_manifest_whose_row_counts_were_edited(digits_data, tmp_path):
    dataset, shards = digits_data
    shard_dir = shards_copy(shards, tmp_path)
    manifest = read_manifest(shard_dir)
    counts = [shard["rows"] for shard in manifest["shards"]]
    edit_json(shard_dir / "manifest.json", lambda m: m["shards"][1].update(rows=10))
    proc = launch(shard_dir, dataset, tmp_path)
    assert_one_line(
        proc, "launch", f"lists shards of {counts[0]}+10 = {counts[0] + 10} rows but records total_rows "
        f"{sum(counts)} and dropped_rows 0 of its source's {sum(counts)}; {RERUN_PARTITION}",
    )  # fmt: skip
    assert not (tmp_path / "train").exists()
    # Edited to add up: the shard's own footer tells (each rank checks its own before building anything).
    added_up = {"total_rows": counts[0] + 10, "dropped_rows": counts[1] - 10}
    edit_json(shard_dir / "manifest.json", lambda m: m.update(added_up))
    info = read_dataset_info(dataset)
    with pytest.raises(UserError) as error:
        check_shard_set(shard_dir, read_manifest(shard_dir), dataset, info, 1)
    assert str(error.value) == (
        f"shard of rank 1 ({shard_dir / 'shard-1.parquet'}) has {counts[1]} rows but the shard manifest "
        f"{shard_dir / 'manifest.json'} records 10; {RERUN_PARTITION}"
    )
    check_shard_set(shards, read_manifest(shards), dataset, info, 1)  # the intact set


def test_training_refuses_a_shard_copied_over_another(digits_dataset, tmp_path):
    # Equal shards (--drop-remainder), so the rows still add up: only the duplicate tells.
    proc = call_stage(
        "partition", "--input", digits_dataset / "train.parquet", "--world-size", 2, "--seed", 0,
        "--drop-remainder", "--out-dir", tmp_path / "shards",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    shard_dir = tmp_path / "shards"
    shutil.copy(shard_dir / "shard-0.parquet", shard_dir / "shard-1.parquet")
    first = read_manifest(shard_dir)["shards"][0]
    edit_json(
        shard_dir / "manifest.json",
        lambda m: m["shards"][1].update({key: first[key] for key in ("rows", "sha256", "bytes")}),
    )
    proc = launch(shard_dir, digits_dataset, tmp_path)
    assert_one_line(
        proc, "launch", "lists the same sha256 for the shards of ranks 0 and 1 (one shard copied over "
        f"another); {RERUN_PARTITION}",
    )  # fmt: skip
    edit_json(shard_dir / "manifest.json", lambda m: m["shards"][1].update(rows=True))
    with pytest.raises(UserError, match="has a row count that is not an integer; re-run the partition"):
        read_manifest(shard_dir)


def test_training_refuses_shards_of_another_dataset(digits_data, tmp_path):
    dataset, shards = digits_data
    dataset = dataset_copy(dataset, tmp_path)
    # a dataset.json of an older prepare (no info_sha256): the shard set's own check still catches it
    edit_json(
        dataset / "dataset.json",
        lambda info: (info.pop("info_sha256"), info["sha256"].update(train="f" * 64)),
    )
    manifest = read_manifest(shards)
    with pytest.raises(UserError) as error:
        check_shard_set(shards, manifest, dataset, read_dataset_info(dataset), 0)
    assert (
        f"partitions {manifest['source']['rows']} rows with sha256 {manifest['source']['sha256'][:12]}… but "
        f"{dataset / 'dataset.json'} records {manifest['source']['rows']} rows and ffffffffffff… for the "
        f"train split: the shards are not of this dataset; {RERUN_PARTITION}"
    ) in str(error.value)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (
            {"num_classes": 20},
            f"records num_classes 20 but its label_names lists 10 classes; {RERUN_PREPARE}",
        ),
        (
            {"num_classes": 5, "label_names": ["0", "1", "2", "3", "4"]},
            f"records num_classes 5 but the shards hold labels 0..9; {RERUN_PREPARE}",
        ),
        (
            {"num_features": 32},
            "records num_features 32 but the shard of rank 0 (…) holds 64 input values per row; "
            f"{RERUN_PREPARE}",
        ),
    ],
)
def test_training_refuses_dataset_claims_the_data_contradicts(digits_data, tmp_path, change, fragment):
    dataset, shards = digits_data
    dataset = dataset_copy(dataset, tmp_path)
    # a dataset.json of an older prepare (no info_sha256, whose digest refuses any edit first)
    edit_json(dataset / "dataset.json", lambda info: (info.pop("info_sha256"), info.update(change)))
    with pytest.raises(UserError) as error:
        check_shard_set(shards, read_manifest(shards), dataset, read_dataset_info(dataset), 0)
    message = str(error.value)
    assert message.startswith(str(dataset / "dataset.json"))
    for piece in fragment.split("…"):
        assert piece in message, (piece, message)


def test_training_on_an_edited_num_classes_fails_before_the_first_step(digits_data, tmp_path):
    """The check is the rank's, in set-up: a real 2-rank launch fails before anything is written."""
    dataset, shards = digits_data
    dataset = dataset_copy(dataset, tmp_path)
    edit_json(dataset / "dataset.json", lambda info: info.update(num_classes=20))
    proc = run_stage(
        "launch", "--nproc-per-node", 2, "--out-dir", tmp_path / "train", "--", "--run-name", "r",
        "--shard-dir", shards, "--dataset-dir", dataset, "--config-json", json.dumps({"epochs": 1}),
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "dataset.json was edited after prepare wrote it (its fields no longer match its info_sha256" in (
        proc.stderr
    )
    assert proc.stderr.strip().splitlines()[-1].startswith("shardfuse.launch: error: training failed")
    assert not (tmp_path / "train").exists()
    assert not (staging_dir(tmp_path / "train") / "base.safetensors").exists()


# ---------------------------------------------------------------- the base checkpoint at gather


def gather(ranks: Path, tmp_path: Path):
    return call_stage("gather", "--train-dir", ranks, "--world-size", 2, "--out", tmp_path / "gather.json")


@pytest.fixture()
def ranks_copy(small_trainings, tmp_path) -> Path:
    return Path(shutil.copytree(small_trainings / "results/trainings/independent/ranks", tmp_path / "ranks"))


def test_gather_refuses_a_base_of_another_training(small_trainings, ranks_copy, tmp_path):
    other = small_trainings / "results/trainings/localsgd/ranks"
    for name in ("base.safetensors", "base.json"):  # its sidecar with it: the header still tells
        shutil.copy(other / name, ranks_copy / name)
    line = assert_one_line(
        gather(ranks_copy, tmp_path), "gather",
        f"base checkpoint {ranks_copy / 'base.safetensors'} is the base of training 'localsgd', not the base "
        f"of 'independent' (train.json): it was replaced after training; {RERUN_TRAIN}",
    )  # fmt: skip
    assert "-R gather" not in line  # re-running gather would accept the same base again
    assert not (tmp_path / "gather.json").exists()


def test_gather_refuses_a_base_whose_bytes_or_initial_weights_differ(ranks_copy, tmp_path):
    base = ranks_copy / "base.safetensors"
    tensors, metadata = load_weights(base)
    recorded = json.loads(base.with_suffix(".json").read_text())["sha256"]
    changed = {name: tensor + 1 if tensor.is_floating_point() else tensor for name, tensor in tensors.items()}
    save_weights(base, changed, metadata, sidecar=False)  # same header, other weights, old sidecar
    assert_one_line(
        gather(ranks_copy, tmp_path), "gather",
        f"base checkpoint {base} has sha256 {sha256_file(base)[:12]}… but {base.with_suffix('.json')} "
        f"records {recorded[:12]}… (the file changed after training); {RERUN_TRAIN}",
    )  # fmt: skip
    # Sidecar rewritten too: the initial state the ranks' headers record still tells.
    started = read_metadata(ranks_copy / "rank-0.safetensors")["init_sha256"]
    save_weights(base, changed, {**metadata, "init_sha256": "0" * 64})
    assert_one_line(
        gather(ranks_copy, tmp_path), "gather",
        f"base checkpoint {base} holds initial weights 000000000000… but rank 0 started from {started[:12]}… "
        f"(init_sha256 in their headers): it is not this training's base; {RERUN_TRAIN}",
    )  # fmt: skip
    assert not (tmp_path / "gather.json").exists()


# ---------------------------------------------------------------- edited manifest.json and dataset.json


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        (lambda m: m["shards"][0].update(path=5), "has a malformed shards[0].path (5)"),
        (lambda m: m["shards"][1].update(path="../shard-1.parquet"), "malformed shards[1].path"),
        (lambda m: m["shards"][0].update(bytes="38387"), 'malformed shards[0].bytes ("38387")'),
        (lambda m: m["shards"][1].update(label_counts=[1, 2]), "malformed shards[1].label_counts ([1, 2])"),
        (
            lambda m: m["shards"][0]["column_moments"]["x0"].update(sum="1"),
            "malformed shards[0].column_moments",
        ),
    ],
)
def test_a_rank_refuses_an_edited_manifest_in_one_line(digits_shards, tmp_path, change, fragment):
    """Edits that reached the ranks as TypeError, AttributeError or a NumPy error: each is now the
    manifest's one line (read_manifest, which the launcher and every rank call before anything else)."""
    shard_dir = shards_copy(digits_shards, tmp_path)
    edit_json(shard_dir / "manifest.json", change)
    with pytest.raises(UserError) as error:
        read_manifest(shard_dir)
    assert str(error.value).startswith(f"shard manifest {shard_dir / 'manifest.json'} ")
    assert fragment in str(error.value) and str(error.value).endswith(RERUN_PARTITION)


@pytest.mark.parametrize(
    ("change", "fragment"),
    [
        ({"num_classes": 10.0}, "'num_classes' is a number 10.0, not int"),
        ({"num_features": [64]}, "'num_features' is a list [64], not int"),
        ({"num_features": -1}, "'num_features' is -1, not a positive count of input values"),
        ({"num_features": None}, "'num_features' is null"),
        ({"input": "numeric"}, "'input' is a string \"numeric\", not dict"),
        ({"input": {"kind": "numeric", "shape": "64"}}, "'input' has shape '64', not a list of positive"),
        ({"task": "ranking"}, "'task' is 'ranking', not one of classification, regression, causal_lm"),
        ({"task": "regression"}, "task regression needs target_names"),
        ({"feature_names": 64}, "'feature_names' is a number 64, not list"),
    ],
)
def test_a_rank_refuses_an_edited_dataset_json_in_one_line(digits_dataset, tmp_path, change, fragment):
    """Edits that reached the ranks as TypeError, KeyError or AttributeError (building the model spec)."""
    dataset = dataset_copy(digits_dataset, tmp_path)
    edit_json(dataset / "dataset.json", lambda info: info.update(change))
    with pytest.raises(UserError) as error:
        read_dataset_info(dataset)
    assert str(error.value).startswith(f"dataset info {dataset / 'dataset.json'}: {fragment}")
    assert str(error.value).endswith(f"; {RERUN_PREPARE}")
    read_dataset_info(digits_dataset)  # the intact file
