"""gather.json as a typed record: what gather writes reads back equal, every entry's type is checked
with the entry named, the fields a stage reads must be there, and keys of a newer gather are kept."""

from __future__ import annotations

import json
import re

import pytest

from shardfuse.checkpoints.gather_record import GatheredRank, GatherRecord
from shardfuse.checkpoints.trust import read_gather
from shardfuse.cluster.membership import Membership
from shardfuse.io import UserError

RANK = {"rank": 0, "path": "ranks/rank-0.safetensors", "sha256": "a" * 64, "blake3": "b" * 64, "bytes": 10,
        "rows": 7, "num_steps": 3}  # fmt: skip
GATHER = {
    "format_version": 2, "hash": "blake3", "run": "t", "world_size": 1, "strategy": "localsgd",
    "model": {"model": "mlp"}, "base": "ranks/base.safetensors", "num_parameters": 5,
    "tensors": {"w": {"shape": [5], "dtype": "F32"}}, "ranks": [RANK],
}  # fmt: skip


def test_a_gather_json_reads_back_as_written_key_for_key():
    record = GatherRecord.from_json(GATHER)
    assert record.ranks == (GatheredRank(**RANK),) and record.checksum_algorithm == "blake3"
    assert (record.rows, record.rank_numbers, record.adapted) == ([7], [0], False)
    assert list(record.to_json()) == list(GATHER) and record.to_json() == GATHER


def test_a_newer_gathers_keys_are_kept_and_written_back_last():
    data = {**GATHER, "coverage": {"alive": [0]}, "ranks": [{**RANK, "replica": 0}]}
    record = GatherRecord.from_json(data)
    assert record.extra == {"coverage": {"alive": [0]}} and record.ranks[0].extra == {"replica": 0}
    assert record.to_json() == data and list(record.to_json())[-1] == "coverage"


@pytest.mark.parametrize(
    ("data", "need_in_ranks", "fragment"),
    [
        ({**GATHER, "world_size": "1"}, (), "'world_size' is a string, not an integer"),
        ({**GATHER, "ranks": [{**RANK, "rows": True}]}, (), "'ranks[0].rows' is a boolean, not an integer"),
        ({**GATHER, "ranks": [{k: v for k, v in RANK.items() if k != "rows"}]}, ("rows",),
         "'ranks[0].rows' is missing, not an integer"),
        ({**GATHER, "ranks": [{k: v for k, v in RANK.items() if k != "blake3"}]}, (),
         "'ranks[0].blake3' is missing, not a string"),  # the digest `hash` names is always read
        ({**GATHER, "ranks": []}, (), "lists no ranks"),
        ({**GATHER, "format_version": 3}, (), "has format version 3, newer than this shardfuse reads (2)"),
        ({**GATHER, "hash": "md5"}, (), "'hash' is 'md5', not one of sha256, blake3"),
    ],
)  # fmt: skip
def test_a_wrong_entry_is_named_with_gather_as_the_fix(data, need_in_ranks, fragment):
    with pytest.raises(UserError, match="re-run gather") as caught:
        GatherRecord.from_json(data, "g/gather.json", need_in_ranks=need_in_ranks)
    assert fragment in str(caught.value) and str(caught.value).startswith("g/gather.json")


def test_after_a_lost_rank_gather_json_lists_the_survivors_and_no_fewer_than_min_ranks(tmp_path):
    """A training that lost rank 1 of 3 (shardfuse.rank.loss): its gather.json lists ranks 0 and 2; a
    file that lists others, or fewer survivors than the min_ranks the training went on with, is refused
    before any checkpoint is opened."""
    lost = Membership.full(3).lose(1, 40, 40).to_json()
    ranks = [{**RANK, "rank": r, "path": f"ranks/rank-{r}.safetensors"} for r in (0, 2)]
    path = tmp_path / "gather.json"
    path.write_text(json.dumps({**GATHER, "world_size": 3, "ranks": ranks, "membership": lost}))
    with pytest.raises(UserError, match=r"is missing or changed since gather|does not exist|is not"):
        read_gather(path)  # past the rank checks: on to the files, which this test does not write
    path.write_text(json.dumps({**GATHER, "world_size": 3, "ranks": [*ranks[:1], {**ranks[1], "rank": 1}],
                                "membership": lost}))  # fmt: skip
    with pytest.raises(
        UserError, match=re.escape("lists ranks [0, 1] but its membership has ranks [0, 2] alive")
    ):
        read_gather(path)
    path.write_text(
        json.dumps({**GATHER, "world_size": 3, "ranks": ranks, "membership": {**lost, "min_ranks": 3}})
    )
    with pytest.raises(
        UserError, match=re.escape("lists 2 surviving rank(s) but the training went on only with min_ranks 3")
    ):
        read_gather(path)
