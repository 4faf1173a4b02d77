"""Seeds and gossip across two subnets joined by a router that forwards unicast but not multicast: a
submitter in subnet A with one seed in A learns the peers of subnet B from the lists of verified peers
(ADR 0017) and runs tasks there; a peer that dies drops out of every list."""

from __future__ import annotations

import json
import sys
from collections import Counter

import pytest
from lanlab import lan_env, new_lan
from support import new_key, wait_until

from gpulayer.protocol.messages import AGE_OUT
from gpulayer.peer.gossip import GOSSIP_ROUND

LEARN_BOUND = 2.0  # seconds for a fresh submitter with one seed to list every peer (issue 30): the wait's timeout
DROP_BOUND = AGE_OUT + 3 * GOSSIP_ROUND  # a dead peer's last verification ages out, and each list's next round
LIST = """
import json, socket, sys, time
from gpulayer.protocol import handshake, messages
from gpulayer.transport.blocking import BlockingConnection
conn = BlockingConnection(socket.create_connection((sys.argv[1], int(sys.argv[2])), 5))
handshake.client_handshake(conn, sys.argv[3].encode(), "lister")
conn.send({"t": messages.PEERS, "id": 1})
reply, _ = conn.recv(time.monotonic() + 5)
print(json.dumps([peer_id for peer_id, _, _ in messages.check_peers(reply)[0]]))
"""


class Subnets:
    def __init__(self, tmp):
        self.key = new_key()
        self.a = new_lan(tmp / "a", subnet="10.77.1.", prefix_len=24)
        self.b = new_lan(tmp / "b", subnet="10.77.2.", prefix_len=24)
        self.a.add_router(self.b)
        a1, a2 = (self.a.add_host(name).start_peer(name, self.key, 1) for name in ("a1", "a2"))
        a1.wait_ready()
        b1 = self.b.add_host("b1").start_peer("b1", self.key, 1, args=("--seed", a1.address))
        b1.wait_ready()
        b2 = self.b.add_host("b2").start_peer("b2", self.key, 1, args=("--seed", b1.address))
        self.peers = {p.name: p.wait_ready() for p in (a1, a2, b1, b2)}

    def listed(self, holder: str) -> set[str]:
        """The names of the peers in `holder`'s list (asked from its own host, with the key)."""
        peer = self.peers[holder]
        done = peer.host.run([sys.executable, "-c", LIST, peer.host.ip, str(peer.port), self.key], env=lan_env(None))
        assert done.returncode == 0, done.stderr
        ids = set(json.loads(done.stdout))
        return {name for name, p in self.peers.items() if p.peer_id in ids}

    def close(self):
        self.a.close()  # first: the router is its host, and its leg on b's bridge goes with it
        self.b.close()


@pytest.fixture(scope="module")
def subnets(tmp_path_factory):
    net = Subnets(tmp_path_factory.mktemp("subnets"))
    try:
        # the cluster's own lists converge first: b2 told b1 of itself, b1 told a1
        wait_until(lambda: net.listed("a1") >= {"a1", "b1", "b2"}, 30, interval=0.5)
        yield net
    finally:
        net.close()
    assert not net.a.leftovers() and not net.b.leftovers()


def test_a_submitter_with_one_seed_in_its_subnet_learns_and_uses_the_peers_beyond_the_router(subnets):
    host = subnets.a.add_host("submitter")
    agent = host.agent(subnets.key, name="seeded")
    agent.call("configure", peers=subnets.peers["a1"].address)
    seen = agent.call("wait_names", present=["a1", "a2", "b1", "b2"], timeout=LEARN_BOUND)
    assert seen["ok"], seen["records"]
    rows = {r["name"]: r for r in seen["records"]}
    assert rows["b1"]["source"] == rows["b2"]["source"] == "gossip" and rows["b1"]["verified"] and rows["b2"]["verified"]
    assert rows["b2"]["address"] == subnets.peers["b2"].address  # reached through the router
    assert not {"b1", "b2"} & {name.split("-")[0] for name in agent.call("heard")["names"]}  # no mDNS crossed

    shown = host.run([sys.executable, "-m", "gpulayer", "peers", "--wait", str(LEARN_BOUND)],
                     env=lan_env(subnets.key, GPULAYER_PEERS=subnets.peers["a1"].address))
    found = {line.split()[0]: line.split()[3] for line in shown.stdout.splitlines()[1:]}  # NAME ... FOUND
    assert found == {"a1": "static", "a2": "mdns", "b1": "gossip", "b2": "gossip"}, shown.stdout + shown.stderr

    ran = agent.call("run", fn="where", peer="b2")
    assert ran["ok"] and ran["value"] == "b2", ran
    out = agent.call("map", fn="square_where", items=list(range(40)), extra=[0.05], reply_timeout=180)
    assert out["ok"], out
    assert {"b1", "b2"} <= set(Counter(r[2] for r in out["results"])), out["results"]


def test_a_peer_that_dies_drops_out_of_every_list_and_out_of_the_submitters_directory(subnets):
    host = subnets.a.add_host("watcher")
    agent = host.agent(subnets.key, name="watcher")
    agent.call("configure", peers=subnets.peers["a1"].address)
    assert agent.call("wait_names", present=["b1", "b2"], timeout=LEARN_BOUND)["ok"]
    assert all("b2" in subnets.listed(holder) for holder in ("a1", "b1"))
    subnets.peers["b2"].kill()
    gone = agent.call("wait_names", absent=["b2"], timeout=DROP_BOUND)
    assert gone["ok"], gone["records"]
    for holder in ("a1", "b1"):
        wait_until(lambda holder=holder: "b2" not in subnets.listed(holder), DROP_BOUND, interval=0.5)
    assert "b1" in subnets.listed("a1")  # the living stay
    assert agent.call("names")["records"] and "b2" not in {r["name"] for r in agent.call("names")["records"]}
