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


def test_a_part_named_by_two_ranks_is_split_between_them_iid_and_weighed_by_training_rows(tmp_path):
    from shardfuse.data.partitioners import domain
    from shardfuse.data.partitioners.assignment import Layout
    from shardfuse.data.shard_set import partition_parquet

    root = tmp_path / "datasets"
    low, high = prepare("low", LOW, root / "low"), prepare("high", HIGH, root / "high")
    prepare("mix", {"source": "domains", "parts": ["low", "high"]}, root / "mix")
    groups = [[0], [0], [1]]  # part 0 (low) on ranks 0 and 1, part 1 (high) on rank 2
    manifest = partition_parquet(
        root / "mix" / "train.parquet",
        tmp_path / "shards",
        3,
        7,
        partitioner="domain",
        params={"groups": groups},
    )
    shards = [pq.read_table(tmp_path / "shards" / f"shard-{rank}.parquet") for rank in range(3)]
    domains_of = [shard.column("domain").to_numpy() for shard in shards]
    assert set(domains_of[0]) == set(domains_of[1]) == {0} and set(domains_of[2]) == {1}
    assert len(shards[2]) == high["rows"]["train"]
    assert sorted([len(shards[0]), len(shards[1])]) == [
        low["rows"]["train"] // 2,
        -(-low["rows"]["train"] // 2),
    ]

    # IID, not two halves of the file order: both ranks hold rows from the start and the end of the part.
    def rows_of(table):
        return [tuple(row.values()) for row in table.to_pylist()]

    position = {
        row: index for index, row in enumerate(rows_of(pq.read_table(root / "mix" / "train.parquet")))
    }
    for shard in shards[:2]:
        found = [position[row] for row in rows_of(shard)]
        assert min(found) < low["rows"]["train"] // 4 and max(found) > 3 * low["rows"]["train"] // 4
    # The same seed deals the same rows; another seed others.
    again = partition_parquet(
        root / "mix" / "train.parquet",
        tmp_path / "again",
        3,
        7,
        partitioner="domain",
        params={"groups": groups},
    )
    assert again["shards"] == manifest["shards"]
    partition_parquet(
        root / "mix" / "train.parquet",
        tmp_path / "other",
        3,
        8,
        partitioner="domain",
        params={"groups": groups},
    )
    assert rows_of(pq.read_table(tmp_path / "other" / "shard-0.parquet")) != rows_of(shards[0])
    # Each part's test rows are a cell; ranks 0 and 1 weigh only part 0, rank 2 only part 1.
    params = {"groups": groups, "min_rows": 10}
    cells = domain.local(Layout(0, 3, 7), manifest["shards"], params)
    assert cells.names == ("domain 0", "domain 1")
    assert cells.weights == ((1.0, 0.0), (1.0, 0.0), (0.0, 1.0))
    assert cells.cell_of(3, {"domain": np.array([1, 0, 1])}).tolist() == [1, 0, 1]


def test_a_rank_holding_a_shared_part_and_another_weighs_them_by_its_training_rows(tmp_path):
    from shardfuse.data.partitioners import domain
    from shardfuse.data.partitioners.assignment import Layout

    shards = [
        {"value_counts": {"domain": {"0": 30}}},
        {"value_counts": {"domain": {"0": 30, "1": 90}}},
    ]
    cells = domain.local(Layout(0, 2, 0), shards, {"groups": [[0], [0, 1]], "min_rows": 10})
    assert cells.weights == ((1.0, 0.0), (0.25, 0.75))
    with pytest.raises(UserError, match=re.escape("names a part twice for rank 1 ([0, 0])")):
        domain.check("domain", {"groups": [[0], [0, 0]], "min_rows": 10}, 2, None)
    with pytest.raises(UserError, match=re.escape("lists 3 lists of parts (1, 1, 1 parts) for 2 ranks")):
        domain.check("domain", {"groups": [[0], [0], [1]], "min_rows": 10}, 2, None)


def test_mix_weights_make_the_union_train_on_each_part_in_proportion_and_leave_test_alone(tmp_path):
    from shardfuse.data.sources.domains import mixed_counts, mixed_rows

    assert mixed_counts([1, 1], [10, 30]) == [20, 20]
    assert mixed_counts([1, 2, 0], [5, 5, 5]) == [5, 10, 0]
    assert mixed_counts([1, 1, 1], [1, 1, 2]) == [2, 1, 1]  # 4/3 each: the leftover to the first
    assert mixed_counts([1e308, 1e308], [10, 30]) == [20, 20]  # no overflow near the float maximum
    assert mixed_rows(4, 10, 0, 0).tolist().count(0) in (2, 3) and len(mixed_rows(4, 10, 0, 0)) == 10
    assert np.bincount(mixed_rows(4, 10, 0, 0), minlength=4).tolist().count(3) == 2  # 2 rows thrice
    assert len(set(mixed_rows(100, 30, 0, 0).tolist())) == 30  # below its share: no row twice
    root = tmp_path / "datasets"
    low, high = prepare("low", LOW, root / "low"), prepare("high", HIGH, root / "high")
    spec = {"source": "domains", "parts": ["low", "high"], "mix_weights": [3, 1]}
    info = prepare("mix", spec, root / "mix")
    total = low["rows"]["train"] + high["rows"]["train"]
    train = pq.read_table(root / "mix" / "train.parquet")
    counts = np.bincount(train.column("domain").to_numpy(), minlength=2).tolist()
    assert counts == mixed_counts([3, 1], [low["rows"]["train"], high["rows"]["train"]])
    assert sum(counts) == total and abs(counts[0] - 3 * total / 4) <= 1
    assert info["domain_rows"]["low"]["train"] == counts[0]
    assert info["unmixed_train_rows"] == {"low": low["rows"]["train"], "high": high["rows"]["train"]}
    # low is repeated (above its share): every one of its rows is there, none dropped.
    own = {tuple(r.values()) for r in pq.read_table(root / "low" / "train.parquet").to_pylist()}
    mixed = {tuple(list(r.values())[:-1]) for r in train.to_pylist() if r["domain"] == 0}
    assert mixed == own
    for split in ("val", "test"):  # never reweighted
        assert info["rows"][split] == low["rows"][split] + high["rows"][split]
    again = prepare("again", spec, root / "again")  # seeded: the same rows every time
    assert pq.read_table(root / "again" / "train.parquet").equals(train) and again["rows"] == info["rows"]


@pytest.mark.parametrize("weights", [[1], [1, -1], [0, 0], [1, "x"], [1, float("inf")]])
def test_bad_mix_weights_are_one_line_before_any_job(weights):
    datasets = {
        "low": LOW,
        "high": HIGH,
        "mix": {"source": "domains", "parts": ["low", "high"], "mix_weights": weights},
    }
    with pytest.raises(ConfigError) as error:
        load_experiment(config(datasets), environ={})
    assert "mix_weights" in str(error.value)
    if weights == [0, 0]:  # the schema's shape is right: the source's own check
        message = "config error at datasets.mix.mix_weights: give one finite weight >= 0 per part"
        assert str(error.value).startswith(message)
