"""A peer's mDNS instance name stays the same across restarts (issue 30, item 4): the peer keeps a tag
in its state folder (discovery.kept_tag), so a browser that watches through a restart, even one without
a goodbye (kill -9), sees one service that now points at the new port, not a second one beside the
first, which it would list for as long as its record lives. A second peer of the same name, with a
state folder of its own, gets a name of its own."""

from __future__ import annotations

import threading

import pytest
from zeroconf import ServiceBrowser, ServiceStateChange, Zeroconf

from gpulayer.discovery import SERVICE_TYPE
from support import PeerProcess, new_key, wait_until


@pytest.fixture
def browser():
    """(zeroconf, names): a browse of GPUlayer services on loopback, and the names it heard added."""
    zc = Zeroconf(interfaces=["127.0.0.1"])
    names: set[str] = set()
    lock = threading.Lock()

    def heard(zeroconf, service_type, name, state_change):
        if state_change is ServiceStateChange.Added:
            with lock:
                names.add(name)

    browse = ServiceBrowser(zc, SERVICE_TYPE, handlers=[heard])
    yield zc, names
    browse.cancel()
    zc.close()


def steady(names: set[str]) -> set[str]:
    """The names of the peers called "steady" among `names`."""
    return {name for name in set(names) if name.startswith("steady-")}


def port_of(zc: Zeroconf, name: str) -> int | None:
    info = zc.get_service_info(SERVICE_TYPE, name, timeout=1000)
    return info.port if info is not None else None


def test_a_peer_keeps_its_instance_name_across_a_restart_and_a_twin_gets_its_own(tmp_path, browser):
    zc, names = browser
    key = new_key()
    peers = [PeerProcess(tmp_path, key, "steady", "--concurrency", "1", "--state-dir", str(tmp_path / "state"))]
    try:
        first = peers[0].start()
        [instance] = wait_until(lambda: steady(names), 10)
        assert first.peer_id not in instance and first.info["instance"] == instance

        first.kill()  # no goodbye: the browser keeps the record
        again = first.start()
        assert wait_until(lambda: port_of(zc, instance) == again.port, 10)
        assert steady(names) == {instance}

        (tmp_path / "twin").mkdir()
        peers.append(PeerProcess(tmp_path / "twin", key, "steady", "--concurrency", "1", "--state-dir",
                                 str(tmp_path / "twin" / "state")))
        twin = peers[-1].start()
        assert wait_until(lambda: len(steady(names)) == 2, 10)
        assert steady(names) - {instance} == {twin.info["instance"]}
    finally:
        for peer in peers:
            peer.stop(timeout=10)
            peer.kill()
