"""Big transfers over slow LAN links (tc tbf on a veth): slow is not dead.

Both ends judge liveness by whole messages heard. A message that takes longer than the
silence bound to cross a slow link (a big result to the submitter: 3 heartbeats, 3 s; a big
argument to the peer: 15 s) must not be taken for a lost peer or a silent submitter while its
bytes are still flowing.
"""

from __future__ import annotations

LAN_PEERS = 1
HEARTBEAT = 1.0


def test_a_big_result_over_a_slow_link_is_not_taken_for_a_lost_peer(lan, reliability):
    host = lan.add_host("slow-down")
    agent = lan.submitter("slow-down", host=host, heartbeat=HEARTBEAT)
    assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    assert agent.call("run", fn="where")["ok"]
    host.rate_limit("50mbit", burst="64kb", latency="500ms")  # what reaches the submitter: about 6 MB/s
    try:
        out = agent.call("run", fn="blob", args=[32], timeout=60, size_only=True)  # about 5.5 s on the wire
    finally:
        host.clear_rate_limit()
    reliability.record("slow_link_big_result", result_mib=32, link="tbf 50mbit", heartbeat_s=HEARTBEAT,
                       ok=out["ok"], error=out.get("error"), elapsed_s=round(out["elapsed"], 3))
    assert out["ok"] and out["value"] == 32 << 20, out


def test_a_big_argument_over_a_slow_link_is_not_taken_for_a_silent_submitter(lan, reliability):
    host = lan.add_host("slow-up")
    agent = lan.submitter("slow-up", host=host, heartbeat=HEARTBEAT)
    assert agent.call("wait_names", present=lan.names, timeout=10)["ok"]
    assert agent.call("run", fn="where")["ok"]
    peer = lan.peers[0]
    peer.host.rate_limit("10mbit", burst="32kb", latency="500ms")  # what reaches the peer: about 1.2 MB/s
    try:
        agent.call("submit", tag="up", fn="length", blob_mb=20, background=True)  # about 17 s on the wire
        out = agent.call("wait", tags=["up"], timeout=60)["outcomes"]["up"]
    finally:
        peer.host.clear_rate_limit()
    reliability.record("slow_link_big_argument", argument_mib=20, link="tbf 10mbit", ok=bool(out and out["ok"]),
                       error=out and out.get("error"), message=out and out.get("message"))
    assert out is not None and out["ok"] and out["value"] == 20 << 20, (out, peer.log()[-1500:])
