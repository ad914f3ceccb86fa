"""The domains source and the domain partitioner (shardfuse/data/sources/domains.py,
shardfuse/data/partitioners/domain.py): the union of the parts' splits with each row's part in column
`domain`; parts of another layout refused; the config resolves the task from the parts and refuses an
unknown part, a nested domains dataset, mixed tasks and a world size the parts cannot map to, before any
job. The whole workflow with per-domain scores: tests/slow/test_domains_workflow.py."""

from __future__ import annotations

import re

import numpy as np
import pyarrow.parquet as pq
import pytest

from shardfuse.data.sources.dataset import prepare
from shardfuse.experiment.load import load_experiment
from shardfuse.experiment.partition_check import check_partition
from shardfuse.experiment.schema import ConfigError
from shardfuse.io import UserError

LOW = {"source": "digits", "classes": [0, 1, 2, 3, 4]}
HIGH = {"source": "digits", "classes": [5, 6, 7, 8, 9]}


def test_the_union_holds_each_parts_splits_in_order_with_its_index(tmp_path):
    root = tmp_path / "datasets"
    low, high = prepare("low", LOW, root / "low"), prepare("high", HIGH, root / "high")
    info = prepare("mix", {"source": "domains", "parts": ["low", "high"]}, root / "mix")
    assert info["parts"] == ["low", "high"] and info["label_names"] == low["label_names"]
    for split in ("train", "val", "test"):
        assert info["rows"][split] == low["rows"][split] + high["rows"][split]
        union = pq.read_table(root / "mix" / f"{split}.parquet")
        domain = union.column("domain").to_numpy()
        assert domain.tolist() == [0] * low["rows"][split] + [1] * high["rows"][split]
        parts = [pq.read_table(root / part / f"{split}.parquet") for part in ("low", "high")]
        for name in parts[0].column_names:  # the rows themselves, unchanged
            joined = np.concatenate([part.column(name).to_numpy() for part in parts])
            assert np.array_equal(union.column(name).to_numpy(), joined), name
        labels = union.column("label").to_numpy()
        assert set(labels[domain == 0]) <= {0, 1, 2, 3, 4} and set(labels[domain == 1]) <= {5, 6, 7, 8, 9}
    assert info["domain_rows"]["high"]["test"] == high["rows"]["test"]


def test_parts_of_another_input_layout_are_refused_without_output(tmp_path):
    root = tmp_path / "datasets"
    prepare("low", LOW, root / "low")
    prepare("images", {"source": "digits_images"}, root / "images")
    with pytest.raises(UserError) as error:
        prepare("mix", {"source": "domains", "parts": ["low", "images"]}, root / "mix")
    assert "parts 'low' and 'images' differ in input" in str(error.value)
    assert not list(root.glob("mix/*.parquet"))


def config(datasets: dict, **run) -> dict:
    return {
        "datasets": datasets,
        "runs": {"r": {"dataset": "mix", "strategy": "localsgd", "partition": "domain", **run}},
        "run_defaults": {"world_size": 2},
    }


def test_the_config_takes_the_task_from_the_parts():
    text = {"source": "text", "paths": ["{stdlib}/json/*.py"], "block_size": 16}
    experiment = load_experiment(
        config({"a": text, "b": text, "mix": {"source": "domains", "parts": ["a", "b"]}}), environ={}
    )
    assert experiment.datasets["mix"]["task"] == "causal_lm"
    digits = load_experiment(
        config({"low": LOW, "high": HIGH, "mix": {"source": "domains", "parts": ["low", "high"]}}), environ={}
    )
    assert "task" not in digits.datasets["mix"]  # classification: the implicit task, as every spec's


@pytest.mark.parametrize(
    ("datasets", "message"),
    [
        ({"low": LOW, "mix": {"source": "domains", "parts": ["low", "nope"]}}, "unknown dataset 'nope'"),
        (
            {"low": LOW, "high": HIGH, "inner": {"source": "domains", "parts": ["low", "high"]},
             "mix": {"source": "domains", "parts": ["low", "inner"]}},
            "'inner' is a domains dataset itself; name its parts instead",
        ),
        (
            {"low": LOW, "dia": {"source": "diabetes"},
             "mix": {"source": "domains", "parts": ["low", "dia"]}},
            "the parts are of different tasks (low classification, dia regression); give them one task",
        ),
    ],
)  # fmt: skip
def test_bad_parts_are_a_config_error_before_any_job(datasets, message):
    with pytest.raises(ConfigError) as error:
        load_experiment(config(datasets), environ={})
    assert str(error.value).startswith("config error at datasets.mix.parts: ")
    assert message in str(error.value)


def test_a_world_size_the_parts_cannot_map_to_is_refused_before_any_job():
    datasets = {"low": LOW, "high": HIGH, "mix": {"source": "domains", "parts": ["low", "high"]}}
    experiment = load_experiment(config(datasets, world_size=2), environ={})
    run = {**experiment.runs["r"], "world_size": 3}
    with pytest.raises(
        ConfigError, match=re.escape("the dataset has 2 parts and the run 3 ranks; set world_size: 2")
    ):
        check_partition("r", run, experiment.datasets)
    grouped = {**run, "world_size": 2, "partition_groups": [[0], [2]]}
    with pytest.raises(ConfigError, match=re.escape("names part 2, but the dataset has parts 0..1")):
        check_partition("r", grouped, experiment.datasets)


def test_the_domain_sets_are_each_parts_test_rows_and_refuse_another_datasets_record(tmp_path):
    from shardfuse.scoring import domains

    root = tmp_path / "datasets"
    low, high = prepare("low", LOW, root / "low"), prepare("high", HIGH, root / "high")
    prepare("mix", {"source": "domains", "parts": ["low", "high"]}, root / "mix")
    record = root / "mix" / "dataset.json"
    assert domains.set_names(record) == ["domain_low", "domain_high"]
    weighting = domains.weigh(record, root / "mix" / "test.parquet", None)
    assert [weighted.record["rows"] for weighted in weighting.sets] == [
        low["rows"]["test"],
        high["rows"]["test"],
    ]
    assert [weighted.weights for weighted in weighting.sets] == [(1.0, 0.0), (0.0, 1.0)]
    with pytest.raises(UserError) as error:
        domains.weigh(record, root / "low" / "test.parquet", None)
    assert "is not the one beside the test split" in str(error.value)
    with pytest.raises(UserError) as error:
        domains.check(root / "low" / "dataset.json")
    assert "is not the record of a domains dataset (it names no parts)" in str(error.value)
