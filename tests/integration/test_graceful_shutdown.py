"""SIGTERM withdraws the mDNS record first, then lets the running task finish; a second signal cancels."""

from __future__ import annotations

import signal
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import wait_until


def nap(seconds):
    time.sleep(seconds)
    return "finished"


def started(client: Client, name: str) -> None:
    wait_until(lambda: any(r["name"] == name and r["busy"] for r in client.peers(wait=0)), 30)


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
    wait_until(lambda: "draining 1 task" in peer.log(), 30)  # the first signal was taken
    peer.proc.send_signal(signal.SIGINT)
    with pytest.raises(gl.PeerLost, match="the peer was stopped"):
        future.result(30)
    assert peer.proc.wait(30) == 0
