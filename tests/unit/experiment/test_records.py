"""train.json as one typed record: what older train stages wrote reads as None (never 0), what a newer
one writes survives a read and a write, and anything but a JSON object is refused."""

from __future__ import annotations

import json

import pytest

from shardfuse.experiment.records import WRITTEN, TrainRecord, mode_of
from shardfuse.io import UserError


def test_a_record_round_trips_with_the_fields_a_newer_train_stage_adds():
    data = {"run": "t", "world_size": 2, "num_steps": 7, "train_seconds": 1.5, "future_field": [1, 2]}
    record = TrainRecord.from_json(data)
    assert record.num_steps == 7 and record.extra == {"future_field": [1, 2]}
    written = record.to_json()
    assert written["future_field"] == [1, 2] and TrainRecord.from_json(written) == record
    # The train stage writes every field, null where it has nothing to say (null is not absent).
    assert set(written) == WRITTEN | {"future_field"} and written["slurm_job_id"] is None


def test_an_older_train_json_reads_as_absent_fields_not_zeros(tmp_path):
    path = tmp_path / "train.json"
    path.write_text(json.dumps({"run": "old", "strategy": "localsgd", "sync_every": 0, "num_steps": 3}))
    record = TrainRecord.read(path)
    assert record.bytes_all_reduced_per_rank is None and record.effective_batch_size is None
    assert record.training_mode() == "independent"


@pytest.mark.parametrize(
    ("data", "run_config", "mode"),
    [
        ({"mode": "diloco", "strategy": "localsgd", "sync_every": 0}, {}, "diloco"),
        ({"strategy": "localsgd", "sync_every": 4}, {"strategy": "ddp"}, "localsgd"),
        ({}, {"strategy": "localsgd", "sync_every": ""}, "independent"),
        ({}, {"strategy": "ddp", "sync_every": 0}, "ddp"),
        ({}, {}, ""),
    ],
)
def test_the_mode_is_recorded_else_derived_from_the_record_else_from_the_run_config(data, run_config, mode):
    record = TrainRecord.from_json(data)
    assert record.training_mode(run_config.get("strategy"), run_config.get("sync_every")) == mode


def test_the_mode_rule_is_the_train_stages():
    assert [mode_of(s, n) for s, n in (("ddp", 0), ("localsgd", 0), ("localsgd", 5), ("diloco", 5))] == [
        "ddp",
        "independent",
        "localsgd",
        "diloco",
    ]


def test_anything_but_a_json_object_is_refused_naming_the_file(tmp_path):
    path = tmp_path / "train.json"
    path.write_text("[1, 2]")
    with pytest.raises(UserError, match=r"train.json is not a JSON object; re-run the train stage"):
        TrainRecord.read(path)
