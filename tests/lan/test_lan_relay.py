"""A slow and lossy path: a 500-task gl.map through a fault-injecting relay, on the static-peer path.

This kernel has no tc netem, so delay and cuts come from tests/lan/lan_relay.py, which runs in
the submitter's namespace (on its loopback) in front of each peer; tc tbf limits the rate of
each peer's link. The submitter has mDNS off and GPULAYER_PEERS set to the relay's ports.
"""

from __future__ import annotations

import statistics
from collections import Counter

import pytest
from lanlab import RelayProcess, runs
from support import wait_until

LAN_PEERS = 4
DELAY_MS = 2.0
TASKS = 500


@pytest.fixture(scope="module")
def relayed(lan):
    """A submitter host whose relay fronts every peer of the LAN (with 2 ms each way)."""
    for peer in lan.peers:
        peer.host.rate_limit("50mbit")
    host = lan.add_host("relay-sub")
    relay = RelayProcess(host, [("127.0.0.1:0", p.address) for p in lan.peers], delay_ms=DELAY_MS, seed=20260)
    yield host, relay
    relay.close()


def relay_agent(lan, host, relay, label):
    static = ",".join(f"127.0.0.1:{port}" for port in relay.ports)
    agent = lan.submitter(label, host=host, mdns=False, peers=static, heartbeat=1.0)
    listed = agent.call("wait_names", present=lan.names, timeout=15)
    assert listed["ok"], listed
    assert {r["source"] for r in listed["records"]} == {"static"}
    assert {r["address"] for r in listed["records"]} == {f"127.0.0.1:{p}" for p in relay.ports}
    return agent


def test_500_tasks_through_added_delay_rate_limits_random_cuts_and_a_stall(lan, relayed, reliability, tmp_path):
    host, relay = relayed
    agent = relay_agent(lan, host, relay, "relay-agent")

    # the delay is real: a round trip gains twice DELAY_MS
    latencies = [agent.call("run", fn="echo", args=[i])["elapsed"] for i in range(15)]
    round_trip_ms = statistics.median(latencies) * 1000
    assert round_trip_ms >= 2 * DELAY_MS, latencies

    # 1. delay and rate limits alone: no retries needed, nothing lost
    out = agent.call("map", fn="square", items=list(range(TASKS)), retries=0, reply_timeout=180)
    assert out["ok"], out
    assert out["results"] == [x * x for x in range(TASKS)]
    calm_seconds = out["elapsed"]

    # 2. and now, now and then, a busy connection is cut (reset both ways), and one stalls
    marks = tmp_path / "marks"
    marks.mkdir()
    relay.call("chaos", cut_prob=1.0, every=[1.5, 2.5], max_cuts=6, stalls=1, stall_after=0.5, min_age=0.1,
               active_within=0.5, max_seconds=60)
    out = agent.call("map", fn="marked", items=list(range(TASKS)), extra=[0.12, str(marks)], retries=3,
                     reply_timeout=240)
    stats = relay.call("calm")["stats"]
    assert out["ok"], (out, stats)
    results = out["results"]
    assert [r[:2] for r in results] == [[x, x * x] for x in range(TASKS)]
    tokens = [r[3] for r in results]
    assert len(set(tokens)) == TASKS  # one run delivered per item
    all_runs = runs(marks)
    ends = {r["token"]: r for r in all_runs if r["kind"] == "end"}
    assert all(ends[t]["item"] == x and ends[t]["peer"] == r[2] for x, (t, r) in enumerate(zip(tokens, results)))
    begun = Counter(r["item"] for r in all_runs if r["kind"] == "start")
    completed = Counter(r["item"] for r in all_runs if r["kind"] == "end")
    cuts, stalls = sum(stats["cuts"]), sum(stats["stalls"])
    assert cuts >= 3 and stalls == 1, stats
    assert sum(begun.values()) > TASKS  # the faults did hit running tasks, which ran again elsewhere
    reliability.record(
        "relay_delay_cuts_stall", peers=len(lan.peers), tasks=2 * TASKS, tasks_completed=2 * TASKS, duplicates=0,
        lost=0, delay_ms_each_way=DELAY_MS, rate_limit="tc tbf 50mbit on every peer link",
        median_round_trip_ms=round(round_trip_ms, 2), calm_map_s=round(calm_seconds, 3),
        faulty_map_s=round(out["elapsed"], 3), retries=3,
        faults_injected={"connection_cuts": cuts, "stalls": stalls},
        relay_connections=sum(stats["connections"]), runs_begun=sum(begun.values()),
        runs_completed=sum(completed.values()), tasks_run_again=sum(1 for n in begun.values() if n > 1))


def test_a_momentary_reset_of_every_connection_leaves_reachable_peers_usable(lan, relayed, reliability):
    """Every connection is reset at once (a blip: a NAT or Wi-Fi hiccup); every peer stays reachable.

    The very next submit should reconnect and run. A reset is not a dead peer: connecting again
    would tell at once (a dead host refuses or times out, and is marked down then).
    """
    host, relay = relayed
    agent = relay_agent(lan, host, relay, "blip-agent")
    out = agent.call("map", fn="where", items=list(range(40)), reply_timeout=60)
    assert out["ok"] and set(out["results"]) == set(lan.names), out
    before = set(agent.call("open_connections")["ids"])
    relay.call("cut_all")
    wait_until(lambda: not before & set(agent.call("open_connections")["ids"]), 10)  # the submitter saw the resets
    # at once: reconnecting takes about 0.014 s (bench/results/reliability.json); a peer taken for dead would
    # be skipped for 5 s (DOWN_BACKOFF), past this bound of 2 s
    first = agent.call("run", fn="where", timeout=2.0)
    reliability.record("connection_reset_blip", faults_injected={"connection_cuts": len(lan.peers)},
                       first_submit_after_s=round(first["elapsed"], 3), first_submit_ok=first["ok"],
                       first_submit_error=first.get("error"))
    assert first["ok"], first
