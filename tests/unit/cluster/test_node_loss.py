"""Which nodes a failed multi-node step lost for good (shardfuse.cluster.node_loss), against SLURM's
answers played back (scontrol and sinfo): the real cluster is tests/services/test_multinode.py."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from shardfuse.cluster.membership import Membership
from shardfuse.cluster.node_loss import lost_nodes, not_responding, ranks_on
from shardfuse.cluster.torchrun import Geometry
from shardfuse.io import UserError
from shardfuse.rank.failure import read_hosts, record_host
from shardfuse.rank.loss import survivors_command


class Cluster:
    """scontrol/sinfo played from a script of states: one (job's node list, {node: sinfo state}) per
    poll; the clock advances 5 s a poll."""

    def __init__(self, script: list[tuple[str, dict[str, str]]]):
        self.script, self.poll, self.now = script, 0, 0.0

    def state(self):
        return self.script[min(self.poll, len(self.script) - 1)]

    def run(self, command, **kwargs):
        nodelist, states = self.state()
        if command[:3] == ["scontrol", "show", "hostnames"]:
            names = command[3].replace("node[1-2]", "node1,node2").split(",")
            out = "\n".join(names)
        elif command[:3] == ["scontrol", "show", "job"]:
            out = f"JobId=7 JobState=RUNNING NodeList={nodelist} NumNodes=2"
        elif command[0] == "sinfo":
            asked = command[command.index("-n") + 1].split(",")
            out = "\n".join(f"{node} {states[node]}" for node in asked if node in states)
        else:
            raise AssertionError(command)
        return subprocess.CompletedProcess(command, 0, out, "")

    def sleep(self, seconds):
        self.poll += 1
        self.now += 5

    def lost(self, timeout=20.0):
        said = []
        found = lost_nodes(
            "7", ["node1", "node2"], timeout, self.run, self.sleep, lambda: self.now, said.append
        )
        return found, said


def test_a_node_slurm_took_out_of_the_job_is_lost_at_once():
    found, said = Cluster([("node1", {"node1": "mixed", "node2": "down*"})]).lost()
    assert found == ["node2"] and said == []


def test_every_node_in_the_job_and_answering_is_no_node_loss():
    assert Cluster([("node[1-2]", {"node1": "mixed", "node2": "mixed"})]).lost() == ([], [])


def test_a_silent_node_that_answers_again_within_the_timeout_is_not_lost():
    cluster = Cluster(
        [
            ("node[1-2]", {"node1": "mixed", "node2": "mixed*"}),
            ("node[1-2]", {"node1": "mixed", "node2": "mixed*"}),
            ("node[1-2]", {"node1": "mixed", "node2": "mixed"}),
        ]
    )
    found, said = cluster.lost()
    assert found == [] and cluster.poll == 2
    assert said == [
        "launch: node(s) node2 of SLURM job 7 not responding; waiting up to 20 s (node_timeout) for them "
        "to come back"
    ]


def test_a_silent_node_is_lost_when_the_timeout_runs_out_or_slurm_takes_it_out():
    silent = ("node[1-2]", {"node1": "mixed", "node2": "idle*"})
    cluster = Cluster([silent])
    assert cluster.lost(timeout=12)[0] == ["node2"] and cluster.now >= 12
    cluster = Cluster([silent, ("node1", {"node1": "mixed", "node2": "down*"})])
    assert cluster.lost(timeout=600)[0] == ["node2"] and cluster.poll == 1


def test_sinfo_states_that_mean_a_node_does_not_answer():
    states = {"a": "idle", "b": "mixed*", "c": "down", "d": "draining", "e": "allocated", "f": "fail"}
    run = Cluster([("a", states)]).run
    assert not_responding(states, run) == {"b", "c", "f"}
    assert not_responding([], run) == set()


def test_each_rank_records_its_node_and_a_lost_node_takes_its_ranks(tmp_path, monkeypatch):
    for rank, node in [(0, "node1"), (1, "node1"), (2, "node2"), (3, "node2")]:
        monkeypatch.setenv("SLURMD_NODENAME", node)
        record_host(tmp_path, rank)
    hosts = read_hosts(tmp_path)
    assert hosts == {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    assert ranks_on(["node2"], hosts) == [2, 3] and ranks_on([], hosts) == []


def test_the_survivors_go_on_on_the_nodes_left_with_a_rendezvous_port_of_their_own(tmp_path: Path):
    membership = Membership.full(6).lose(4, 10, 0).lose(5, 10, 0)  # node3's two ranks
    environ = {"SLURM_JOB_ID": "20001", "SLURM_JOB_NODELIST": "node[1-3]"}
    geometry, cmd = survivors_command(
        membership, tmp_path, ["--config-json", "{}"], environ, 0, Geometry(3, 2), ["node1", "node2"]
    )
    assert geometry == Geometry(2, 2)
    assert cmd[:3] == ["srun", "--export=ALL,SHARDFUSE_RDZV_PORT=20003", "--nodelist=node1,node2"]
    assert "--nodes=2" in cmd and "--nproc-per-node=2" in cmd and "--membership" in cmd
    # One node left: the batch host runs the ranks itself.
    one = Membership.full(4).lose(2, 10, 0).lose(3, 10, 0)
    geometry, cmd = survivors_command(one, tmp_path, [], environ, 0, Geometry(2, 2), ["node1"])
    assert geometry == Geometry(1, 2) and "--standalone" in cmd
    # Ranks that do not fill whole nodes cannot be laid out on them.
    uneven = Membership.full(6).lose(5, 10, 0)
    with pytest.raises(UserError, match="5 ranks are alive, not 2 on each of 3 node"):
        survivors_command(uneven, tmp_path, [], environ, 0, Geometry(3, 2), ["node1", "node2", "node3"])


def _staging(tmp_path: Path, hosts: dict[int, str], step: int) -> Path:
    from shardfuse.rank.checkpoint_steps import COMPLETE

    for rank, node in hosts.items():
        (tmp_path / "failures").mkdir(parents=True, exist_ok=True)
        (tmp_path / "failures" / f"host-{rank}.txt").write_text(node + "\n")
    (tmp_path / "checkpoints" / f"step-{step}").mkdir(parents=True)
    (tmp_path / "checkpoints" / f"step-{step}" / COMPLETE).write_text("")
    return tmp_path


def test_a_lost_node_loses_its_ranks_and_the_rest_go_on_or_too_few_are_one_line(
    tmp_path, monkeypatch, capsys
):
    from shardfuse.rank import loss

    config = ["--config-json", '{"strategy": "localsgd", "sync_every": 0}']
    hosts = {0: "node1", 1: "node1", 2: "node2", 3: "node2"}
    staging = _staging(tmp_path / "a", hosts, 40)
    monkeypatch.setattr(loss, "lost_nodes", lambda job, nodes, timeout, say: ["node2"])
    survivors, left = loss.survivors_after_node_loss(
        Membership.full(4), staging, config, 2, "7", ["node1", "node2"], 30, 2
    )
    assert survivors.lost_ranks == (2, 3) and left == ["node1"] and survivors.steps_discarded == 80
    assert (staging / "membership.json").is_file() and not (staging / "failures").exists()
    assert "launch: node(s) node2 lost for good" in capsys.readouterr().err
    too_few = "node(s) node2 were lost for good with rank(s) 2, 3 and only 2 of 4 ranks are left"
    with pytest.raises(UserError, match=re.escape(too_few)):
        loss.survivors_after_node_loss(
            Membership.full(4), _staging(tmp_path / "b", hosts, 40), config, 3, "7", ["node1", "node2"], 30, 2
        )
    # No node lost (a rank's own failure), or no rank known to have run there: reported as always.
    monkeypatch.setattr(loss, "lost_nodes", lambda job, nodes, timeout, say: [])
    staging = _staging(tmp_path / "c", hosts, 40)
    assert (
        loss.survivors_after_node_loss(Membership.full(4), staging, config, 2, "7", ["node1", "node2"], 30, 2)
        is None
    )
    monkeypatch.setattr(loss, "lost_nodes", lambda job, nodes, timeout, say: ["node3"])
    assert (
        loss.survivors_after_node_loss(Membership.full(4), staging, config, 2, "7", ["node1", "node2"], 30, 2)
        is None
    )
