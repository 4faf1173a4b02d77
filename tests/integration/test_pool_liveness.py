"""One liveness rule for every connection of the pool (client/pool.py, ADR 0005), against a real peer on
loopback behind a relay that stalls one path: a task in flight on a lease, or through the peer itself,
whose connection then carries nothing more (it stays open), is lost by the same rule and bound, three
heartbeats of silence, and the verdict says so."""

from __future__ import annotations

import threading

import pytest

from gpulayer.client import Client
from gpulayer.errors import PeerLost
from gpulayer.matching import Requirements
from support import new_key, wait_until
from test_secure_channel import Pipe, Proxy, marked_sleep, runs

ANY = Requirements.build()
HEARTBEAT = 0.2
VERDICT = rf"no answer for [\d.]+ s \(3 heartbeats of {HEARTBEAT:g} s\)"


@pytest.fixture(scope="module")
def peer(peer_factory):
    return peer_factory("watched", "--no-mdns", "--concurrency", "2", key=new_key())


@pytest.mark.parametrize("path", ["lease", "peer"])
def test_a_stalled_lease_and_a_stalled_peer_are_lost_by_the_same_rule(peer, tmp_path, path):
    """`lease`: a task on the lease, whose connection stalls while the peer's own answers its PINGs.
    `peer`: a task through the peer (keep=True never goes on a lease), whose connection stalls."""
    stalled = threading.Event()

    def stall(pipe: Pipe, direction: str, unit: bytes) -> None:
        own = pipe is proxy.pipes[0]  # the peer's own connection opens first; the lease's later
        if not (stalled.is_set() and own == (path == "peer")):
            pipe.send(direction, unit)

    proxy = Proxy(("127.0.0.1", peer.port), stall)
    client = Client(key=peer.key.encode(), peers=proxy.address, mdns=False, echo_output=False, heartbeat=HEARTBEAT)
    try:
        wait_until(lambda: client.submit(abs, (-1,), req=ANY).result(30) and client.leases.by_peer, 20)
        lease = client.leases.by_peer[peer.peer_id]
        marker = tmp_path / "runs"
        task = client.submit(marked_sleep, (str(marker), 30.0), req=ANY, keep=path == "peer")
        wait_until(lambda: runs(marker), 10)
        assert (task in [t.future for t in lease.pending.values()]) == (path == "lease")
        stalled.set()
        with pytest.raises(PeerLost, match=VERDICT):
            task.result(20)  # three heartbeats of 0.2 s, long before the 30 s task could end
        assert runs(marker) == ["start"]
    finally:
        client.close()
        proxy.close()
