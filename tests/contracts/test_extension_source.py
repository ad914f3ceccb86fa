"""Adding a dataset source is one class (its behaviour: checks, description, rows) and one record in
``shardfuse.data.sources.registry.RECORDS`` (plus the schema's source enum and its config/README.md row):
a toy source written to a temporary module and registered so is validated, listed as the prepare rule's
inputs and prepared by the real prepare stage, for either task its layouts of targets serve."""

from __future__ import annotations

import json

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.data.provenance import dataset_files
from shardfuse.data.sources import registry
from shardfuse.data.sources.describe import info_from_spec
from shardfuse.data.sources.files import path_file
from shardfuse.experiment.partition_check import check_partition
from shardfuse.experiment.schema import ConfigError
from shardfuse.models.task import CLASSES, VALUES
from tests.support.extension import import_toy_module, stage_ok
from tests.support.helpers import call_stage

TOY_SOURCE = '''
import numpy as np

from shardfuse.data.sources.base import Described, Loaded, SourceBehaviour
from shardfuse.data.sources.checks import require_int, require_string
from shardfuse.models.task import CLASSES


class Columns(SourceBehaviour):
    """A text file of numbers, one row per line: the features, then the label (or the target)."""

    def check(self, spec, task):
        require_string(spec, "path")
        require_int(spec, "num_features", 1)

    def describe(self, spec, task):
        if task.labels == CLASSES:
            return None  # the classes are in the file
        width = spec["num_features"]
        return Described("numeric", [width], [f"c{j}" for j in range(width)], ["last"])

    def load(self, spec, task):
        table = np.loadtxt(spec["path"], ndmin=2)
        features, last = table[:, : spec["num_features"]].astype(np.float32), table[:, -1]
        names = [f"c{j}" for j in range(features.shape[1])]
        if task.labels == CLASSES:
            values, codes = np.unique(last, return_inverse=True)
            return Loaded(features, codes.astype(np.int64), names, [f"{v:g}" for v in values])
        return Loaded(features, last.astype(np.float32).reshape(-1, 1), names, ["last"])


class GroupedColumns(Columns):
    """The same rows, with ``blocks: N`` a column ``block`` of N contiguous blocks carried as data."""

    def load(self, spec, task):
        import pyarrow as pa

        loaded = super().load(spec, task)
        blocks = np.arange(len(loaded.features)) * spec["blocks"] // len(loaded.features)
        return loaded._replace(carried=pa.table({"block": blocks}))
'''


@pytest.fixture
def toy_source(tmp_path, monkeypatch):
    """The toy source registered as ``columns``, and a file of 60 rows (3 features, 3 classes) for it."""
    import_toy_module(tmp_path, "toy_columns", TOY_SOURCE)
    record = registry.Source(
        "columns",
        (CLASSES, VALUES),
        "toy_columns:Columns",
        required=frozenset({"path", "num_features"}),
        files=path_file,
    )
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, record))
    rng = np.random.default_rng(0)
    rows = np.column_stack([rng.standard_normal((60, 3)), np.arange(60) % 3])
    path = tmp_path / "rows.txt"
    np.savetxt(path, rows)
    return {"source": "columns", "path": str(path), "num_features": 3}


def test_a_toy_source_in_the_records_is_prepared_by_the_prepare_stage(tmp_path, toy_source):
    out = tmp_path / "classes"
    line = stage_ok("prepare", "--name", "toy", "--spec-json", json.dumps(toy_source), "--out-dir", out)

    info = json.loads((out / "dataset.json").read_text())
    assert (info["source"], info["task"], info["label_names"]) == (
        "columns",
        "classification",
        ["0", "1", "2"],
    )
    assert info["feature_names"] == ["c0", "c1", "c2"] and sum(info["rows"].values()) == 60
    splits = {split: pq.read_table(out / f"{split}.parquet") for split in ("train", "val", "test")}
    assert all(table.column_names == ["x0", "x1", "x2", "label"] for table in splits.values())
    assert {split: table.num_rows for split, table in splits.items()} == info["rows"]
    assert sorted(set(splits["test"]["label"].to_pylist())) == [0, 1, 2]  # stratified by class
    assert line.startswith("toy (classification): ") and "3 features, 3 classes" in line
    assert dataset_files(toy_source) == [toy_source["path"]]  # the prepare rule's inputs, from the record


def test_a_toy_source_gives_every_task_of_its_layouts_and_describes_what_it_can(tmp_path, toy_source):
    spec = {**toy_source, "task": "regression"}
    out = tmp_path / "values"
    stage_ok("prepare", "--name", "toy", "--spec-json", json.dumps(spec), "--out-dir", out)

    info = json.loads((out / "dataset.json").read_text())
    assert (info["task"], info["target_names"], info["num_classes"]) == ("regression", ["last"], 0)
    assert pq.read_schema(out / "train.parquet").names == ["x0", "x1", "x2", "y0"]
    described = info_from_spec(spec)
    assert described == {key: info[key] for key in described} | {"input": described["input"]}
    assert described["input"] == {key: info["input"][key] for key in ("kind", "shape")}
    assert info_from_spec(toy_source) is None  # the classes only the file tells


def test_a_toy_sources_record_decides_its_keys_and_tasks(tmp_path, toy_source):
    missing = call_stage(
        "prepare", "--name", "t", "--spec-json", json.dumps({"source": "columns"}), "--out-dir", tmp_path
    )
    assert missing.returncode != 0 and "lacks 'num_features', 'path'" in missing.stderr
    lm = call_stage("prepare", "--name", "t", "--spec-json", json.dumps({**toy_source, "task": "causal_lm"}),
                    "--out-dir", tmp_path)  # fmt: skip
    assert (
        lm.returncode != 0
        and "cannot do task 'causal_lm'; use task: classification or regression" in lm.stderr
    )


def test_a_toy_source_that_carries_a_group_column_feeds_a_column_partition(tmp_path, toy_source, monkeypatch):
    grouped = registry.Source(
        "grouped",
        (CLASSES,),
        "toy_columns:GroupedColumns",
        required=frozenset({"path", "num_features"}),
        optional=frozenset({"blocks"}),
        files=path_file,
        carried=lambda spec: {"block": spec.get("blocks")},
        carry_fix="set blocks: N",
    )
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, grouped))
    spec = {**toy_source, "source": "grouped", "blocks": 6}
    stage_ok("prepare", "--name", "toy", "--spec-json", json.dumps(spec), "--out-dir", tmp_path / "data")
    train = pq.read_table(tmp_path / "data" / "train.parquet")
    assert train.column_names == ["x0", "x1", "x2", "label", "block"]
    stage_ok(
        "partition", "--input", tmp_path / "data" / "train.parquet", "--world-size", 3, "--seed", 0,
        "--partitioner", "column", "--params-json", '{"column": "block", "min_rows": 1}',
        "--out-dir", tmp_path / "shards",
    )  # fmt: skip
    manifest = json.loads((tmp_path / "shards" / "manifest.json").read_text())
    blocks = [set(shard["value_counts"]["block"]) for shard in manifest["shards"]]
    assert sorted(value for found in blocks for value in found) == [str(b) for b in range(6)]
    for rank, found in enumerate(blocks):
        shard = pq.read_table(tmp_path / "shards" / f"shard-{rank}.parquet")
        assert {str(b) for b in shard["block"].to_pylist()} == found  # each block on one rank
    # The config check asks the record which columns a spec carries, and how many groups.
    run = {"dataset": "d", "world_size": 3, "partition": "column", "partition_column": "block"}
    check_partition("r", run, {"d": spec})
    with pytest.raises(ConfigError, match="holds 2 groups, fewer than the 3 ranks"):
        check_partition("r", run, {"d": {**spec, "blocks": 2}})
    with pytest.raises(ConfigError, match=r"do not carry \(they carry block\); set blocks: N"):
        check_partition("r", {**run, "partition_column": "site"}, {"d": spec})
