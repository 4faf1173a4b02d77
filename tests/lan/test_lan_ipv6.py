"""IPv6 (issue 30, item 3): peers advertise, and submitters browse, on IPv6 as well as IPv4: global
addresses and link-local ones, which a browser takes with the scope of the interface that heard them.
On a bridge with IPv6 only (fd77::/64 and link-local, no IPv4 address at all) discovery and a task work;
on a dual-stack one the advert carries both families."""

from __future__ import annotations

import ast
import sys

import pytest

from lanlab import lan_env, new_lan
from support import new_key

RESOLVE = """
from gpulayer import mdns
print(sorted(set(mdns.every_peer(3.0))))
"""


@pytest.fixture
def lan6(tmp_path):
    """lan6(ipv4) -> a LAN with IPv6 addresses (and IPv4 ones when `ipv4`), removed after the test."""
    made = []

    def make(ipv4: bool):
        made.append(new_lan(tmp_path / f"lan{len(made)}", ipv4=ipv4, ipv6=True))
        return made[-1]

    yield make
    for lan in made:
        lan.close()
        assert not lan.leftovers()


def advertised(host, port: int) -> list[str]:
    """The addresses at `port` that an mDNS browse from `host` resolves."""
    done = host.run([sys.executable, "-c", RESOLVE], env=lan_env(None), timeout=60)
    assert done.returncode == 0, done.stderr
    return [address for address, at in ast.literal_eval(done.stdout) if at == port]


def peer_and_submitter(lan, name: str):
    """A peer `name` on a host of `lan`, a submitter's host beside it, the key, and what that host resolves."""
    key = new_key()
    peer = lan.add_host(name).start_peer(name, key, 1).wait_ready()
    submitter = lan.add_host(f"s-{name}")
    return peer, submitter, key, advertised(submitter, peer.port)


def test_on_an_ipv6_only_lan_a_submitter_finds_a_peer_and_runs_a_task(lan6):
    peer, submitter, key, found = peer_and_submitter(lan6(ipv4=False), "p6")
    assert f"fd77::{peer.host.index:x}" in found, found
    assert any(a.startswith("fe80::") and "%" in a for a in found), found  # link-local, with our scope
    assert not any("." in a for a in found), found
    agent = submitter.agent(key, name="s6")
    agent.call("configure")
    seen = agent.call("wait_names", present=["p6"], timeout=10)
    assert seen["ok"], seen["records"]
    ran = agent.call("run", fn="where", peer="p6")
    assert ran["ok"] and ran["value"] == "p6", ran
    [row] = agent.call("names")["records"]
    assert row["verified"] and row["address"].startswith("["), row  # it connected over IPv6


def test_on_a_dual_stack_lan_the_advert_carries_both_families_and_a_task_runs(lan6):
    peer, submitter, key, found = peer_and_submitter(lan6(ipv4=True), "p46")
    assert {peer.host.ip, f"fd77::{peer.host.index:x}"} <= set(found), found
    assert not any(a.startswith("127.") or a == "::1" for a in found), found  # never loopback on a LAN
    agent = submitter.agent(key, name="s46")
    agent.call("configure")
    ran = agent.call("run", fn="where", peer="p46")
    assert ran["ok"] and ran["value"] == "p46", ran


def test_a_peer_on_two_lans_advertises_on_each_only_that_interfaces_addresses(tmp_path):
    a = new_lan(tmp_path / "a", subnet="10.77.1.", prefix_len=24)
    b = new_lan(tmp_path / "b", subnet="10.77.2.", prefix_len=24)
    try:
        router = a.add_router(b)
        peer = router.start_peer("two-legs", new_key(), 1).wait_ready()
        on_a = advertised(a.add_host("listener-a"), peer.port)
        on_b = advertised(b.add_host("listener-b"), peer.port)
        assert [x for x in on_a if "." in x] == [router.ip], on_a  # RFC 6762 section 6.2
        assert len([x for x in on_b if "." in x]) == 1 and all(x.startswith("10.77.2.") for x in on_b if "." in x), on_b
        assert not set(on_a) & set(on_b), (on_a, on_b)  # link-local ones too: each interface its own
    finally:
        a.close()  # first: the router is its host, and its leg on b's bridge goes with it
        b.close()
    assert not a.leftovers() and not b.leftovers()
