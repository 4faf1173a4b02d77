"""Liveness on every path and the peer's limits, against real peers on loopback (issue 9).

A peer known only from the cache is watched like any other (a frozen one gives PeerLost); a
cache whose peers are all stale falls back to discovery; a peer out of file descriptors backs
off and warns a bounded number of times, then serves again; bad keys are refused with the fix.
"""

from __future__ import annotations

import json
import os
import resource
import signal
import socket
import subprocess
import sys
import time

import pytest

from gpulayer import discovery
from gpulayer.client import Client
from gpulayer.errors import PeerLost
from gpulayer.matching import Requirements
from support import PeerProcess, holds_for, new_key, wait_until

ANY = Requirements.build()


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("GPULAYER_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "gpulayer" / "peers.json"


def cached_peer(peer_factory, name: str) -> tuple[str, PeerProcess]:
    """A peer without mDNS of a fresh cluster, in the cache after a first submitter used it."""
    key = new_key()
    peer = peer_factory(name, "--no-mdns", key=key)
    first = Client(key=key.encode(), peers=peer.address, mdns=False, echo_output=False)
    try:
        assert first.submit(os.getpid, req=ANY).result(30)
    finally:
        first.close()
    return key, peer


def test_a_frozen_peer_served_from_the_cache_gives_peer_lost_within_seconds(peer_factory, cache_dir):
    key, peer = cached_peer(peer_factory, "frozen")
    assert oct(cache_dir.stat().st_mode & 0o777) == "0o600"
    client = Client(key=key.encode(), mdns=False, echo_output=False, heartbeat=0.5)  # the cache is all it knows
    try:
        future = client.submit(time.sleep, (60,), req=ANY)
        wait_until(lambda: client.pool.own, 10)
        os.kill(peer.pid, signal.SIGSTOP)
        with pytest.raises(PeerLost, match="no answer"):  # the heartbeat's verdict, long before the 60 s task ends
            future.result(10)  # 3 heartbeats of 0.5 s of silence, plus the check's period: about 2 s
    finally:
        os.kill(peer.pid, signal.SIGCONT)
        client.close()


def test_a_cache_of_stale_peers_falls_back_to_discovery(peer_factory, cache_dir):
    key, gone = cached_peer(peer_factory, "gone")
    gone.stop()
    peer_factory("announced", key=key)  # findable by mDNS on loopback only
    client = Client(key=key.encode(), echo_output=False, discovery_timeout=5)
    try:
        assert client.submit(lambda: os.environ["GPULAYER_PEER_NAME"], req=ANY).result(30) == "announced"
    finally:
        client.close()


def test_the_cache_keeps_proved_peers_for_a_day(peer_factory, cache_dir):
    key, peer = cached_peer(peer_factory, "kept")
    cached = json.loads(cache_dir.read_text())
    entries = next(iter(cached.values()))
    assert [e["txt"]["n"] for e in entries] == ["kept"]
    peer.stop()

    def idle_client() -> list[dict]:
        """The cache after a client that only read it, proved nothing, and exits."""
        idle = Client(key=key.encode(), mdns=False, echo_output=False, discovery_timeout=0.2)
        idle.start()
        idle.close()
        return next(iter(json.loads(cache_dir.read_text()).values()))

    assert [e["txt"]["n"] for e in idle_client()] == ["kept"]  # nothing disproved it: kept, as it was proved
    for entry in entries:
        entry["proved"] = time.time() - discovery.CACHE_KEEP_S - 60  # last proved over a day ago
    cache_dir.write_text(json.dumps(cached))
    assert idle_client() == []


class FewDescriptorsPeer(PeerProcess):
    """A peer whose hard limit on open files is low, so that a flood of connections exhausts it."""

    limit = 64

    def _popen(self, log) -> subprocess.Popen:
        def lower() -> None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (self.limit, self.limit))

        return subprocess.Popen(self.argv, env=self.env, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, preexec_fn=lower)


def test_out_of_descriptors_the_peer_backs_off_warns_rarely_then_serves_again(tmp_path):
    key = new_key()
    peer = FewDescriptorsPeer(tmp_path, key, "starved", "--no-mdns", "--concurrency", "1").start()
    flood: list[socket.socket] = []
    try:
        for _ in range(3 * FewDescriptorsPeer.limit):
            flood.append(socket.create_connection(("127.0.0.1", peer.port), timeout=5))
        wait_until(lambda: "accept failed" in peer.log(), 30)  # it ran out of descriptors
        # it keeps failing to accept, backing off, and says so once in 3 s (at most once every 10 s)
        holds_for(lambda: peer.alive() and peer.log().count("accept failed") == 1, 3.0)
        assert os.path.getsize(peer.log_file) < 1 << 20  # no spinning loop of warnings
    finally:
        for sock in flood:
            sock.close()
    client = Client(key=key.encode(), peers=peer.address, mdns=False, echo_output=False)
    try:
        result = wait_until(lambda: _try(client), 20)
        assert result == 42
    finally:
        client.close()
        peer.stop(timeout=10)
        peer.kill()


def _try(client: Client):
    try:
        return client.submit(lambda: 42, req=ANY).result(10)
    except Exception:
        return None


def _cli(env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "gpulayer.cli", "peers", "--wait", "0"], env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o666])
def test_a_key_file_others_can_read_is_refused_with_the_fix(tmp_path, mode):
    config = tmp_path / "config"
    path = config / "gpulayer" / "key"
    path.parent.mkdir(parents=True)
    path.write_text(new_key() + "\n")
    path.chmod(mode)
    env = {k: v for k, v in os.environ.items() if k != "GPULAYER_KEY"}
    out = _cli({**env, "XDG_CONFIG_HOME": str(config)})
    assert out.returncode != 0
    assert f"chmod 600 {path}" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize("key", ["a", "password", "0123456789abcdef"])
def test_a_short_key_is_refused_with_a_clear_error(key):
    out = _cli({**os.environ, "GPULAYER_KEY": key})
    assert out.returncode != 0
    assert "at least 128" in out.stderr and "Traceback" not in out.stderr
