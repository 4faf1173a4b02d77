"""Across hosts, with real mDNS multicast between namespaces: zero-config discovery, spreading,
peers joining and leaving, and clusters that share a LAN without seeing each other."""

from __future__ import annotations

import time
from collections import Counter

from support import new_key

LAN_PEERS = 3
APPEAR_BOUND = 5.0  # seconds
DISAPPEAR_BOUND = 5.0


def test_a_submitter_with_no_configuration_finds_every_peer_and_map_spreads_over_them(lan, reliability):
    agent = lan.submitter("zero-config")  # only GPULAYER_KEY: no interfaces, no peers, no cache
    seen = agent.call("wait_names", present=lan.names, timeout=10)
    assert seen["ok"], seen["records"]
    records = seen["records"]
    assert {r["name"] for r in records} == set(lan.names)
    assert all(r["source"] == "mdns" and r["address"].startswith("10.77.") for r in records)
    assert {r["address"] for r in records} == {p.address for p in lan.peers}  # across the bridge, not loopback

    out = agent.call("map", fn="square_where", items=list(range(120)), extra=[0.02], reply_timeout=180)
    assert out["ok"], out
    assert [r[:2] for r in out["results"]] == [[x, x * x] for x in range(120)]
    spread = Counter(r[2] for r in out["results"])
    assert set(spread) == set(lan.names), spread  # every peer took a share
    assert min(spread.values()) >= 10, spread
    reliability.record("discovery_zero_config", peers=len(lan.peers), discovered_s=round(seen["elapsed"], 4),
                       map_tasks=120, spread=dict(spread), tasks_completed=120, duplicates=0, lost=0)


def test_a_late_peer_shows_up_and_a_cleanly_stopped_one_disappears(lan, reliability):
    agent = lan.submitter("watcher")
    assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    launched = time.time()
    late = lan.start_peer("late", wait=False)
    late.wait_ready()
    # the peer announces itself before it writes its ready file, so the submitter lists it by then or just
    # after: it did 0.45 s before the ready file, 1.6 s after the launch (bench/results/reliability.json,
    # discovery_join_leave); APPEAR_BOUND, the wait's timeout, is an order of magnitude above
    seen = agent.call("wait_names", present=["late"], timeout=APPEAR_BOUND)
    assert seen["ok"], seen["records"]
    after_launch = seen["wall"] - launched
    after_ready = seen["wall"] - late.ready_file.stat().st_mtime
    ran = agent.call("run", fn="where", peer="late")
    assert ran["ok"] and ran["value"] == "late", ran

    assert late.stop() == 0
    # SIGTERM -> goodbye -> removed from the submitter's directory: 0.005 s after the stop
    # (bench/results/reliability.json, discovery_join_leave); without a goodbye zeroconf would list it
    # for about 19 minutes, far past DISAPPEAR_BOUND, the wait's timeout
    gone = agent.call("wait_names", absent=["late"], timeout=DISAPPEAR_BOUND)
    assert gone["ok"], gone["records"]
    out = agent.call("map", fn="where", items=list(range(30)), reply_timeout=180)
    assert out["ok"] and set(out["results"]) <= set(lan.names), out  # nothing is sent to the departed peer
    reliability.record("discovery_join_leave", appeared_after_launch_s=round(after_launch, 3),
                       appeared_after_ready_file_s=round(after_ready, 4),
                       note="launch includes the peer's ~2 s interpreter probe; the ready file is written after "
                            "zeroconf's announcements, so the submitter lists the peer before it (negative); "
                            "disappeared_s counts from the end of the peer's clean stop",
                       disappeared_s=round(gone["elapsed"], 4), bound_s=APPEAR_BOUND,
                       faults_injected={"clean_stop": 1})


def test_clusters_sharing_a_lan_neither_list_nor_use_each_others_peers(lan, reliability):
    other_key = new_key()
    lan.start_peer("stranger", key=other_key)
    ours = lan.submitter("ours")
    theirs = lan.submitter("theirs", key=other_key)
    mine = ours.call("wait_names", present=lan.names, timeout=10)
    assert mine["ok"]
    own = theirs.call("wait_names", present=["stranger"], timeout=10)
    assert own["ok"]
    # the other side's adverts are on the wire: give both browsers time to hear all of them
    ours.call("peers", wait=1.5)
    assert {r["name"] for r in ours.call("names")["records"]} == set(lan.names)
    assert {r["name"] for r in theirs.call("names")["records"]} == {"stranger"}

    out = ours.call("map", fn="where", items=list(range(60)), reply_timeout=180)
    assert out["ok"] and set(out["results"]) <= set(lan.names), out
    out = theirs.call("map", fn="where", items=list(range(20)), reply_timeout=180)
    assert out["ok"] and set(out["results"]) == {"stranger"}, out
    # pinned to a peer of the other cluster: no match, with a reason, and nothing runs there
    refused = ours.call("run", fn="where", peer="stranger")
    assert not refused["ok"] and refused["error"] == "NoMatchingPeer", refused
    reliability.record("cluster_isolation", clusters=2, foreign_peers_listed=0, foreign_tasks_run=0,
                       tasks_completed=80)
