"""SIGTERM withdraws the mDNS record first, then lets the running task finish; a second signal cancels."""

from __future__ import annotations

import signal
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements


def nap(seconds):
    time.sleep(seconds)
    return "finished"


def started(client: Client, name: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        if any(r["name"] == name and r["busy"] for r in client.peers(wait=0)):
            return
        time.sleep(0.05)
    raise AssertionError("the task never started")


def test_sigterm_withdraws_first_then_drains_the_running_task(cluster):
    client, peers = cluster("drainer")
    peer = peers["drainer"]
    future = client.submit(nap, (2,), req=Requirements.build())
    started(client, "drainer")
    peer.proc.send_signal(signal.SIGTERM)
    assert client.directory.wait_for(lambda records: not records, 5)  # the goodbye came first
    assert not future.done()
    assert future.result(30) == "finished"  # then the task was allowed to finish
    assert peer.proc.wait(30) == 0
    log = peer.log()
    assert log.index("withdrawing its mDNS record") < log.index("draining 1 task")


def test_a_second_signal_cancels_what_is_still_running(cluster):
    client, peers = cluster("impatient")
    peer = peers["impatient"]
    future = client.submit(nap, (60,), req=Requirements.build())
    started(client, "impatient")
    peer.proc.send_signal(signal.SIGTERM)
    time.sleep(0.5)
    peer.proc.send_signal(signal.SIGINT)
    with pytest.raises(gl.PeerLost, match="the peer was stopped"):
        future.result(30)
    assert peer.proc.wait(30) == 0
