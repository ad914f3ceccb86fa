"""Partitioners: the registry's lookups and parameter checks, the counting pass, the checked deal, and
what the partition stage does with a record (iid's bytes are held by tests/unit/data/test_partition.py)."""

from __future__ import annotations

import re

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfuse.data.partitioners import iid, registry
from shardfuse.data.partitioners.assignment import Layout, Param
from shardfuse.data.partitioners.passes import count_values, dealt_ranks
from shardfuse.data.shard_format import open_parquet
from shardfuse.io import UserError
from shardfuse.partition import partition_parquet
from tests.support.data import write_rows


def by_label_parity(layout, counts, params):
    """A deal by the label's parity (2 ranks), optionally dropping label ``params['drop']``."""

    def deal(num_rows, shown):
        ranks = (shown["label"] % 2).astype(np.int64)
        ranks[shown["label"] == params["drop"]] = layout.world_size
        return ranks

    return deal


PARITY = registry.Partitioner(
    "parity",
    by_label_parity,
    "a test rule",
    {"drop": Param(-1, "an integer >= -1", lambda v: isinstance(v, int) and v >= -1)},
    columns=lambda params: ("label",),
)


@pytest.fixture
def parity(monkeypatch):
    monkeypatch.setattr(registry, "RECORDS", (*registry.RECORDS, PARITY))
    return PARITY


def test_iid_is_the_first_record_and_adds_nothing_to_a_shard_sets_identity():
    assert registry.RECORDS[0].name == registry.DEFAULT == "iid"
    assert registry.shardset_identity("iid", {}) == {}
    assert registry.RECORDS[0].columns({}) == ()


def test_iids_deal_hands_out_the_seeded_assignment_whatever_the_batch_sizes():
    layout = Layout(num_rows=1000, world_size=3, seed=5, drop_remainder=True)
    deal = iid.assign(layout, {}, {})
    dealt = np.concatenate([deal(n, {}) for n in (1, 0, 333, 7, 659)])
    assert np.array_equal(dealt, iid.rank_assignment(1000, 3, 5, True))


def test_an_unknown_partitioner_is_one_line_listing_the_known_ones(parity):
    known = "iid, dirichlet, pathological, shards, column, domain, size, continuous, parity"
    with pytest.raises(UserError, match=f"unknown partitioner 'nosuch'; use one of {known}"):
        registry.find("nosuch")


def test_params_are_filled_with_defaults_and_checked_by_the_record(parity):
    assert registry.resolve_params("parity", {}, 2) == {"drop": -1}
    assert registry.resolve_params("parity", {"drop": 3}, 2) == {"drop": 3}
    with pytest.raises(
        UserError, match=re.escape("partitioner parity has no parameter 'alpha' (valid: drop)")
    ):
        registry.resolve_params("parity", {"alpha": 0.5}, 2)
    with pytest.raises(
        UserError, match=re.escape("partitioner iid has no parameter 'alpha' (it takes none)")
    ):
        registry.resolve_params("iid", {"alpha": 0.5}, 2)
    with pytest.raises(UserError, match="parameter 'drop' must be an integer >= -1, got -3"):
        registry.resolve_params("parity", {"drop": -3}, 2)


def test_a_named_partitioner_adds_its_name_and_params_to_the_identity(parity):
    assert registry.shardset_identity("parity", {"drop": 3}) == {"partition": "parity", "partition_drop": 3}


def test_the_counting_pass_counts_each_declared_column_in_value_order_nulls_last(tmp_path):
    path = tmp_path / "in.parquet"
    pq.write_table(
        pa.table({"label": [3, 1, None, 3, 10, 1, 3], "g": list("abacaba")}), path, row_group_size=3
    )
    counts = count_values(
        open_parquet(path, "--input", "fix"), ["label", "g"], "--input", "fix", batch_size=2
    )
    assert list(counts["label"].items()) == [(1, 2), (3, 3), (10, 1), (None, 1)]
    assert counts["g"] == {"a": 4, "b": 2, "c": 1}


@pytest.mark.parametrize(
    ("ranks", "message"),
    [([0, 1], "dealt int64 ranks of shape (2,) to a batch of 3 rows"), ([0, 3, 1], "dealt ranks 0..3")],
)
def test_a_deal_that_breaks_its_contract_is_a_bug_named_with_the_partitioner(ranks, message):
    batch = pa.record_batch({"label": [0, 1, 2]})
    deal = lambda num_rows, shown: np.array(ranks, dtype=np.int64)  # noqa: E731
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        dealt_ranks("broken", deal, ["label"], 2, batch)


def test_the_stage_deals_with_the_record_and_records_it_in_the_manifest(parity, tmp_path):
    table = write_rows(tmp_path / "in.parquet", 30, num_classes=4)
    manifest = partition_parquet(
        tmp_path / "in.parquet",
        tmp_path / "out",
        2,
        0,
        batch_size=7,
        partitioner="parity",
        params={"drop": 2},
    )
    labels = table["label"].to_numpy()
    for rank in range(2):
        shard = pq.read_table(tmp_path / "out" / f"shard-{rank}.parquet")
        expected = table["id"].to_numpy()[(labels % 2 == rank) & (labels != 2)]
        assert np.array_equal(shard["id"].to_numpy(), expected)
    assert manifest["partition"] == {"name": "parity", "params": {"drop": 2}}
    assert manifest["dropped_rows"] == int((labels == 2).sum())


def test_an_iid_manifest_does_not_name_its_partitioner(tmp_path):
    write_rows(tmp_path / "in.parquet", 10)
    assert "partition" not in partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, 0)


def test_a_column_the_input_lacks_is_one_line_and_no_output(parity, tmp_path):
    pq.write_table(pa.table({"x0": [0.0, 1.0, 2.0]}), tmp_path / "in.parquet")
    with pytest.raises(
        UserError, match=r"partitioner parity reads column 'label', which --input .* does not have"
    ):
        partition_parquet(tmp_path / "in.parquet", tmp_path / "out", 2, 0, partitioner="parity")
    assert not (tmp_path / "out").exists()


def test_a_deal_that_leaves_a_rank_without_rows_is_one_line_and_no_output(parity, tmp_path):
    pq.write_table(pa.table({"label": [0, 2, 4, 1]}), tmp_path / "in.parquet")
    with pytest.raises(
        UserError,
        match=re.escape(
            "partitioner parity left rank(s) 1 without rows (shards of 3/0 rows); use fewer ranks or other "
            "partition parameters"
        ),
    ):
        partition_parquet(
            tmp_path / "in.parquet", tmp_path / "out", 2, 0, partitioner="parity", params={"drop": 1}
        )
    assert not (tmp_path / "out").exists()
