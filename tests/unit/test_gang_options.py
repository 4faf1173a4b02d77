"""Gangs without peers (issue 29): the nodes= option's checks, the rendezvous variables and MLX's ring
hostfile, and which address each rank's peer is reached at."""

from __future__ import annotations

import json

import pytest

import gpulayer as gl
from gpulayer import distributed
from gpulayer.distributed import rank_addresses
from gpulayer.task_options import TaskOptions


@pytest.mark.parametrize("nodes", [0, -1, True, 2.0, "2"])
def test_nodes_is_a_positive_integer(nodes):
    with pytest.raises(ValueError, match="nodes must be a positive integer"):
        TaskOptions.parse({"nodes": nodes})


@pytest.mark.parametrize("other", [{"keep": True}, {"peer": "p1"}])
def test_a_gang_takes_neither_keep_nor_peer(other):
    with pytest.raises(ValueError, match="keep= and peer= do not apply"):
        TaskOptions.parse({"nodes": 2, **other})


def test_nodes_makes_no_gang_of_a_map_nor_of_an_actor():
    with pytest.raises(ValueError, match="use gl.run or gl.submit, not gl.map"):
        gl.map(abs, [1, 2], nodes=2)
    with pytest.raises(ValueError, match="not of an actor"):
        gl.remote(nodes=2)(type("Model", (), {}))


def test_the_rendezvous_of_each_rank():
    addresses, ports = ["10.77.0.2", "10.77.0.3", "10.77.0.4"], [(5001, 6001), (5002, 6002), (5003, 6003)]
    ranks = [distributed.rendezvous(rank, addresses, ports) for rank in range(3)]
    assert [r["RANK"] for r in ranks] == ["0", "1", "2"] == [r["MLX_RANK"] for r in ranks]
    assert {(r["WORLD_SIZE"], r["LOCAL_RANK"], r["LOCAL_WORLD_SIZE"]) for r in ranks} == {("3", "0", "1")}
    assert {(r["MASTER_ADDR"], r["MASTER_PORT"]) for r in ranks} == {("10.77.0.2", "5001")}  # rank 0's store
    assert [r["GPULAYER_RANK_ADDR"] for r in ranks] == addresses
    assert json.loads(ranks[2]["MLX_HOSTFILE"]) == [["10.77.0.2:6001"], ["10.77.0.3:6002"], ["10.77.0.4:6003"]]


def test_a_rank_reached_on_loopback_gets_another_address_when_the_gang_spans_hosts():
    assert rank_addresses([["127.0.0.1"], ["127.0.0.1"]]) == ["127.0.0.1", "127.0.0.1"]  # one host
    assert rank_addresses([["127.0.0.1", "10.77.0.2"], ["10.77.0.3"]]) == ["10.77.0.2", "10.77.0.3"]
    assert rank_addresses([["10.77.0.2", "127.0.0.1"], ["10.77.0.3"]]) == ["10.77.0.2", "10.77.0.3"]


def test_init_outside_a_gang_says_where_it_runs(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(RuntimeError, match=r"inside a rank of a gang: gl.run\(fn, nodes=N\)"):
        gl.distributed.init()
