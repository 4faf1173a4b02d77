"""Many peers on one bridge with real mDNS, in CI's quick form (bench/scale.py measures N up to 64):
a fresh submitter finds all of them, a peer joining or leaving costs a bounded number of mDNS
packets, a map spreads over every peer without a thread per task, and four submitters over
unequal peers each get their work done (exactly once: tests/integration/test_work_stealing.py).
Figures of time live in bench/results/scale.json, not here."""

from __future__ import annotations

from collections import Counter

import pytest

from lanlab import why_unavailable
from scalelab import PeerSpec, ScaleLan, discovery, fairness, mdns_traffic, throughput

PEERS = 8
PER_HOST = 2  # four namespaces of two peers each
CHANGE_PACKETS_MAX = 60  # mDNS packets above the idle rate that one peer joining (or leaving) may cost
# mDNS packets that 8 idle peers and a browser may send in the 8 s idle window: bench/results/scale.json has
# 4 in 40 s; a peer announcing itself once a second would send 64
IDLE_PACKETS_MAX = 40


@pytest.fixture(scope="module")
def scale_lan(tmp_path_factory):
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    lan = ScaleLan(tmp_path_factory.mktemp("scale"), [PeerSpec(f"s{i}") for i in range(PEERS)], PER_HOST)
    yield lan
    lan.close()
    assert not lan.net.leftovers()


def test_a_fresh_submitter_sees_every_peer_and_a_map_spreads_over_them(scale_lan):
    agent, seen = discovery(scale_lan, "fresh")
    try:
        assert seen["listed"] == PEERS
        rates = throughput(agent, tasks=160, rounds=1)
        assert rates["trivial"]["tasks"] == 160
        usage = agent.call("usage")
        out = agent.call("map", fn="work", items=[0.02] * 80, reply_timeout=120)
    finally:
        agent.close()
    spread = Counter(run[0] for run in out["results"])
    assert set(spread) == {f"s{i}" for i in range(PEERS)}, spread  # every peer took a share
    # one reader thread per connected peer and per lease (at most one lease a peer, ADR 0013), plus a
    # fixed few: nothing grows with the tasks run
    assert usage["connections"] <= PEERS and usage["leases"] <= PEERS, usage
    assert usage["threads"] <= 2 * usage["connections"] + 12, usage
    assert usage["fds"] <= 4 * usage["connections"] + 32, usage


def test_a_peer_joining_or_leaving_costs_a_bounded_number_of_mdns_packets(scale_lan):
    traffic = mdns_traffic(scale_lan, idle_s=8.0, change_s=5.0)
    assert traffic["idle"]["packets"] <= IDLE_PACKETS_MAX, traffic  # an idle LAN stays quiet
    for change in ("join", "leave"):
        assert traffic[change]["packets"] >= 1, traffic  # the change was seen on the bridge
        assert traffic[change]["above_idle"] <= CHANGE_PACKETS_MAX, traffic  # no storm


def test_four_submitters_over_unequal_peers_all_get_their_work_done(tmp_path_factory):
    reason = why_unavailable()
    if reason:
        pytest.skip(reason)
    specs = [PeerSpec("f-a", 2, 1.0), PeerSpec("f-b", 1, 1.0), PeerSpec("f-c", 1, 3.0), PeerSpec("f-d", 2, 2.0)]
    lan = ScaleLan(tmp_path_factory.mktemp("fair"), specs)
    try:
        result = fairness(lan, submitters=4, tasks_each=12)
    finally:
        lan.close()
    assert not lan.net.leftovers()
    assert Counter(submitter for _, submitter, _, _ in result["timeline"]) == {i: 12 for i in range(4)}
    assert set(result["tasks_per_peer"]) == {s.name for s in specs}
    assert all(share > 0 for share in result["shares"])  # every submitter made progress while the others ran
