"""A parent run's partition params: the resolved config holds a partition_<param> key for every param of
every partitioner, mostly null; MLflow gets only those of the partitioner that cut the run's shards, with
the values its manifest records (none for iid). Pushed to a real MLflow SQLite store."""

from __future__ import annotations

import json

from shardfuse.data.partitioners import registry
from shardfuse.track import sync as track_sync
from shardfuse.track.ui import partition_params
from tests.support.tracking import TRACK_EXPERIMENT, active_runs, make_run_dir, run_config

# Every partition_<param> key a resolved run config carries (the schema's, null by default).
NULL_KEYS = {f"partition_{name}": None for record in registry.RECORDS for name in record.params}


def pushed_params(track_store, tmp_path, run_name: str, keys: dict, partition: dict | None) -> dict[str, str]:
    run_dir, manifest_path = make_run_dir(tmp_path, run_name)
    if partition is not None:
        manifest = json.loads(manifest_path.read_text())
        manifest_path.write_text(json.dumps({**manifest, "partition": partition}))
    config = {**run_config(run_name), **NULL_KEYS, **keys}
    track_sync.track_run(run_name, run_dir, manifest_path, config, track_store["uri"], TRACK_EXPERIMENT)
    (parent,) = active_runs(track_store, run_name)[0]
    return parent.data.params


def test_an_iid_run_logs_its_partitioner_and_no_partition_param(track_store, tmp_path):
    assert len(NULL_KEYS) == 11
    params = pushed_params(track_store, tmp_path, "iid_run", {"partition": "iid"}, None)
    assert params["partition"] == "iid"
    assert not [key for key in params if key.startswith("partition_")]


def test_a_column_run_logs_the_params_its_manifest_records_and_no_other(track_store, tmp_path):
    used = {"name": "column", "params": {"column": "writer", "groups": None, "min_rows": 10}}
    keys = {"partition": "column", "partition_column": "writer"}
    params = pushed_params(track_store, tmp_path, "column_run", keys, used)
    found = {key: value for key, value in params.items() if key.startswith("partition")}
    assert found == {"partition": "column", "partition_column": "writer", "partition_min_rows": "10"}


def test_list_params_are_json_and_keys_of_no_partitioner_stay():
    manifest = {"partition": {"name": "size", "params": {"sizes": [0.5, 0.5], "law": None, "min_rows": 3}}}
    config = {"partition": "size", "partition_sizes": "[0.5, 0.5]", "partition_alpha": "None", "lr": "0.1"}
    assert partition_params(config, manifest) == {
        "partition": "size",
        "partition_sizes": "[0.5, 0.5]",
        "partition_min_rows": "3",
        "lr": "0.1",
    }
