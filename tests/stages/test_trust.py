"""Trust nothing we did not write: merge, evaluate and track refuse a tampered gather.json or header.

One real training (two torchrun ranks on digits), gathered, merged and evaluated by the real stages;
each test copies it, tampers with one thing, and runs a stage's command line as the workflow does (in
the working directory, relative paths): exit status 2, one line naming the file and the stage to re-run,
no traceback, no output. Every stage runs under an address-space limit, so a check that regressed fails
on allocation instead of taking the machine's memory.
"""

from __future__ import annotations

import json
import os
import resource
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from shardfuse.checkpoints.weights import load_weights, save_weights
from shardfuse.io import UserError, file_digests, sha256_file
from shardfuse.models.bounds import check_spec_bounds
from shardfuse.models.catalog import mlp_state_shapes
from shardfuse.models.registry import build_model, check_model_fits
from shardfuse.models.spec import normalized_spec
from shardfuse.track.inputs import load_inputs
from tests.support.helpers import call_stage, subprocess_env

TRAINING, RUN = "independent", "r0"  # the session's small independent training
TRAINING_DIR = f"results/trainings/{TRAINING}"
RANKS = f"{TRAINING_DIR}/ranks"
GATHER = f"{TRAINING_DIR}/gather.json"
RUN_DIR = f"results/runs/{RUN}"
MERGED = f"{RUN_DIR}/merged.safetensors"
STALE = "gather.json was edited or is stale: re-run gather (snakemake -R gather)"
MEMORY_LIMIT = 6 << 30  # bytes of address space: torch and the stage need about 2 GiB


def _limit_memory() -> None:
    resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))


def stage(cwd: Path, name: str, *args: object) -> subprocess.CompletedProcess:
    """``python -m shardfuse.<name> ARGS`` in ``cwd`` under the address-space limit."""
    return subprocess.run(
        [sys.executable, "-m", f"shardfuse.{name}", *map(str, args)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
        preexec_fn=_limit_memory,
    )


def in_process(cwd: Path, name: str, *args: object) -> subprocess.CompletedProcess:
    """The stage's command line called in this process (tests/support/helpers.py call_stage): for the
    refusals that happen before any tensor is read, where no allocation can run away."""
    return call_stage(name, *args, cwd=cwd)


def merge_args(method: str = "ties") -> list[object]:
    params = '{"density": 0.5}' if method == "ties" else "{}"
    return ["--gather", GATHER, "--method", method, "--params-json", params, "--run", "again"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory, small_trainings, digits_dataset) -> Path:
    """A working directory holding a real training (the session's), its gather.json, and run RUN merged and
    evaluated."""
    root = tmp_path_factory.mktemp("trusted")
    shutil.copytree(small_trainings / "results" / "trainings" / TRAINING, root / TRAINING_DIR)
    for name, *args in (
        ("merge", *merge_args()[:-2], "--run", RUN, "--out-weights", MERGED, "--out-json",
         f"{RUN_DIR}/merge.json"),
        ("evaluate", "--run", RUN, "--test", digits_dataset / "test.parquet", "--gather", GATHER,
         "--merged", MERGED, "--out", f"{RUN_DIR}/eval.json"),
    ):  # fmt: skip
        proc = stage(root, name, *args)
        assert proc.returncode == 0, proc.stderr[-3000:]
    # Paths stay relative, as the workflow writes them: a copy of results/ is a working training.
    assert json.loads((root / GATHER).read_text())["ranks"][1]["path"] == f"{RANKS}/rank-1.safetensors"
    return root


@pytest.fixture()
def workdir(trained, tmp_path) -> Path:
    shutil.copytree(trained / "results", tmp_path / "results", symlinks=True)
    return tmp_path


def run_stage_in(
    workdir: Path, which: str, digits_dataset: Path, runner=None
) -> tuple[subprocess.CompletedProcess, list]:
    """Run merge (ties, which reads the base) or evaluate, as a command (``runner``: default a child
    process under the memory limit); (its result, the outputs it must not leave)."""
    stage_runner = runner or stage
    if which == "merge":
        outputs = [
            workdir / "results/runs/again/merged.safetensors",
            workdir / "results/runs/again/merge.json",
        ]
        proc = stage_runner(
            workdir, "merge", *merge_args(), "--out-weights", outputs[0], "--out-json", outputs[1]
        )
    else:
        outputs = [workdir / RUN_DIR / "eval-again.json"]
        proc = stage_runner(
            workdir, "evaluate", "--run", RUN, "--test", digits_dataset / "test.parquet",
            "--gather", GATHER, "--merged", MERGED, "--out", outputs[0],
        )  # fmt: skip
    return proc, outputs


def assert_refused(
    proc: subprocess.CompletedProcess, which: str, fragments: tuple[str, ...], outputs
) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"shardfuse.{which}: error: "), lines[0]
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    assert "delete" not in lines[0]
    for output in outputs:
        assert not output.exists(), output
        assert not list(output.parent.glob(f".{output.name}*")), output


# ---------------------------------------------------------------- tampering with gather.json


def edit_gather(workdir: Path, change) -> None:
    path = workdir / GATHER
    info = json.loads(path.read_text())
    change(info)
    path.write_text(json.dumps(info, indent=2))


def point(info: dict, rank: int, workdir: Path, path: str) -> None:
    """Rank ``rank`` of gather.json now names ``path``, with its checksums and size recomputed to match."""
    info["ranks"][rank].update(
        path=path, **file_digests(workdir / path), bytes=(workdir / path).stat().st_size
    )


def swapped_ranks(workdir: Path) -> None:
    def change(info):
        point(info, 0, workdir, f"{RANKS}/rank-1.safetensors")
        point(info, 1, workdir, f"{RANKS}/rank-0.safetensors")

    edit_gather(workdir, change)


def same_file_twice(workdir: Path) -> None:
    edit_gather(workdir, lambda info: point(info, 1, workdir, f"{RANKS}/rank-0.safetensors"))


def copy_outside(workdir: Path) -> None:
    (workdir / "elsewhere").mkdir()
    shutil.copy2(workdir / RANKS / "rank-1.safetensors", workdir / "elsewhere" / "rank-1.safetensors")
    edit_gather(workdir, lambda info: point(info, 1, workdir, "elsewhere/rank-1.safetensors"))


def link_to_outside(workdir: Path) -> None:
    """gather.json untouched; the rank file itself became a link to a copy outside the training."""
    rank_file = workdir / RANKS / "rank-1.safetensors"
    (workdir / "elsewhere").mkdir()
    rank_file.rename(workdir / "elsewhere" / "rank-1.safetensors")
    rank_file.symlink_to(workdir / "elsewhere" / "rank-1.safetensors")


def another_training(workdir: Path) -> None:
    """rank-1.safetensors replaced by the same tensors under another training's name."""
    path = workdir / RANKS / "rank-1.safetensors"
    tensors, metadata = load_weights(path)
    save_weights(path, tensors, {**metadata, "run": "another-training"})
    edit_gather(workdir, lambda info: point(info, 1, workdir, f"{RANKS}/rank-1.safetensors"))


def etc_passwd(workdir: Path) -> None:
    edit_gather(workdir, lambda info: point(info, 1, workdir, "/etc/passwd"))


def not_safetensors(workdir: Path) -> None:
    edit_gather(workdir, lambda info: point(info, 1, workdir, f"{RANKS}/train.json"))


def rank_listed_twice(workdir: Path) -> None:
    edit_gather(workdir, lambda info: info["ranks"][0].update(rank=1))


def no_base(workdir: Path) -> None:
    edit_gather(workdir, lambda info: info.pop("base"))


def null_base(workdir: Path) -> None:
    edit_gather(workdir, lambda info: info.update(base=None))


TAMPERINGS = {
    "swapped_ranks": (
        swapped_ranks,
        ("rank 0 in ", "/gather.json points at ", "/rank-1.safetensors, whose header says rank 1; "),
    ),
    "same_file_twice": (
        same_file_twice,
        ("rank 1 in ", "/rank-0.safetensors, the file rank 0 points at too; "),
    ),
    "copy_outside": (
        copy_outside,
        (
            "rank 1 in ",
            " points at elsewhere/rank-1.safetensors, which lies outside the training directory "
            "results/trainings/independent: it is not a checkpoint of this training; ",
        ),
    ),
    "link_to_outside": (
        link_to_outside,
        (
            "/rank-1.safetensors (a link to ",
            "/elsewhere/rank-1.safetensors), which lies outside the training",
        ),
    ),
    "another_training": (
        another_training,
        (
            "rank 1 in ",
            "/rank-1.safetensors, whose header says training 'another-training', not 'independent'; ",
        ),
    ),
    "etc_passwd": (
        etc_passwd,
        ("rank 1 in ", " points at /etc/passwd, which lies outside the training directory"),
    ),
    "not_safetensors": (not_safetensors, ("/ranks/train.json, which is not a safetensors checkpoint (",)),
    "rank_listed_twice": (rank_listed_twice, ("/gather.json lists rank 1 twice; ",)),
    "no_base": (no_base, ("/gather.json names no base checkpoint ('base' is missing, null or empty); ",)),
    "null_base": (null_base, ("/gather.json names no base checkpoint ('base' is missing, null or empty); ",)),
}


@pytest.mark.parametrize("which", ["merge", "evaluate"])
@pytest.mark.parametrize("tampering", list(TAMPERINGS))
def test_a_tampered_gather_json_is_refused_naming_the_file_and_gather(
    workdir, digits_dataset, tampering, which
):
    tamper, fragments = TAMPERINGS[tampering]
    tamper(workdir)
    proc, outputs = run_stage_in(workdir, which, digits_dataset, runner=in_process)
    assert_refused(proc, which, (*fragments, STALE), outputs)


def tracking_args(workdir: Path, digits_shards: Path) -> list[object]:
    return [
        "--run", RUN, "--run-dir", RUN_DIR, "--train-dir", RANKS, "--gather", GATHER,
        "--manifest", digits_shards / "manifest.json",
        "--config-json", json.dumps({"run": RUN, "dataset": "d"}),
        "--tracking-uri", f"sqlite:///{workdir / 'mlflow.db'}", "--out", f"{RUN_DIR}/mlflow.json",
    ]  # fmt: skip


def test_track_refuses_a_gather_json_pointing_outside_the_training(workdir, digits_shards):
    copy_outside(workdir)
    proc = stage(workdir, "tracking", *tracking_args(workdir, digits_shards))
    fragments = ("rank 1 in ", "which lies outside the training directory ", STALE)
    assert_refused(proc, "tracking", fragments, [workdir / RUN_DIR / "mlflow.json", workdir / "mlflow.db"])


def test_an_untampered_training_passes_every_check(trained, digits_shards):
    """The real layout (relative paths, the ranks under the training directory) is trusted, and
    load_inputs, the track stage's reader, accepts it too."""
    assert (trained / RUN_DIR / "eval.json").is_file()
    cwd = Path.cwd()
    os.chdir(trained)
    try:
        inputs = load_inputs(
            Path(RUN_DIR), digits_shards / "manifest.json", train_dir=Path(RANKS), gather_path=Path(GATHER)
        )
    finally:
        os.chdir(cwd)
    assert inputs.world_size == 2 and inputs.model_spec["model"] == "mlp"


# ---------------------------------------------------------------- model specs against the tensors


def huge_spec(spec: dict) -> dict:
    """The spec with hidden_sizes [2e9]: 128 billion weights for a file of a few kilobytes."""
    return {**spec, "args": {**spec["args"], "hidden_sizes": [2e9]}}


def rewrite_header(path: Path, sidecar: bool) -> None:
    tensors, metadata = load_weights(path)
    save_weights(path, tensors, {**metadata, "model": huge_spec(metadata["model"])}, sidecar=sidecar)


SPEC_IN_THE_FILE = (
    "the model spec in the header of ",
    " values) does not fit the tensors in the file (",
    "tensor 'net.0.weight' is [2000000000, 64] in the model, [16, 64] in the file; ",
)


def test_a_base_header_describing_a_huge_model_is_refused_before_allocation(workdir, digits_dataset):
    rewrite_header(workdir / RANKS / "base.safetensors", sidecar=True)
    proc, outputs = run_stage_in(workdir, "evaluate", digits_dataset)
    fragments = (*SPEC_IN_THE_FILE, "/base.safetensors (mlp, ", "re-run training (snakemake -R train)")
    assert_refused(proc, "evaluate", fragments, outputs)


def test_a_merged_header_describing_a_huge_model_is_refused_by_evaluate_and_track(
    workdir, digits_dataset, digits_shards
):
    rewrite_header(workdir / MERGED, sidecar=False)
    # As a merge stage that wrote such a header would record it (an edited file is refused by its digest).
    record = json.loads((workdir / RUN_DIR / "merge.json").read_text())
    record["sha256"] = sha256_file(workdir / MERGED)
    (workdir / RUN_DIR / "merge.json").write_text(json.dumps(record))
    fragments = (*SPEC_IN_THE_FILE, "/merged.safetensors (mlp, ", "re-run merge (snakemake -R merge)")
    proc, outputs = run_stage_in(workdir, "evaluate", digits_dataset)
    assert_refused(proc, "evaluate", fragments, outputs)
    proc = stage(workdir, "tracking", *tracking_args(workdir, digits_shards))
    assert_refused(proc, "tracking", fragments, [workdir / RUN_DIR / "mlflow.json", workdir / "mlflow.db"])


def test_greedy_soup_refuses_a_gather_json_model_larger_than_its_tensors(workdir, digits_dataset):
    edit_gather(workdir, lambda info: info.update(model=huge_spec(info["model"])))
    out = workdir / "results/runs/again/merged.safetensors"
    proc = stage(
        workdir, *["merge", *merge_args("greedy_soup")], "--val-split", digits_dataset / "val.parquet",
        "--out-weights", out, "--out-json", out.with_suffix(".json"),
    )  # fmt: skip
    fragments = ("the model spec in ", "/gather.json (mlp, ", "[2000000000, 64] in the model", STALE)
    assert_refused(proc, "merge", fragments, [out, out.with_suffix(".json")])


def test_evaluate_refuses_a_merged_model_of_another_training(workdir, digits_dataset):
    path = workdir / MERGED
    tensors, metadata = load_weights(path)
    save_weights(path, tensors, {**metadata, "run": "another-training"}, sidecar=False)
    proc, outputs = run_stage_in(workdir, "evaluate", digits_dataset)
    fragments = (
        "/merged.safetensors is not a merge of training 'independent' (its header says training "
        "'another-training', rank None); re-run merge (snakemake -R merge)",
    )
    assert_refused(proc, "evaluate", fragments, outputs)


def test_evaluate_refuses_another_runs_merged_model_copied_over_this_ones(workdir, digits_dataset):
    """Two runs of one training, both ties (density 0.5 and 0.2): the other run's merged model copied over
    this one's has the right header (the same training, the same method), so only merge.json's sha256
    tells them apart."""
    other = workdir / "results/runs/other"
    proc = stage(
        workdir, "merge", "--gather", GATHER, "--method", "ties", "--params-json", '{"density": 0.2}',
        "--run", "other", "--out-weights", other / "merged.safetensors", "--out-json", other / "merge.json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    shutil.copy(other / "merged.safetensors", workdir / MERGED)
    proc, outputs = run_stage_in(workdir, "evaluate", digits_dataset)
    assert_refused(proc, "evaluate", ("/merged.safetensors is not the merged model its ",), outputs)
    assert "another run's merged model, or an edited file); re-run merge (snakemake -R merge)" in proc.stderr


def test_evaluate_refuses_a_merge_json_edited_to_another_method(workdir, digits_dataset):
    record = json.loads((workdir / RUN_DIR / "merge.json").read_text())
    (workdir / RUN_DIR / "merge.json").write_text(json.dumps({**record, "method": "uniform"}))
    proc, outputs = run_stage_in(workdir, "evaluate", digits_dataset)
    assert_refused(proc, "evaluate", ("/merge.json says method 'uniform' but ",), outputs)
    assert "was merged with 'ties' (one of them was edited or copied from another run)" in proc.stderr


def test_evaluate_and_merge_refuse_the_splits_of_another_prepared_dataset(workdir, tmp_path):
    """digits prepared again with seed 1: a consistent dataset of its own (its splits match its
    dataset.json), but most of its test rows are the training's train rows; gather.json ties the run to
    the train split its shards were cut from."""
    from shardfuse.prepare import prepare

    other = tmp_path / "other-digits"
    prepare("digits", {"source": "digits", "test_fraction": 0.2, "seed": 1}, other)
    assert json.loads((workdir / GATHER).read_text())["dataset_sha256"]  # recorded by gather
    proc, outputs = run_stage_in(workdir, "evaluate", other.parent / "other-digits")
    assert_refused(
        proc, "evaluate", ("test split ", "/other-digits/test.parquet belongs to another "), outputs
    )
    assert "pass the test.parquet of the dataset the run trained on" in proc.stderr
    out = workdir / "results/runs/again/merged.safetensors"
    proc = stage(
        workdir, *["merge", *merge_args("greedy_soup")], "--val-split", other / "val.parquet",
        "--out-weights", out, "--out-json", out.with_suffix(".json"),
    )  # fmt: skip
    assert_refused(proc, "merge", ("val split ", "belongs to another prepared dataset"), [out])


# ---------------------------------------------------------------- the checks themselves (no stage run)

MLP_SPECS = [
    {"type": "mlp", "num_features": 4, "num_classes": 3, "hidden_sizes": [5, 7], "activation": "relu",
     "dropout": 0.0},
    {"type": "mlp", "num_features": 4, "num_classes": 3, "hidden_sizes": [], "activation": "relu",
     "dropout": 0.3},
    {"model": "mlp", "args": {"hidden_sizes": [6], "dropout": 0.2}, "task": "regression", "code": None,
     "description": {"task": "regression", "num_features": 3, "num_outputs": 2, "feature_names": [],
                     "label_names": []}},
    {"model": "mlp", "args": {}, "task": "classification", "code": None,
     "description": {"task": "classification", "num_features": 5, "num_outputs": 4, "feature_names": [],
                     "label_names": [], "num_classes": 4}},
]  # fmt: skip


@pytest.mark.parametrize("spec", MLP_SPECS)
def test_the_torch_free_mlp_layout_is_the_built_mlp_state_dict(spec):
    built = {name: tuple(t.shape) for name, t in build_model(spec).state_dict().items()}
    assert mlp_state_shapes(normalized_spec(spec)) == built
    check_model_fits("a test", spec, built, "re-run it")


def test_built_in_size_arguments_beyond_the_file_are_refused_without_building():
    """A transformer with a billion layers is refused by the torch-free bound (a meta-device build
    would take hours); a cnn channel count likewise."""
    held = {"token_embedding.weight": (50, 8), "position_embedding.weight": (16, 8)}
    description = {"task": "causal_lm", "num_features": 16, "num_outputs": 50, "feature_names": [],
                   "label_names": [], "vocab_size": 50, "block_size": 16, "input_kind": "tokens"}  # fmt: skip
    spec = {"model": "transformer", "args": {"width": 8, "layers": 10**9}, "task": "causal_lm",
            "description": description, "code": None}  # fmt: skip
    with pytest.raises(UserError, match=r"model_args.layers is 1000000000, more than the 528 values"):
        check_spec_bounds("the header of x.safetensors", spec, held, "re-run training")
    cnn = {**spec, "model": "cnn", "args": {"channels": [4] * 20}}
    with pytest.raises(
        UserError, match=r"model_args.channels has 20 entries, more than the file's 2 tensors"
    ):
        check_spec_bounds("the header of x.safetensors", cnn, held, "re-run training")
    small = {**spec, "args": {"width": 8, "layers": 1, "heads": 2}}
    with pytest.raises(UserError, match=r"the model has a tensor 'blocks.0"):
        check_model_fits("the header of x.safetensors", small, held, "re-run training")
    assert torch.get_default_device().type == "cpu"  # the meta-device build left the default alone


def test_a_user_model_that_cannot_build_on_the_meta_device_is_left_to_the_real_build(monkeypatch):
    """A factory that needs real tensors to build fails on the meta device: that is no verdict on the
    spec, so the check steps aside (the real build's strict load still refuses a mismatch)."""
    from shardfuse.models import registry as models

    def needs_data(spec):
        if torch.empty(0).device.type == "meta":
            raise RuntimeError("Tensor.item() cannot be called on meta tensors")
        raise AssertionError("built for real")

    monkeypatch.setattr(models, "build_model", needs_data)
    spec = {**MLP_SPECS[3], "model": "usernets:build"}
    assert check_model_fits("the header of x.safetensors", spec, {"w": (2, 2)}, "re-run training") is None
