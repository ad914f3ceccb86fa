"""The partition stage's command line: one-line errors with no output, shards and manifest of a table and
of a token corpus."""

from __future__ import annotations

import os

import pyarrow.parquet as pq
import pytest

from shardfuse.data.manifest import read_manifest
from tests.support.data import write_grouped_rows, write_rows, write_token_split
from tests.support.helpers import run_stage


@pytest.mark.parametrize(
    ("case", "fragment"),
    [
        ("too_many_ranks", "--world-size 9 exceeds the 8 rows"),
        ("missing_input", "does not exist"),
        ("corrupt_input", "is not a readable Parquet file"),
    ],
)
def test_cli_errors_exit_2_with_one_line_and_no_output(tmp_path, case, fragment):
    input_path = tmp_path / "in.parquet"
    if case != "missing_input":
        write_rows(input_path, 8)
    if case == "corrupt_input":
        input_path.write_bytes(b"id,label\n1,2\n")
    result = run_stage("partition",
        "--input", str(input_path), "--world-size", "9" if case == "too_many_ranks" else "2",
        "--seed", "0", "--out-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("shardfuse.partition: error: ") and fragment in lines[0]
    assert not (tmp_path / "out").exists()


def test_cli_writes_shards_and_manifest(tmp_path):
    write_rows(tmp_path / "in.parquet", 21)
    result = run_stage("partition",
        "--input", str(tmp_path / "in.parquet"), "--world-size", "4", "--seed", "2", "--drop-remainder",
        "--out-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert sorted(os.listdir(tmp_path / "out")) == ["manifest.json"] + [
        f"shard-{r}.parquet" for r in range(4)
    ]
    assert [pq.read_metadata(tmp_path / "out" / f"shard-{r}.parquet").num_rows for r in range(4)] == [5] * 4


def test_cli_partitions_a_token_corpus(tmp_path):
    write_token_split(tmp_path / "in.parquet", 30)
    result = run_stage("partition",
        "--input", str(tmp_path / "in.parquet"), "--world-size", "2", "--seed", "0",
        "--out-dir", str(tmp_path / "out"),
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert read_manifest(tmp_path / "out")["columns"][0]["kind"] == "tokens"


def test_cli_deals_by_a_partitioner_and_records_its_heterogeneity(tmp_path):
    write_grouped_rows(tmp_path / "in.parquet", 600, num_classes=5, num_groups=9)
    for name, params in (("dirichlet", '{"alpha": 0.2}'), ("column", '{"column": "user"}')):
        out = tmp_path / name
        result = run_stage("partition",
            "--input", str(tmp_path / "in.parquet"), "--world-size", "3", "--seed", "1",
            "--partitioner", name, "--params-json", params, "--out-dir", str(out),
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        manifest = read_manifest(out)
        assert manifest["partition"]["name"] == name
        assert set(manifest["heterogeneity"]) == {"label_jsd_mean", "label_jsd_max", "rows_cv"}
        assert sum(shard["rows"] for shard in manifest["shards"]) == 600
    # Groups are whole on one rank each; dirichlet skews the labels, column (random labels) hardly.
    groups = [set(read_manifest(tmp_path / "column")["shards"][r]["value_counts"]["user"]) for r in range(3)]
    assert sum(map(len, groups)) == len(set().union(*groups)) == 9
    skew = {
        name: read_manifest(tmp_path / name)["heterogeneity"]["label_jsd_mean"]
        for name in ("dirichlet", "column")
    }
    assert skew["dirichlet"] > 0.1 > 0.02 > skew["column"]
