"""Discovery over real zeroconf on loopback: appear, disappear, down, other clusters, static peers, cache."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.client.jobs import Jobs
from gpulayer.matching import Requirements
from support import holds_for, new_key

ANY = Requirements.build()


def seen_names(client: Client) -> set[str]:
    return {r.advert.name for r in client.directory.records()}


def wait_for(client: Client, predicate, timeout: float) -> float:
    """Seconds until predicate(names) holds; fails after `timeout`."""
    started = time.monotonic()
    assert client.directory.wait_for(lambda _: predicate(seen_names(client)), timeout), seen_names(client)
    return time.monotonic() - started


def test_a_new_peer_appears_and_a_stopped_one_disappears_quickly(peer_factory, record_property):
    key = new_key()
    client = Client(key=key.encode(), echo_output=False)
    client.start()
    try:
        peer = peer_factory("latecomer", key=key, wait=False)
        peer.wait_ready()
        appeared = wait_for(client, lambda names: "latecomer" in names, 5)
        record_property("appeared_s", appeared)  # the announcement, sent without probing: about 1 ms
        assert client.submit(lambda: "hi", req=ANY).result(30) == "hi"
        assert peer.stop() == 0
        gone = wait_for(client, lambda names: "latecomer" not in names, 5)
        record_property("disappeared_s", gone)  # the goodbye: about 1 ms
    finally:
        client.close()


def test_fresh_submitters_find_a_running_peer_fast_even_back_to_back(peer_factory):
    """The one-shot legacy unicast query is answered at once, even within mDNS's one-second rate limit."""
    key = new_key()
    peer_factory("veteran", key=key)
    for _ in range(3):  # back to back: a multicast answer to the browser would be held back here
        client = Client(key=key.encode(), echo_output=False)
        try:
            client.start()
            # a browser's multicast question alone would wait >= 1 s here (the rate limit)
            assert wait_for(client, lambda names: "veteran" in names, 5) < 0.9
        finally:
            client.close()


def test_a_killed_peer_is_shown_down_and_skipped(cluster):
    client, peers = cluster("doomed", "healthy")
    client.start()
    wait_for(client, lambda names: {"doomed", "healthy"} <= names, 5)
    peers["doomed"].kill()
    states = {row["name"]: row["state"] for row in client.peers(wait=0)}
    assert states == {"doomed": "down", "healthy": "up"}  # zeroconf still lists it; our probe does not
    for _ in range(4):
        assert client.submit(lambda: os.environ["GPULAYER_PEER_NAME"], req=ANY).result(30) == "healthy"


def test_peers_of_another_cluster_are_neither_listed_nor_used(peer_factory):
    ours, theirs = new_key(), new_key()
    peer_factory("ours", key=ours)
    peer_factory("theirs", key=theirs)
    client = Client(key=ours.encode(), echo_output=False)
    try:
        client.start()
        wait_for(client, lambda names: "ours" in names, 5)
        holds_for(lambda: seen_names(client) == {"ours"}, 1.5)  # 1.5 s: past the browser's second query
        assert [r["name"] for r in client.peers(wait=0)] == ["ours"]
        with pytest.raises(gl.NoMatchingPeer):
            client.submit(lambda: 1, req=Requirements.build(peer="theirs"))
    finally:
        client.close()


def test_static_peers_work_without_multicast(peer_factory):
    key = new_key()
    peer = peer_factory("static", "--no-mdns", key=key)
    client = Client(key=key.encode(), peers=f"{peer.address},127.0.0.1:9", mdns=False, echo_output=False)
    try:
        assert client.submit(lambda: "via static", req=ANY).result(30) == "via static"
        rows = {row["name"]: row for row in client.peers(wait=0)}
        assert rows["static"]["state"] == "up" and rows["static"]["source"] == "static"
        assert rows["127.0.0.1:9"]["state"] == "down"
    finally:
        client.close()


def test_a_second_connection_to_a_peer_does_not_cut_the_tasks_of_the_first(peer_factory):
    """GPULAYER_PEERS naming a peer that mDNS also finds: the static probe connects while a task runs."""
    key = new_key()
    peer = peer_factory("twice", key=key)
    client = Client(key=key.encode(), peers=peer.address, echo_output=False)
    try:
        running = client.submit(time.sleep, (1.0,), req=ANY)
        host, port = peer.address.rsplit(":", 1)
        client.pool.probe_static((host, int(port)))  # what start() does for each static peer, now while a task runs
        assert running.result(30) is None  # the task's connection was not replaced
        assert client.submit(lambda: "still up", req=ANY).result(30) == "still up"
    finally:
        client.close()


def test_the_peer_cache_is_used_by_a_fresh_process_and_verified_on_connect(peer_factory, tmp_path, monkeypatch):
    key = new_key()
    peer = peer_factory("cached", "--no-mdns", key=key)
    monkeypatch.setenv("GPULAYER_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Client(key=key.encode(), peers=peer.address, mdns=False, echo_output=False)
    assert first.submit(lambda: 1, req=ANY).result(30) == 1
    first.close()
    cache = json.loads((tmp_path / "gpulayer" / "peers.json").read_text())
    assert [e["txt"]["n"] for e in next(iter(cache.values()))] == ["cached"]

    fresh = [sys.executable, "-c", "import os, gpulayer as gl; print(gl.run(os.getpid) > 0)"]
    env = {**os.environ, "GPULAYER_KEY": key, "GPULAYER_DISCOVERY_TIMEOUT": "0.5"}
    # the fast path: the cached peer is used at once, with no wait for mDNS; a submitter that waited for
    # it would wait its whole discovery timeout (600 s) and run past this call's 60 s
    out = subprocess.run(fresh, env={**env, "GPULAYER_DISCOVERY_TIMEOUT": "600"}, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "True", out.stderr

    peer.stop()  # the cached entry is now stale: it is verified, dropped, and the error is clear
    out = subprocess.run(fresh, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode != 0 and "NoMatchingPeer" in out.stderr


def test_a_submit_that_used_a_cached_peer_keeps_the_cache(peer_factory, tmp_path, monkeypatch):
    """`gpulayer submit` ends before discovery starts (it tried the cached peer first): the peer that its
    handshake proved, and the cached peers it never asked, stay in the cache for the next process."""
    key = new_key()
    used, other = peer_factory("used", "--no-mdns", key=key), peer_factory("other", "--no-mdns", key=key)
    monkeypatch.setenv("GPULAYER_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Client(key=key.encode(), peers=f"{used.address},{other.address}", mdns=False, echo_output=False)
    assert first.submit(lambda: 1, req=ANY).result(30) == 1
    first.wait_for_match(Requirements.build(peer="other"))
    first.close()
    cache = tmp_path / "gpulayer" / "peers.json"

    def cached() -> list[str]:
        return sorted(e["txt"]["n"] for e in next(iter(json.loads(cache.read_text()).values())))

    assert cached() == ["other", "used"]
    out = subprocess.run([sys.executable, "-m", "gpulayer", "submit", "--peer", "used", "--", "true"],
                         env={**os.environ, "GPULAYER_KEY": key}, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert cached() == ["other", "used"]


def test_a_job_goes_past_a_stale_cached_peer_to_one_that_discovery_finds(peer_factory, tmp_path, monkeypatch):
    """A cached peer is tried before discovery starts (client/pool.py); when it is gone, the submit waits for
    discovery (here the static peer's probe) once more instead of failing with the cache's peers alone."""
    key = new_key()
    gone, live = peer_factory("gone", "--no-mdns", key=key), peer_factory("live", "--no-mdns", key=key)
    monkeypatch.setenv("GPULAYER_CACHE", "1")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    first = Client(key=key.encode(), peers=gone.address, mdns=False, echo_output=False)
    assert first.submit(lambda: 1, req=ANY).result(30) == 1
    first.close()  # the cache now names "gone" alone
    gone.stop()
    client = Client(key=key.encode(), peers=live.address, mdns=False, echo_output=False)
    try:
        job = Jobs(client).submit(["true"], None, ANY)
        assert job.peer == "live"
        assert job.wait(60) == "succeeded"
    finally:
        client.close()
