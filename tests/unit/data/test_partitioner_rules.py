"""The partitioners of issue 48 through the real partition stage: every row in exactly one shard, the
same bytes from the same seed, partition_min_rows held, the manifest's counts those of the shards, and
each rule's meaning (Flower Datasets' semantics; bench/partition.py compares the rows with Flower's)."""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from shardfuse.data.heterogeneity import heterogeneity, jensen_shannon, manifest_heterogeneity
from shardfuse.data.manifest import read_manifest
from shardfuse.data.partitioners import continuous
from shardfuse.data.partitioners.assignment import Layout
from shardfuse.data.shard_format import recognise_layout
from shardfuse.io import UserError
from shardfuse.partition import partition_parquet
from tests.support.data import write_grouped_rows

WORLD_SIZE = 4
# Parameters under which no rule drops a row (4 classes: 2 per rank, deterministic, cover them all;
# 2000 rows cut into 8 whole shards).
RULES = {
    "dirichlet": {"alpha": 0.5},
    "pathological": {"classes_per_rank": 2, "assignment": "deterministic"},
    "shards": {"shards_per_rank": 2},
    "column": {"column": "user"},
    "size": {"sizes": [0.1, 0.2, 0.3, 0.4]},
    "continuous": {"column": "x0", "strictness": 0.8},
}


@pytest.fixture(scope="module")
def grouped(tmp_path_factory) -> tuple[Path, pa.Table]:
    path = tmp_path_factory.mktemp("grouped") / "train.parquet"
    return path, write_grouped_rows(path, 2000, num_classes=4)


def partition(source: Path, out: Path, name: str, params: dict, seed: int = 3, batch_size: int = 65536):
    return partition_parquet(
        source, out, WORLD_SIZE, seed, batch_size=batch_size, partitioner=name, params=params
    )


def shard_tables(out: Path) -> list[pa.Table]:
    return [pq.read_table(out / f"shard-{rank}.parquet") for rank in range(WORLD_SIZE)]


def row_digests(table: pa.Table) -> Counter:
    return Counter(
        hashlib.sha256(repr(sorted(row.items())).encode()).hexdigest() for row in table.to_pylist()
    )


@pytest.mark.parametrize("name", sorted(RULES))
def test_every_training_row_lands_in_exactly_one_shard(name, grouped, tmp_path):
    source, table = grouped
    manifest = partition(source, tmp_path / "out", name, RULES[name])
    shards = row_digests(pa.concat_tables(shard_tables(tmp_path / "out")))
    assert shards == row_digests(table)
    assert manifest["dropped_rows"] == 0 and manifest["total_rows"] == table.num_rows


@pytest.mark.parametrize("name", sorted(RULES))
def test_the_same_seed_gives_the_same_bytes_whatever_the_read_batches(name, grouped, tmp_path):
    source, _ = grouped
    first = partition(source, tmp_path / "a", name, RULES[name], batch_size=97)
    again = partition(source, tmp_path / "b", name, RULES[name], batch_size=4096)
    other = partition(source, tmp_path / "c", name, RULES[name], seed=4)
    digests = [[shard["sha256"] for shard in m["shards"]] for m in (first, again, other)]
    assert digests[0] == digests[1]
    assert first == again  # the manifest too
    # column's seed only orders groups of equal size (these have none); deterministic classes take none
    if name not in ("column", "pathological"):
        assert digests[0] != digests[2]


@pytest.mark.parametrize("name", sorted(RULES))
def test_partition_min_rows_holds_or_the_stage_refuses_naming_it(name, grouped, tmp_path):
    source, _ = grouped
    manifest = partition(source, tmp_path / "ok", name, {**RULES[name], "min_rows": 150})
    assert min(shard["rows"] for shard in manifest["shards"]) >= 150
    with pytest.raises(UserError, match="partition_min_rows 1900"):
        partition(source, tmp_path / "no", name, {**RULES[name], "min_rows": 1900})
    assert not (tmp_path / "no").exists()


def test_dirichlet_draws_eleven_times_then_names_alpha_and_the_minimum(grouped, tmp_path):
    source, _ = grouped
    with pytest.raises(
        UserError,
        match=r"partitioner dirichlet: 11 draws with partition_alpha 0.01 each left a rank under "
        r"partition_min_rows 600 \(the last: shards of",
    ):  # 4 classes of ~500 rows, each almost whole on one rank: a rank gets 0 or about 500
        partition(source, tmp_path / "out", "dirichlet", {"alpha": 0.01, "min_rows": 600})


@pytest.mark.parametrize("name", sorted(RULES))
def test_the_manifests_counts_equal_a_recount_of_the_shards(name, grouped, tmp_path):
    source, _ = grouped
    manifest = partition(source, tmp_path / "out", name, RULES[name])
    tables = shard_tables(tmp_path / "out")
    for shard, table in zip(manifest["shards"], tables, strict=True):
        assert shard["rows"] == table.num_rows
        labels = Counter(table["label"].to_pylist())
        assert shard["label_counts"] == {str(k): labels[k] for k in sorted(labels)}
        if name == "column":
            users = Counter(table["user"].to_pylist())
            assert shard["value_counts"] == {"user": {str(k): users[k] for k in sorted(users)}}
        else:
            assert "value_counts" not in shard
    # An independent recount: JSD from its definition, the CV from the rows.
    pooled = Counter(label for table in tables for label in table["label"].to_pylist())
    total = sum(pooled.values())
    divergences = []
    for table in tables:
        own = Counter(table["label"].to_pylist())
        jsd = 0.0
        for label in pooled:
            p, q = own[label] / table.num_rows, pooled[label] / total
            m = (p + q) / 2
            jsd += (p * np.log2(p / m) if p else 0) / 2 + (q * np.log2(q / m)) / 2
        divergences.append(jsd)
    rows = np.array([table.num_rows for table in tables])
    recorded = manifest["heterogeneity"]
    assert recorded["label_jsd_mean"] == pytest.approx(np.mean(divergences), abs=1e-12)
    assert recorded["label_jsd_max"] == pytest.approx(max(divergences), abs=1e-12)
    assert recorded["rows_cv"] == pytest.approx(rows.std() / rows.mean(), abs=1e-12)
    assert manifest["partition"]["name"] == name


def test_a_group_column_travels_in_the_shards_as_data_not_as_a_model_input(grouped, tmp_path):
    source, _ = grouped
    partition(source, tmp_path / "out", "column", {"column": "user"})
    schema = pq.read_schema(tmp_path / "out" / "shard-0.parquet")
    assert "user" in schema.names
    assert recognise_layout(schema, "shard-0").feature_names == ["x0", "x1"]


@pytest.mark.parametrize(
    ("assignment", "classes"),
    [("blocks", [{0, 1, 2, 3, 4}, {5, 6, 7, 8, 9}]), ("deterministic", [{0, 1, 2, 3, 4}, {1, 2, 3, 4, 5}])],
)
def test_pathological_blocks_are_disjoint_and_deterministic_windows_overlap_as_flowers(
    assignment, classes, tmp_path
):
    write_grouped_rows(tmp_path / "in.parquet", 1000, num_classes=10)
    partition_parquet(
        tmp_path / "in.parquet", tmp_path / "out", 2, 0, partitioner="pathological",
        params={"classes_per_rank": 5, "assignment": assignment},
    )  # fmt: skip
    labels = [
        set(pq.read_table(tmp_path / "out" / f"shard-{r}.parquet")["label"].to_pylist()) for r in (0, 1)
    ]
    assert labels == classes


def test_pathological_drops_exactly_the_rows_of_classes_no_rank_has(tmp_path):
    table = write_grouped_rows(tmp_path / "in.parquet", 1000, num_classes=10)
    manifest = partition_parquet(
        tmp_path / "in.parquet", tmp_path / "out", 2, 0, partitioner="pathological",
        params={"classes_per_rank": 3, "assignment": "deterministic"},
    )  # fmt: skip
    kept = {0, 1, 2, 3}  # rank 0: 0, 1, 2; rank 1: 1, 2, 3 (class 1 and 2 split between them)
    labels = table["label"].to_numpy()
    assert manifest["dropped_rows"] == int((~np.isin(labels, list(kept))).sum())
    shard_labels = [
        pq.read_table(tmp_path / "out" / f"shard-{r}.parquet")["label"].to_pylist() for r in (0, 1)
    ]
    assert set(shard_labels[0]) == {0, 1, 2} and set(shard_labels[1]) == {1, 2, 3}


def test_a_smaller_alpha_skews_the_labels_more(grouped, tmp_path):
    source, _ = grouped
    jsd = {
        alpha: partition(source, tmp_path / str(alpha), "dirichlet", {"alpha": alpha})["heterogeneity"]
        for alpha in (0.1, 100.0)
    }
    assert jsd[0.1]["label_jsd_mean"] > 0.2 > 0.01 > jsd[100.0]["label_jsd_mean"]


def test_continuous_at_strictness_one_sorts_the_ranks_by_the_column(grouped, tmp_path):
    source, _ = grouped
    partition(source, tmp_path / "out", "continuous", {"column": "x1", "strictness": 1.0})
    values = [
        pq.read_table(tmp_path / "out" / f"shard-{r}.parquet")["x1"].to_numpy() for r in range(WORLD_SIZE)
    ]
    assert [len(v) for v in values] == [500] * WORLD_SIZE
    assert all(values[r].max() <= values[r + 1].min() for r in range(WORLD_SIZE - 1))


def test_size_by_a_law_gives_shares_proportional_to_the_rank_and_the_rest_to_the_last(grouped, tmp_path):
    source, _ = grouped
    manifest = partition(source, tmp_path / "out", "size", {"law": "linear"})
    assert [shard["rows"] for shard in manifest["shards"]] == [200, 400, 600, 800]


@pytest.mark.parametrize("strictness", [1.0, 0.5])
def test_continuous_cuts_where_a_stable_sort_of_the_scores_would(strictness):
    """The radix select and the tie rule against a brute force: scores recomputed here, sorted stably,
    cut by np.array_split's sizes. Integer values at strictness 1 make long runs of equal scores."""
    rng = np.random.default_rng(0)
    values = rng.integers(0, 5, 1003).astype(np.float64)
    batches = [values[i : i + 77] for i in range(0, len(values), 77)]
    layout = Layout(len(values), 3, seed=11, scan=lambda: ({"v": b} for b in batches))
    deal = continuous.assign(layout, {}, {"column": "v", "strictness": strictness, "min_rows": 1})
    ranks = np.concatenate([deal(len(b), {"v": b}) for b in batches])

    z = (values - values.mean()) / values.std()
    scores = strictness * z + (1 - strictness) * np.random.default_rng(11).standard_normal(len(values))
    expected = np.empty(len(values), dtype=np.int64)
    for rank, rows in enumerate(np.array_split(np.argsort(scores, kind="stable"), 3)):
        expected[rows] = rank
    assert np.array_equal(ranks, expected)


@pytest.mark.parametrize(
    ("name", "params", "message"),
    [
        ("column", {"column": "x0"}, "groups rows by the values of column 'x0', which holds floating-point"),
        ("column", {"column": "user", "groups": [[0], [1], [99], [3]]}, "partition_groups names 99, which"),
        ("pathological", {"classes_per_rank": 5}, "partition_classes_per_rank 5 is more than the 4 classes"),
        ("continuous", {"column": "user", "strictness": 0.5}, None),
    ],
)
def test_what_only_the_data_can_tell_is_refused_at_partition_time_in_one_line(
    name, params, message, grouped, tmp_path
):
    source, _ = grouped
    if message is None:  # an integer column is a numeric column: continuous takes it
        partition(source, tmp_path / "out", name, params)
        return
    with pytest.raises(UserError, match=message):
        partition(source, tmp_path / "out", name, params)
    assert not (tmp_path / "out").exists()


def test_column_refuses_fewer_groups_than_ranks(tmp_path):
    write_grouped_rows(tmp_path / "in.parquet", 200, num_groups=3)
    with pytest.raises(
        UserError, match="column 'user' holds 3 groups, fewer than the 4 ranks; use at most 3"
    ):
        partition(tmp_path / "in.parquet", tmp_path / "out", "column", {"column": "user"})


def test_jensen_shannon_is_zero_for_equal_and_one_for_disjoint_distributions():
    assert jensen_shannon(np.array([0.5, 0.5]), np.array([0.5, 0.5])) == 0.0
    assert jensen_shannon(np.array([1.0, 0.0]), np.array([0.0, 1.0])) == pytest.approx(1.0)
    numbers = heterogeneity(
        [{"rows": 10, "label_counts": {"0": 10}}, {"rows": 30, "label_counts": {"1": 30}}]
    )
    assert numbers["label_jsd_max"] == pytest.approx(
        jensen_shannon(np.array([1.0, 0]), np.array([0.25, 0.75]))
    )
    assert numbers["rows_cv"] == pytest.approx(0.5)
    assert heterogeneity([{"rows": 5}, {"rows": 5}]) == {
        "label_jsd_mean": None,
        "label_jsd_max": None,
        "rows_cv": 0.0,
    }


def test_an_iid_manifest_keeps_its_bytes_and_a_reader_computes_its_heterogeneity(grouped, tmp_path):
    source, _ = grouped
    manifest = partition_parquet(source, tmp_path / "out", WORLD_SIZE, 0)
    assert "heterogeneity" not in manifest and "value_counts" not in manifest["shards"][0]
    numbers = manifest_heterogeneity(manifest)
    assert numbers["label_jsd_max"] < 0.01 and numbers["rows_cv"] == 0.0


def test_string_groups_and_many_classes_deal_alike_whatever_the_read_batches(tmp_path):
    """The other paths of the deal: groups that are strings (no lookup table), and 60 classes, which a
    batch of 20 rows deals by a pass per class and one of 4000 rows by a sort."""
    rng = np.random.default_rng(5)
    table = pa.table(
        {
            "id": np.arange(3000),
            "x0": rng.normal(size=3000).astype(np.float32),
            "site": [f"site-{i}" for i in rng.integers(0, 50, 3000)],
            "label": rng.integers(0, 60, 3000),
        }
    )
    pq.write_table(table, tmp_path / "in.parquet", row_group_size=700)
    for name, params in (("column", {"column": "site"}), ("dirichlet", {"alpha": 1.0, "min_rows": 1})):
        small = partition(tmp_path / "in.parquet", tmp_path / f"{name}-a", name, params, batch_size=20)
        large = partition(tmp_path / "in.parquet", tmp_path / f"{name}-b", name, params, batch_size=4000)
        assert small == large
        tables = shard_tables(tmp_path / f"{name}-a")
        assert row_digests(pa.concat_tables(tables)) == row_digests(table)
    sites = [set(t["site"].to_pylist()) for t in shard_tables(tmp_path / "column-a")]
    assert sum(map(len, sites)) == 50  # every site whole on one rank


def test_a_manifest_with_malformed_group_rows_is_refused_by_its_reader(grouped, tmp_path):
    source, _ = grouped
    partition(source, tmp_path / "out", "column", {"column": "user"})
    path = tmp_path / "out" / "manifest.json"
    manifest = json.loads(path.read_text())
    assert read_manifest(tmp_path / "out")["shards"][0]["value_counts"]["user"]
    manifest["shards"][1]["value_counts"] = {"user": {"3": "many"}}
    path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match=r"has a malformed shards\[1\].value_counts"):
        read_manifest(tmp_path / "out")


def test_a_rank_dealt_a_small_share_of_every_batch_does_not_hold_the_batches(tmp_path):
    """Slices keep their read batch alive: a writer given a few rows of many batches copies them out
    past W pieces, so what it holds is its own rows, not the batches they were cut from."""
    from concurrent.futures import ThreadPoolExecutor

    from shardfuse.data.shard_writer import BackgroundWrites, ShardWriter

    big = pa.record_batch(
        {"x0": np.zeros(100_000, dtype=np.float32), "label": np.zeros(100_000, dtype=np.int64)}
    )
    writes = BackgroundWrites()
    with ThreadPoolExecutor(1) as hashers:
        writer = ShardWriter(tmp_path / "s.parquet", big.schema, 10_000, writes, hashers, max_borrowed=4)
        for _ in range(20):  # 20 batches of 1.2 MB, 10 rows dealt to this rank from each
            writer.add(pa.record_batch(big.columns, schema=big.schema).slice(500, 10))
        held = sum(piece.get_total_buffer_size() for piece in writer.pending)
        assert writer.num_pending == 200 and held < 4 * big.get_total_buffer_size()
        writer.flush()
        writes.finish()
        writer.close()
    assert pq.read_metadata(tmp_path / "s.parquet").num_rows == 200
