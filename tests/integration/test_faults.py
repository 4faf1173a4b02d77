"""Timeouts, cancels, dead workers, killed peers, retries and dead submitters, with real processes."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import new_key, process_gone, wait_until

ANY = Requirements.build()




def pid_of_task():
    return os.getpid()


def sleep_then_touch(seconds, path):
    """Note this worker's pid in `path`.pid, sleep, then create `path`."""
    with open(path + ".pid", "w") as f:
        f.write(str(os.getpid()))
    time.sleep(seconds)
    open(path, "w").close()
    return "done"


def ran_in(path) -> int:
    """The pid of the worker that ran sleep_then_touch(_, path), once it started."""
    return int(wait_until(lambda: os.path.exists(f"{path}.pid") and open(f"{path}.pid").read(), 30))


@pytest.fixture(scope="module")
def solo(peer_factory):
    """One peer with a single slot and its own cluster."""
    key = new_key()
    peer = peer_factory("solo", "--concurrency", "1", key=key)
    client = Client(key=key.encode(), echo_output=False)
    yield peer, client
    client.close()


def test_timeout_kills_the_worker_frees_the_slot_and_replaces_it(solo, tmp_path):
    peer, client = solo
    before = client.submit(pid_of_task, req=ANY).result(30)
    marker = tmp_path / "late"
    with pytest.raises(gl.TaskTimeout, match="timeout of 0.5 s"):
        client.submit(sleep_then_touch, (3, str(marker)), req=ANY, timeout=0.5).result(30)
    assert not marker.exists()  # the timeout error came before the 3 s task could end
    after = client.submit(pid_of_task, req=ANY).result(30)  # the slot is free again, on a new worker
    assert after != before
    wait_until(lambda: process_gone(ran_in(marker)), 15)
    assert not marker.exists()  # the killed task never finished


def test_cancel_stops_a_running_task_and_drops_a_queued_one(solo, tmp_path):
    peer, client = solo
    running = client.submit(sleep_then_touch, (3, str(tmp_path / "running")), req=ANY)
    queued = client.submit(sleep_then_touch, (0, str(tmp_path / "queued")), req=ANY)
    wait_until(lambda: client.peers()[0]["busy"] == 1)
    assert queued.cancel() and running.cancel()
    assert running.cancelled() and queued.cancelled()
    assert client.submit(pid_of_task, req=ANY).result(30)  # the slot came back (a queued task would run first)
    wait_until(lambda: process_gone(ran_in(tmp_path / "running")), 15)
    assert not (tmp_path / "running").exists() and not (tmp_path / "queued").exists()


def test_a_worker_that_dies_fails_its_task_and_the_peer_lives_on(solo):
    peer, client = solo

    def crash():
        os.kill(os.getpid(), signal.SIGSEGV)

    with pytest.raises(gl.WorkerDied, match="SIGSEGV"):
        client.submit(crash, req=ANY).result(30)
    assert client.submit(lambda: 41 + 1, req=ANY).result(30) == 42
    assert peer.alive()


def slow_where(seconds):
    time.sleep(seconds)
    return os.environ["GPULAYER_PEER_NAME"]


def busy_on(client, name):
    return [r for r in client.peers() if r["name"] == name][0]["busy"] == 1


def test_sigkill_of_a_peer_mid_task_gives_peer_lost_within_seconds(cluster):
    client, peers = cluster("first", "second")
    doomed = client.submit(slow_where, (30,), req=Requirements.build(peer="first"))
    wait_until(lambda: busy_on(client, "first"))
    peers["first"].kill()
    with pytest.raises(gl.PeerLost, match="first") as lost:
        doomed.result(30)
    assert "no answer" not in str(lost.value)  # the socket reset at once, before the heartbeat found silence
    # zeroconf still lists the dead peer, but it is marked down and new work goes elsewhere
    assert client.submit(slow_where, (0,), req=ANY).result(30) == "second"
    assert {r["name"]: r["state"] for r in client.peers()} == {"first": "down", "second": "up"}


def test_retry_moves_a_task_to_another_peer_when_its_peer_dies(cluster):
    client, peers = cluster("one", "two")
    future = client.submit(slow_where, (3,), req=ANY, retries=1)
    wait_until(lambda: future.peer)
    victim = future.peer
    wait_until(lambda: busy_on(client, victim))
    peers[victim].kill()
    survivor = future.result(30)
    assert survivor != victim and survivor in peers


SUBMITTER = textwrap.dedent("""
    import sys, time
    from gpulayer.client import Client
    from gpulayer.matching import Requirements

    def sleep_then_touch(seconds, path):
        import os, time
        with open(path + ".pid", "w") as f:
            f.write(str(os.getpid()))
        time.sleep(seconds)
        open(path, "w").close()

    client = Client(key=sys.argv[1].encode(), echo_output=False)
    client.submit(sleep_then_touch, (3, sys.argv[2]), req=Requirements.build())
    print("submitted", flush=True)
    time.sleep(60)
""")


def test_the_peer_cancels_the_tasks_of_a_submitter_that_died(solo, tmp_path):
    peer, client = solo
    marker = tmp_path / "orphan"
    proc = subprocess.Popen([sys.executable, "-c", SUBMITTER, peer.key, str(marker)], stdout=subprocess.PIPE,
                            env={**os.environ})
    try:
        assert proc.stdout.readline().strip() == b"submitted"
        wait_until(lambda: client.peers()[0]["busy"] == 1)
        proc.kill()
        wait_until(lambda: client.peers()[0]["busy"] == 0, timeout=10)
        wait_until(lambda: process_gone(ran_in(marker)), 15)
        assert not marker.exists()
    finally:
        proc.kill()
        proc.wait()
