"""The catalogue of bad input (docs/errors.md): each case is one clear line, exit status 2, no output.

Every case runs the stage's command as a user would. The fragment asserted here is also the one the
docs table shows, so the table cannot drift from what users see.
"""

from __future__ import annotations

import importlib
import json
import os
import pickle
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from shardfuse.console.errors import run_cli
from tests.support.data import write_grouped_rows
from tests.support.helpers import REPO, run_stage, snakemake_command, write_train_dir

DOCS = REPO / "docs" / "errors.md"


@dataclass
class Case:
    stage: str
    args: list
    fragment: str
    out: Path | None = None  # must not exist afterwards


def base_config(**run) -> dict:
    return {"runs": {"r": run}, "datasets": {"d": {"source": "digits"}}, "run_defaults": {"dataset": "d"}}


def config_case(tmp: Path, config: dict, fragment: str) -> Case:
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return Case("config", ["--configfile", path], fragment)


def table(tmp: Path, name: str, columns: dict) -> Path:
    path = tmp / name
    pq.write_table(pa.table(columns), path)
    return path


def prepare_case(tmp: Path, spec: dict, fragment: str) -> Case:
    return Case(
        "prepare",
        ["--name", "x", "--spec-json", json.dumps(spec), "--out-dir", tmp / "out"],
        fragment,
        tmp / "out",
    )


def user_file(tmp: Path, columns: dict, fragment: str, **spec) -> Case:
    path = table(tmp, "data.parquet", columns)
    full = {
        "source": "parquet",
        "path": str(path),
        "feature_columns": ["a", "b"],
        "label_column": "y",
        **spec,
    }
    return prepare_case(tmp, full, fragment)


def train_dir(tmp: Path, ranks: int = 2, shapes: dict | None = None) -> Path:
    """A train directory as training writes it, with hand-made rank checkpoints (the last rank's
    tensors replaced by ``shapes``)."""
    tensors = {"net.0.weight": torch.zeros(3, 4), "net.0.bias": torch.zeros(3)}
    last = {**tensors, **(shapes or {})}
    return write_train_dir(tmp / "ranks", tensors, ranks, lambda rank: last if rank == ranks - 1 else tensors)


def gather_case(tmp: Path, out_dir: Path, fragment: str, world_size: int = 2) -> Case:
    return Case(
        "gather",
        ["--train-dir", out_dir, "--world-size", world_size, "--out", tmp / "gather.json"],
        fragment,
        tmp / "gather.json",
    )


class Evil:
    """Unpickling this creates a file: proof that a checkpoint was (not) unpickled."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (Path.write_text, (self.marker, "unpickled"))


def case_unknown_config_key(tmp):
    return config_case(tmp, base_config(epoch=3), "unknown key 'epoch' (did you mean 'epochs'?)")


def case_wrong_type(tmp):
    return config_case(
        tmp, base_config(world_size="two"), "runs[r].world_size: 'two' is not of type 'integer'"
    )


def case_zero_batch_size(tmp):
    return config_case(tmp, base_config(batch_size=0), "runs[r].batch_size: 0 is less than the minimum of 1")


def case_negative_lr(tmp):
    return config_case(
        tmp, base_config(lr=-0.1), "runs[r].lr: -0.1 is less than or equal to the minimum of 0"
    )


def case_geometry_mismatch(tmp):
    return config_case(
        tmp,
        base_config(world_size=2, nodes=2, nproc_per_node=2),
        "nodes x nproc_per_node = 2 x 2 = 4 but world_size (the number of shards) is 2",
    )


@pytest.fixture
def unsafe_name(request):
    return request.param


def case_run_name_dotdot(tmp):
    config = base_config()
    config["runs"] = {"../x": {}}
    return config_case(tmp, config, "run name '../x' is not allowed")


def case_run_name_space(tmp):
    config = base_config()
    config["runs"] = {"my run": {}}
    return config_case(tmp, config, "run name 'my run' is not allowed")


def case_run_name_slash(tmp):
    config = base_config()
    config["runs"] = {"a/b": {}}
    return config_case(tmp, config, "run name 'a/b' is not allowed")


def case_duplicate_run_names(tmp):
    runs = tmp / "runs.tsv"
    runs.write_text("run\tlr\nr\t0.1\nr\t0.2\n")
    config = base_config()
    config["runs"] = str(runs)
    return config_case(tmp, config, "run 'r' appears twice")


def case_unknown_merge_method(tmp):
    return config_case(tmp, base_config(merge_method="soup"), "runs[r].merge_method: 'soup' is not one of")


def case_slerp_needs_two(tmp):
    return config_case(
        tmp,
        base_config(world_size=4, merge_method="slerp"),
        "runs[r].merge_method: slerp interpolates exactly 2 models but the run has 4 ranks",
    )


LORA = {"type": "lora", "r": 4}


def case_adapter_with_a_whole_weight_method(tmp):
    config = base_config(world_size=2, strategy="localsgd", merge_method="slerp", adapter=LORA)
    return config_case(tmp, config, "runs[r].merge_method: slerp cannot fuse LoRA adapters")


def case_adapter_with_alignment(tmp):
    config = base_config(
        strategy="localsgd", merge_method="uniform", merge_align="weight_matching", adapter=LORA
    )
    return config_case(tmp, config, "runs[r].merge_align: LoRA adapters are fused in update space")


def case_merge_adapter_cat_with_ties(tmp):
    config = base_config(strategy="localsgd", merge_method="ties", merge_adapter="cat", adapter=LORA)
    return config_case(tmp, config, "cat is exact only for the methods linear in the updates")


def case_merge_adapter_without_adapter(tmp):
    config = base_config(strategy="localsgd", merge_method="uniform", merge_adapter="svd")
    return config_case(tmp, config, "runs[r].merge_adapter: writes the fused LoRA update as an adapter, but")


def case_fsdp_not_dividing_world_size(tmp):
    config = base_config(strategy="ddp", merge_method="consolidate", world_size=4, fsdp=3)
    return config_case(tmp, config, "runs[r].fsdp: 3 shards per replica do not divide world_size 4")


def case_min_ranks_above_world_size(tmp):
    config = base_config(strategy="localsgd", merge_method="uniform", world_size=2, min_ranks=3)
    return config_case(tmp, config, "runs[r].min_ranks: min_ranks 3 must be from 1 to world_size 2")


def case_min_ranks_zero(tmp):
    config = base_config(strategy="localsgd", merge_method="uniform", world_size=2, min_ranks=0)
    return config_case(tmp, config, "runs[r].min_ranks: 0 is less than the minimum of 1")


def case_orphans_drop_with_ddp(tmp):
    config = base_config(strategy="ddp", merge_method="consolidate", world_size=3, min_ranks=2)
    return config_case(
        tmp, config, "runs[r].min_ranks: min_ranks 2 with strategy ddp and orphans drop: its ranks train one"
    )


def case_orphans_reshard_with_own_epoch_steps(tmp):
    config = base_config(
        strategy="localsgd", merge_method="uniform", world_size=2, min_ranks=1, orphans="reshard",
        epoch_steps="own",
    )  # fmt: skip
    return config_case(tmp, config, "runs[r].orphans: orphans: reshard deals each of the lost rank's micro")


def case_orphans_reshard_without_min_ranks(tmp):
    config = base_config(strategy="localsgd", merge_method="uniform", world_size=2, orphans="reshard")
    return config_case(tmp, config, "but min_ranks is the world size 2, so no rank may be lost")


def case_min_ranks_with_fsdp(tmp):
    config = base_config(strategy="localsgd", merge_method="uniform", world_size=4, fsdp=2, min_ranks=2)
    return config_case(tmp, config, "min_ranks 2 with fsdp 2: a replica that loses a rank loses that rank's")


def case_min_ranks_that_lets_no_node_go(tmp):
    config = base_config(
        strategy="localsgd", merge_method="uniform", world_size=4, nodes=2, nproc_per_node=2, min_ranks=3
    )
    return config_case(tmp, config, "min_ranks 3 with nodes 2: on several nodes the unit of loss is a node")


def case_fsdp_model_without_units(tmp):
    config = base_config(strategy="ddp", merge_method="consolidate", world_size=2, fsdp=2, model="cnn")
    return config_case(tmp, config, "fsdp 2 needs the model's wrap units, which the built-in cnn has not")


def case_greedy_soup_without_val(tmp):
    config = base_config(merge_method="greedy_soup")
    config["datasets"]["d"]["val_fraction"] = 0
    return config_case(tmp, config, "greedy_soup needs a validation split")


def case_diloco_without_sync_every(tmp):
    return config_case(
        tmp,
        base_config(strategy="diloco", merge_method="uniform"),
        "strategy diloco needs sync_every >= 1 (the inner steps between outer steps, e.g. 16)",
    )


def case_outer_lr_without_diloco(tmp):
    return config_case(
        tmp,
        base_config(strategy="localsgd", outer_lr=0.5),
        "outer_lr: only strategy diloco has an outer optimiser but strategy is localsgd",
    )


def case_ddp_setting_without_ddp(tmp):
    return config_case(
        tmp,
        base_config(strategy="localsgd", sync_every=4, static_graph=True, merge_method="uniform"),
        "static_graph: a DistributedDataParallel setting but strategy is localsgd",
    )


def case_hf_needs_pretrained_or_config(tmp):
    return config_case(
        tmp,
        base_config(model="hf"),
        "model hf needs exactly one of model_args.pretrained (a save_pretrained folder) and model_args",
    )


def case_hf_pretrained_not_a_folder(tmp):
    return config_case(
        tmp,
        base_config(model="hf", model_args={"pretrained": str(tmp / "nowhere")}),
        "is not a save_pretrained folder (no config.json); give a local folder written by save_pretrained",
    )


def case_model_file_missing(tmp):
    return config_case(
        tmp,
        base_config(model="mlp", model_files=[str(tmp / "weights.bin")]),
        "does not exist; fix `model_files` or model_args.pretrained",
    )


def case_hf_tokenizer_without_tokenizer_json(tmp):
    spec = {"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 8, "tokenizer": f"hf:{tmp}"}
    return prepare_case(
        tmp, spec, "tokenizer.json does not exist; point hf: at a save_pretrained folder with a fast"
    )


def case_per_rank_init_with_ddp(tmp):
    return config_case(
        tmp,
        base_config(init="per_rank"),
        "per_rank gives each rank its own initial weights but ddp starts every rank from rank 0's weights",
    )


def case_per_rank_init_with_init_from(tmp):
    config = base_config(strategy="localsgd", init="per_rank", init_from="run:base")
    config["runs"]["base"] = {}
    return config_case(tmp, config, "per_rank draws each rank's own initial weights but init_from gives")


def case_epoch_steps_own_with_ddp(tmp):
    return config_case(
        tmp,
        base_config(epoch_steps="own"),
        "runs[r].epoch_steps: own lets each rank take its own number of steps, but strategy ddp keeps the "
        "ranks in step; set strategy localsgd with sync_every 0, or epoch_steps min, max or mean",
    )


def case_epoch_steps_own_with_fsdp(tmp):
    config = base_config(epoch_steps="own", strategy="localsgd", merge_method="uniform", world_size=4, fsdp=2)
    return config_case(
        tmp, config, "runs[r].epoch_steps: own lets each rank take its own number of steps, but with fsdp 2"
    )


def case_betas_with_sgd(tmp):
    return config_case(
        tmp,
        base_config(betas=[0.9, 0.95]),
        "betas: betas is an AdamW setting but optimizer is sgd; remove betas or set optimizer adamw",
    )


def case_min_lr_above_lr(tmp):
    return config_case(
        tmp, base_config(lr_schedule="cosine", lr=0.01, min_lr=0.1), "min_lr 0.1 is above lr 0.01"
    )


def case_min_lr_with_constant_schedule(tmp):
    return config_case(
        tmp,
        base_config(min_lr=0.001),
        "only lr_schedule cosine or linear decays to min_lr but lr_schedule is constant",
    )


def case_keep_best_without_eval_every(tmp):
    return config_case(
        tmp, base_config(keep="best"), "keep best needs validation while training but eval_every is 0"
    )


def case_keep_best_without_val(tmp):
    config = base_config(keep="best", eval_every=10)
    config["datasets"]["d"]["val_fraction"] = 0
    return config_case(tmp, config, "keep best needs a validation split but dataset 'd' has val_fraction 0")


def case_patience_without_eval_every(tmp):
    return config_case(tmp, base_config(patience=3), "early stopping counts validations but eval_every is 0")


def case_eval_every_without_val(tmp):
    config = base_config(eval_every=10)
    config["datasets"]["d"]["val_fraction"] = 0
    return config_case(tmp, config, "validation while training needs a validation split")


def case_exponent_read_as_text(tmp):
    path = tmp / "config.yaml"
    path.write_text(
        "runs: {r: {optimizer: adamw, eps: 1e-8}}\ndatasets: {d: {source: digits}}\n"
        "run_defaults: {dataset: d}\n"
    )
    return Case("config", ["--configfile", path], "(YAML reads 1e-8 as text; write 1.0e-8)")


def case_missing_dataset_path(tmp):
    spec = {
        "source": "parquet",
        "path": str(tmp / "nope.parquet"),
        "feature_columns": ["a"],
        "label_column": "y",
    }
    return prepare_case(tmp, spec, "does not exist")


def case_missing_label_column(tmp):
    return user_file(tmp, {"a": [1.0] * 10, "b": [2.0] * 10, "z": [0, 1] * 5}, "column(s) 'y' not found")


def case_label_also_a_feature(tmp):
    return user_file(
        tmp,
        {"a": [1.0] * 10, "b": [2.0] * 10, "y": [0, 1] * 5},
        "must be a column name not among feature_columns",
        feature_columns=["a", "y"],
    )


def case_non_numeric_feature(tmp):
    return user_file(
        tmp,
        {"a": ["x"] * 10, "b": [2.0] * 10, "y": [0, 1] * 5},
        "not a number; list it in categorical_columns",
    )


def case_nan_in_features(tmp):
    return user_file(tmp, {"a": [float("nan")] + [1.0] * 9, "b": [2.0] * 10, "y": [0, 1] * 5}, "NaN")


def case_empty_dataset(tmp):
    return user_file(
        tmp,
        {"a": pa.array([], pa.float64()), "b": pa.array([], pa.float64()), "y": pa.array([], pa.int64())},
        "no rows",
    )


def case_fewer_rows_than_ranks(tmp):
    path = table(tmp, "train.parquet", {"x0": np.zeros(3, np.float32), "label": np.zeros(3, np.int64)})
    return Case(
        "partition",
        ["--input", path, "--world-size", 4, "--seed", 0, "--out-dir", tmp / "out"],
        "--world-size 4 exceeds the 3 rows",
        tmp / "out",
    )


def case_corrupt_parquet(tmp):
    path = tmp / "train.parquet"
    path.write_bytes(b"PAR1 this is not parquet")
    return Case(
        "partition",
        ["--input", path, "--world-size", 2, "--seed", 0, "--out-dir", tmp / "out"],
        "is not a readable Parquet file",
        tmp / "out",
    )


def case_missing_rank_checkpoint(tmp):
    out = train_dir(tmp)
    (out / "rank-1.safetensors").unlink()
    return gather_case(tmp, out, "rank 1: checkpoint")


def case_mismatched_shapes(tmp):
    return gather_case(
        tmp,
        train_dir(tmp, shapes={"net.0.bias": torch.zeros(4)}),
        "rank 1: tensor 'net.0.bias' is F32[4] but the base model has F32[3]",
    )


def case_mismatched_dtypes(tmp):
    return gather_case(
        tmp,
        train_dir(tmp, shapes={"net.0.bias": torch.zeros(3, dtype=torch.float64)}),
        "rank 1: tensor 'net.0.bias' is F64[3]",
    )


def case_truncated_safetensors(tmp):
    out = train_dir(tmp)
    data = (out / "rank-1.safetensors").read_bytes()
    (out / "rank-1.safetensors").write_bytes(data[: len(data) // 2])
    return gather_case(tmp, out, "rank-1.safetensors is not a readable safetensors file")


def case_pickle_as_checkpoint(tmp):
    out = train_dir(tmp)
    (out / "rank-1.safetensors").write_bytes(pickle.dumps(Evil(tmp / "UNPICKLED")))
    return gather_case(tmp, out, "rank-1.safetensors is not a readable safetensors file")


def case_world_size_not_matching_checkpoints(tmp):
    return gather_case(
        tmp, train_dir(tmp), "was trained with world size 2 but the run config says 3", world_size=3
    )


def case_membership_malformed(tmp):
    out = train_dir(tmp)
    info = json.loads((out / "train.json").read_text())
    (out / "train.json").write_text(json.dumps({**info, "membership": {"num_shards": 2, "ranks": [{}]}}))
    return gather_case(tmp, out, "train.json: 'membership' is malformed ('rank'); re-run training")


def case_unknown_merge_method_cli(tmp):
    return Case(
        "merge",
        [
            "--gather",
            tmp / "g.json",
            "--method",
            "soup",
            "--out-weights",
            tmp / "m.safetensors",
            "--out-json",
            tmp / "m.json",
        ],
        "argument --method: invalid choice: 'soup'",
        tmp / "m.safetensors",
    )


def _gathered(tmp: Path, ranks: int) -> Path:
    out = train_dir(tmp, ranks=ranks)
    proc = run_stage("gather", "--train-dir", out, "--world-size", ranks, "--out", tmp / "g.json")
    assert proc.returncode == 0, proc.stderr
    return tmp / "g.json"


def case_slerp_with_three_models(tmp):
    return Case(
        "merge",
        [
            "--gather",
            _gathered(tmp, 3),
            "--method",
            "slerp",
            "--out-weights",
            tmp / "m.safetensors",
            "--out-json",
            tmp / "m.json",
        ],
        "slerp",
        tmp / "m.safetensors",
    )


def case_greedy_soup_without_val_split(tmp):
    return Case(
        "merge",
        [
            "--gather",
            _gathered(tmp, 2),
            "--method",
            "greedy_soup",
            "--out-weights",
            tmp / "m.safetensors",
            "--out-json",
            tmp / "m.json",
        ],
        "--val-split",
        tmp / "m.safetensors",
    )


def case_unknown_merge_param(tmp):
    return Case(
        "merge",
        [
            "--gather",
            _gathered(tmp, 2),
            "--method",
            "ties",
            "--params-json",
            '{"densty": 0.3}',
            "--out-weights",
            tmp / "m.safetensors",
            "--out-json",
            tmp / "m.json",
        ],
        "densty",
        tmp / "m.safetensors",
    )


def case_unwritable_results_dir(tmp):  # root ignores permission bits: a file blocks the path instead
    path = table(tmp, "train.parquet", {"x0": np.zeros(8, np.float32), "label": np.zeros(8, np.int64)})
    blocker = tmp / "results"
    blocker.write_text("a file where a directory should be")
    return Case(
        "partition",
        ["--input", path, "--world-size", 2, "--seed", 0, "--out-dir", blocker / "shards"],
        "choose a writable, existing results directory",
    )


def case_bad_json_argument(tmp):
    return (
        prepare_case(tmp, {}, "")
        if False
        else Case(
            "prepare",
            ["--name", "x", "--spec-json", "{source: digits}", "--out-dir", tmp / "out"],
            "--spec-json is not valid JSON",
            tmp / "out",
        )
    )


def case_tracking_inputs_missing(tmp):
    return Case(
        "tracking",
        [
            "--run",
            "r",
            "--run-dir",
            tmp,
            "--manifest",
            tmp / "manifest.json",
            "--config-json",
            '{"run": "r", "dataset": "d"}',
            "--tracking-uri",
            "http://127.0.0.1:9",
            "--out",
            tmp / "o.json",
        ],
        "does not exist",
        tmp / "o.json",
    )


# ---------------------------------------------------------------- issue 18: what the held-out check found


def yaml_case(tmp: Path, text: str, fragment: str) -> Case:
    path = tmp / "config.yaml"
    path.write_text(text)
    return Case("config", ["--configfile", path], fragment)


def tsv_case(tmp: Path, rows: str, fragment: str) -> Case:
    runs = tmp / "runs.tsv"
    runs.write_text(rows)
    config = base_config()
    config["runs"] = str(runs)
    return config_case(tmp, config, fragment)


def case_nan_lr(tmp):
    return yaml_case(
        tmp,
        "runs: {r: {lr: .nan}}\ndatasets: {d: {source: digits}}\nrun_defaults: {dataset: d}\n",
        "runs[r].lr: nan is not a finite number (NaN and infinity are not allowed)",
    )


def case_inf_dropout(tmp):
    return config_case(tmp, base_config(dropout=float("inf")), "runs[r].dropout: inf is not a finite number")


def case_nan_in_runs_table(tmp):
    return tsv_case(
        tmp, "run\tlr\nr\tnan\n", "runs[r].lr: nan is not a finite number (NaN and infinity are not allowed)"
    )


def case_nan_dataset_fraction(tmp):
    config = base_config()
    config["datasets"]["d"]["val_fraction"] = float("nan")
    return config_case(tmp, config, "datasets.d.val_fraction: nan is not a finite number")


def case_run_name_trailing_newline(tmp):
    config = base_config()
    config["runs"] = {"r\n": {}}
    return config_case(tmp, config, "run name 'r\\n' is not allowed")


def case_dataset_name_trailing_newline(tmp):
    config = base_config()
    config["datasets"] = {"d\n": {"source": "digits"}}
    config["run_defaults"]["dataset"] = "d\n"
    return config_case(tmp, config, "dataset name 'd\\n' is not allowed")


def case_seed_too_large(tmp):
    return config_case(
        tmp,
        base_config(seed=2**70),
        "runs[r].seed: seed 1180591620717411303424 is too large; use a seed from 0 to 9223344366821 "
        "(each rank seeds torch with seed x 1000003 + rank + 1, a 64-bit integer)",
    )


def case_shard_seed_too_large(tmp):
    return config_case(
        tmp,
        base_config(shard_seed=2**63),
        "runs[r].shard_seed: seed 9223372036854775808 is too large; use a seed from 0 to "
        "9223372036854775807 (seeds are 64-bit integers)",
    )


def case_dataset_seed_too_large(tmp):
    return prepare_case(
        tmp,
        {"source": "digits", "seed": 2**70},
        "spec key 'seed' must be an integer from 0 to 9223372036854775807, got 1180591620717411303424",
    )


def case_duplicate_top_level_key(tmp):
    return yaml_case(
        tmp,
        "datasets:\n  d: {source: digits}\nrun_defaults: {dataset: d}\nruns: {r: {}}\n"
        "datasets:\n  e: {source: digits}\n",
        "config.yaml line 5: key 'datasets' appears twice at the top level (first on line 1)",
    )


def case_duplicate_nested_key(tmp):
    return yaml_case(
        tmp,
        "datasets: {d: {source: digits}}\nruns: {r: {}}\nrun_defaults:\n  dataset: d\n  lr: 0.1\n  lr: 0.2\n",
        "line 6: key 'lr' appears twice under run_defaults (first on line 5)",
    )


def case_yaml_python_tag(tmp):
    return yaml_case(
        tmp,
        f"datasets: {{d: {{source: digits}}}}\nruns: {{r: {{}}}}\n"
        f"run_defaults: !!python/object/apply:os.system ['touch {tmp}/UNPICKLED']\n",
        "line 3 uses the YAML tag !!python/object/apply:os.system, which is not allowed; plain YAML only "
        "(mappings, lists, strings, numbers, true/false, null)",
    )


def case_ragged_runs_row(tmp):
    return tsv_case(
        tmp,
        "run\tlr\n# a comment\n\nr\t0.1\t0.2\n",
        "runs.tsv line 4 has more cells than the header; separate columns with single tabs",
    )


def case_duplicate_runs_column(tmp):
    return tsv_case(tmp, "run\tlr\tlr\nr\t0.1\t0.2\n", "column 'lr' appears more than once in the header")


def case_nullable_cell_not_a_number(tmp):
    return tsv_case(
        tmp,
        "run\tnproc_per_node\nr\teight\n",
        "runs[r].nproc_per_node: 'eight' is not a valid integer; write e.g. 2 in that cell",
    )


def case_duplicate_feature_column(tmp):
    path = tmp / "data.csv"
    path.write_text("a,a,y\n" + "1,2,0\n3,4,1\n" * 5)
    spec = {"source": "csv", "path": str(path), "feature_columns": ["a"], "label_column": "y"}
    return prepare_case(
        tmp,
        spec,
        "column name(s) 'a' appear more than once in the header of",
    )


def case_duplicate_parquet_column(tmp):
    path = tmp / "data.parquet"
    columns = [pa.array([1.0, 2.0] * 5), pa.array([3.0, 4.0] * 5), pa.array([0, 1] * 5)]
    pq.write_table(pa.Table.from_arrays(columns, names=["a", "b", "b"]), path)
    spec = {"source": "parquet", "path": str(path), "feature_columns": ["a"], "label_column": "b"}
    return prepare_case(tmp, spec, "column name(s) 'b' appear more than once in the header of")


def case_label_looks_continuous(tmp):
    rng = np.random.default_rng(0)
    return user_file(
        tmp,
        {"a": rng.normal(size=200), "b": rng.normal(size=200), "y": np.arange(200.0) % 130},
        "looks continuous (130 distinct float values in 200 rows); set task: regression with "
        "label_columns: [y]",
    )


def case_dataset_path_is_directory(tmp):
    (tmp / "data.parquet").mkdir()
    spec = {
        "source": "parquet",
        "path": str(tmp / "data.parquet"),
        "feature_columns": ["a"],
        "label_column": "y",
    }
    return prepare_case(
        tmp, spec, "data.parquet is a directory, not a file; fix 'path' in the dataset's spec"
    )


def case_dataset_path_is_fifo(tmp):
    os.mkfifo(tmp / "data.csv")
    spec = {"source": "csv", "path": str(tmp / "data.csv"), "feature_columns": ["a"], "label_column": "y"}
    return prepare_case(tmp, spec, "data.csv is not a regular file (a FIFO, socket or device)")


def case_image_folder_is_a_file(tmp):
    (tmp / "images").write_text("not a folder")
    spec = {"source": "image_folder", "path": str(tmp / "images"), "image_size": [8, 8]}
    return prepare_case(tmp, spec, "images is a file, not a directory; set 'path' to the folder holding")


# ---------------------------------------------------------------- issue 28: init_from a foreign file

# The digits MLP of base_config with hidden_sizes [8], as a file not written by shardfuse holds it.
DIGITS_MLP_8 = {
    "net.0.weight": (8, 64),
    "net.0.bias": (8,),
    "net.2.weight": (10, 8),
    "net.2.bias": (10,),
    "input_mean": (64,),
    "input_scale": (64,),
}


def foreign_init_case(tmp: Path, shapes: dict, fragment: str) -> Case:
    from safetensors.numpy import save_file

    save_file({name: np.zeros(shape, np.float32) for name, shape in shapes.items()}, tmp / "w.safetensors")
    return config_case(tmp, base_config(init_from=str(tmp / "w.safetensors"), hidden_sizes=[8]), fragment)


def case_init_from_missing_tensor(tmp):
    shapes = {name: shape for name, shape in DIGITS_MLP_8.items() if name != "net.2.bias"}
    return foreign_init_case(tmp, shapes, "w.safetensors has no tensor 'net.2.bias' that the model needs")


def case_init_from_unexpected_tensor(tmp):
    shapes = {**DIGITS_MLP_8, "head.extra": (3,)}
    return foreign_init_case(tmp, shapes, "w.safetensors has tensor 'head.extra' the model does not have")


def case_init_from_pickled_folder(tmp):
    (tmp / "gpt2").mkdir()
    (tmp / "gpt2" / "pytorch_model.bin").write_bytes(pickle.dumps(Evil(tmp / "UNPICKLED")))
    return config_case(
        tmp,
        base_config(init_from=str(tmp / "gpt2")),
        "gpt2 holds pytorch_model.bin but no model.safetensors: shardfuse reads safetensors only",
    )


def case_init_from_prefix_without_init_from(tmp):
    return config_case(
        tmp,
        base_config(init_from_prefix={"model.": ""}),
        "runs[r].init_from_prefix: it renames the tensors of init_from but init_from is not set; remove "
        "init_from_prefix or set init_from",
    )


# ---------------------------------------------------------------- issue 29: config checks up front, CLI


def config_yaml(runs: str, datasets: str = "{d: {source: digits}}", dataset: str = "d") -> str:
    return f"runs: {runs}\ndatasets: {datasets}\nrun_defaults: {{dataset: {dataset}}}\n"


def case_one_class(tmp):
    config = base_config()
    config["datasets"]["d"]["classes"] = [3]
    return config_case(
        tmp, config, "datasets.d.classes: [3] keeps a single class, and a classifier needs at least 2"
    )


def case_run_name_read_as_number(tmp):
    return yaml_case(
        tmp,
        config_yaml("{010: {}}"),
        "config error at runs: run name 8 is not a string: YAML reads unquoted 010 as the number 8 "
        "(config file ",
    )


def case_dataset_name_read_as_boolean(tmp):
    return yaml_case(
        tmp,
        config_yaml("{r: {}}", "{on: {source: digits}}", "'on'"),
        "dataset name True is not a string: YAML reads unquoted on as true",
    )


def case_run_name_too_long(tmp):
    config = base_config()
    config["runs"] = {"r" * 300: {}}
    return config_case(
        tmp,
        config,
        "is 300 characters long; at most 236 fit (a file name holds 255 bytes and the workflow writes "
        ".NAME.json.tmp-XXXXXXXX); shorten it",
    )


def case_merge_align_without_groups(tmp):
    models = str(REPO / "config" / "examples" / "models")
    run = {"model": "resmlp:build", "code_paths": [models], "merge_align": "weight_matching"}
    run.update(strategy="localsgd", init="per_rank", merge_method="uniform")
    return config_case(
        tmp,
        base_config(**run),
        "runs[r].merge_align: merge_align weight_matching needs the model's permutation groups: the "
        "built-in mlp and cnn declare them, 'resmlp:build' does not",
    )


def case_invalid_registered_model(tmp):
    config = base_config()
    config["mlflow"] = {"registered_model": "team/digits"}
    return config_case(
        tmp,
        config,
        "config error at mlflow.registered_model: 'team/digits' is not a name MLflow accepts (it contains "
        "'/')",
    )


def case_short_runs_row(tmp):
    return tsv_case(
        tmp,
        "run\tlr\tepochs\nr\t0.1\n",
        "runs.tsv line 2 has 2 cell(s) but the header has 3 columns; give every row one cell per column",
    )


def case_empty_runs_mapping(tmp):
    return yaml_case(tmp, config_yaml("{}"), "config error at runs: the runs mapping is empty; add a run")


def case_decimal_in_integer_column(tmp):
    return tsv_case(
        tmp,
        "run\tworld_size\nr\t2.5\n",
        "runs[r].world_size: '2.5' is a decimal but column world_size expects an integer",
    )


def case_partition_seed_too_large(tmp):
    return Case(
        "partition",
        ["--input", tmp / "train.parquet", "--world-size", 2, "--seed", 2**63, "--out-dir", tmp / "out"],
        "argument --seed: '9223372036854775808' is not a seed; use an integer from 0 to 9223372036854775807",
        tmp / "out",
    )


def case_unknown_partitioner(tmp):
    return Case(
        "partition",
        ["--input", tmp / "train.parquet", "--world-size", 2, "--seed", 0, "--partitioner", "nosuch",
         "--out-dir", tmp / "out"],
        "unknown partitioner 'nosuch'; use one of iid, dirichlet, pathological, shards, column, domain, "
        "size, continuous; set the run key partition (or --partitioner) to one of them",
        tmp / "out",
    )  # fmt: skip


def case_partition_alpha_not_positive(tmp):
    return config_case(
        tmp,
        base_config(partition="dirichlet", partition_alpha=0),
        "runs[r].partition: partitioner dirichlet: parameter 'alpha' must be a number > 0 (the Dirichlet "
        "concentration), got 0; fix run key partition_alpha",
    )


def case_partition_key_not_taken(tmp):
    return config_case(
        tmp,
        base_config(partition="pathological", partition_classes_per_rank=2, partition_alpha=0.5),
        "partitioner pathological does not take partition_alpha (it takes partition_classes_per_rank, "
        "partition_assignment, partition_min_rows); remove it, or set partition to the partitioner it "
        "belongs to",
    )


def case_label_partition_on_regression(tmp):
    config = base_config(partition="shards")
    config["datasets"] = {"d": {"source": "diabetes"}}
    return config_case(
        tmp,
        config,
        "partitioner shards splits by class labels, but dataset d is a regression dataset without them; "
        "use partition: size, column or continuous (or iid)",
    )


def case_partition_sizes_not_summing_to_one(tmp):
    return config_case(
        tmp,
        base_config(partition="size", partition_sizes=[0.5, 0.2], world_size=2),
        "partitioner size: partition_sizes [0.5, 0.2] are 2 fractions summing to 0.7; give 2 fractions (one "
        "per rank) that sum to 1",
    )


def partition_rules_case(tmp, partitioner: str, params: dict, fragment: str, num_groups: int = 12) -> Case:
    write_grouped_rows(tmp / "train.parquet", 400, num_classes=4, num_groups=num_groups)
    return Case(
        "partition",
        ["--input", tmp / "train.parquet", "--world-size", 4, "--seed", 0, "--partitioner", partitioner,
         "--params-json", json.dumps(params), "--out-dir", tmp / "out"],
        fragment,
        tmp / "out",
    )  # fmt: skip


def case_dirichlet_min_rows_unmet(tmp):
    return partition_rules_case(
        tmp,
        "dirichlet",
        {"alpha": 0.01, "min_rows": 120},
        "partitioner dirichlet: 11 draws with partition_alpha 0.01 each left a rank under partition_min_rows "
        "120 (the last: shards of",
    )


def case_column_partition_float_column(tmp):
    return partition_rules_case(
        tmp,
        "column",
        {"column": "x0"},
        "partitioner column groups rows by the values of column 'x0', which holds floating-point numbers "
        "(float); name a column of integers or strings (partition: continuous splits by a float column)",
    )


def case_column_partition_fewer_groups_than_ranks(tmp):
    return partition_rules_case(
        tmp,
        "column",
        {"column": "user"},
        "partitioner column: column 'user' holds 3 groups, fewer than the 4 ranks; use at most 3 ranks or "
        "another column",
        num_groups=3,
    )


def case_merge_output_twice(tmp):
    out = tmp / "merged.safetensors"
    args = ["--gather", tmp / "gather.json", "--method", "uniform", "--out-weights", out, "--out-json", out]
    return Case("merge", args, "--out-weights and --out-json both name", out)


def case_tracking_config_without_run(tmp):
    return Case(
        "tracking",
        [
            "--run", "r", "--run-dir", tmp, "--manifest", tmp / "manifest.json", "--config-json", "{}",
            "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}", "--out", tmp / "o.json",
        ],
        "--config-json has no 'run' or 'dataset' key, so it is not a run's resolved config",
        tmp / "o.json",
    )  # fmt: skip


def case_tracking_runs_json_without_a_config(tmp):
    entry = {
        "run": "r",
        "run_dir": str(tmp),
        "manifest": str(tmp / "m.json"),
        "config": {},
        "out": str(tmp / "o.json"),
    }
    return Case(
        "tracking",
        ["--runs-json", json.dumps([entry]), "--tracking-uri", f"sqlite:///{tmp / 'mlflow.db'}"],
        "--runs-json entry 0 lacks config; each run needs run, run_dir, manifest, config, out",
        tmp / "o.json",
    )


def case_stop_before_limit_negative(tmp):
    return Case(
        "launch",
        ["--nproc-per-node", 1, "--out-dir", tmp / "ranks", "--stop-before-limit", "-5"],
        "--stop-before-limit is -5; give the seconds before the time limit, e.g. 300, or 0 for off",
        tmp / "ranks",
    )


CASES = {name[5:]: fn for name, fn in sorted(globals().items()) if name.startswith("case_")}


# Cases that also run as a real `python -m shardfuse.<stage>` process (the exit status and stderr a user
# sees, one per kind of input); the others call the stage's main through run_cli in this process.
SUBPROCESS_CASES = {
    "unknown_config_key",
    "yaml_python_tag",
    "dataset_path_is_fifo",
    "corrupt_parquet",
    "pickle_as_checkpoint",
    "unknown_merge_method_cli",
}


def run_in_process(stage: str, args: list, capsys) -> tuple[int, str]:
    """The stage's ``main`` under ``run_cli``, as ``python -m shardfuse.<stage>`` runs it."""
    module = importlib.import_module(f"shardfuse.{stage}")
    capsys.readouterr()
    with pytest.raises(SystemExit) as exited:
        run_cli(module.main, [str(arg) for arg in args])
    return exited.value.code, capsys.readouterr().err


@pytest.mark.parametrize("name", sorted(CASES))
def test_bad_input_is_one_clear_line(name, tmp_path, capsys):
    case = CASES[name](tmp_path)
    if name in SUBPROCESS_CASES:
        proc = run_stage(case.stage, *case.args)
        returncode, stderr = proc.returncode, proc.stderr
    else:
        returncode, stderr = run_in_process(case.stage, case.args, capsys)
    assert returncode == 2, stderr[-2000:]
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr[-2000:]
    assert lines[0].startswith(f"shardfuse.{case.stage}: error: ")
    assert case.fragment in lines[0]
    if case.out is not None:
        assert not case.out.exists()
        assert not list(case.out.parent.glob(f".{case.out.name}.tmp-*"))
    assert not (tmp_path / "UNPICKLED").exists()


def test_catalogue_is_large_enough_and_documented():
    assert len(CASES) >= 25
    assert set(CASES) >= SUBPROCESS_CASES
    docs = DOCS.read_text()
    missing = [name for name in CASES if f"`{name}`" not in docs]
    assert not missing, f"docs/errors.md lacks {missing}"


def documented_elsewhere() -> list[tuple[str, list[str], list[str]]]:
    """(input, message pieces, test files) of each row of docs/errors.md's second table."""
    # The table ends at the next section (a section's own test holds its table).
    text = (
        DOCS.read_text().split("Elsewhere, in the tests of the stage concerned:", 1)[1].split("\n## ", 1)[0]
    )
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) != 3 or cells[0] in {"input", ""} or set(cells[0]) <= {"-"}:
            continue
        messages = re.findall(r"`([^`]+)`", cells[1])
        files = re.findall(r"`(tests/[\w/]+\.py)`", cells[2])
        pieces = [piece.strip(" ;:,()") for message in messages for piece in message.split("…")]
        rows.append((cells[0], [piece for piece in pieces if len(piece) >= 8], files))
    return rows


def test_every_message_of_the_second_table_is_asserted_by_its_tests():
    """The second table quotes messages checked elsewhere; each quoted piece must be what those tests
    assert (they run the real code), so the table cannot drift from what users see."""
    rows = documented_elsewhere()
    assert len(rows) >= 6
    drifted = []
    for what, pieces, files in rows:
        assert files, f"docs/errors.md row {what!r} names no test file"
        # Adjacent string literals across lines read as one (black splits long messages).
        sources = re.sub(r'"\s*\n\s*f?"', "", "\n".join((REPO / name).read_text() for name in files))
        missing = [piece for piece in pieces if piece not in sources]
        if missing:
            drifted.append(f"row {what!r}: {missing} not asserted in {files}")
    assert not drifted, "docs/errors.md drifted from the tests: " + "; ".join(drifted)


def test_shell_metacharacters_in_a_dataset_path_reach_no_shell(tmp_path):
    """Config values reach rule shells quoted: a path full of metacharacters is just a path."""
    import subprocess

    from tests.support.helpers import subprocess_env

    data_dir = tmp_path / "data"
    data_dir.mkdir()
    name = "my data;touch PWNED;$(touch PWNED2)`touch PWNED3`.parquet"
    rng = np.random.default_rng(0)
    table(data_dir, name, {"a": rng.normal(size=60), "b": rng.normal(size=60), "y": np.arange(60) % 3})
    config = {
        "runs": {"r": {}},
        "datasets": {
            "mine": {
                "source": "parquet",
                "path": f"data/{name}",
                "feature_columns": ["a", "b"],
                "label_column": "y",
            }
        },
        "run_defaults": {"dataset": "mine", "world_size": 2},
    }
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    proc = subprocess.run(
        snakemake_command(
            tmp_path, "--configfile", tmp_path / "config.yaml", "--cores", 1, "--until", "partition"
        ),
        capture_output=True,
        text=True,
        env=subprocess_env(),
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not list(tmp_path.rglob("PWNED*")) and not list(Path.cwd().glob("PWNED*"))
    assert (tmp_path / "results" / "datasets" / "mine" / "train.parquet").is_file()
    shutil.rmtree(tmp_path / "results")
