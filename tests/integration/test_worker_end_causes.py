"""The peer's log names why a worker ended (issue 26, item 8): a worker the peer stopped itself (a
timeout, a cancel, a closed actor) is not reported as "killed: out of memory?", which stays for a
worker killed from outside. Against a real single-slot peer."""

from __future__ import annotations

import os
import signal
import time

import pytest

import gpulayer as gl
from gpulayer.client import Client
from gpulayer.matching import Requirements
from support import solo_peer, wait_until

CPU = Requirements.build(accelerator="cpu")


@pytest.fixture(scope="module")
def solo(peer_factory):
    yield from solo_peer(peer_factory, "causes")


def nap(seconds: float) -> int:
    time.sleep(seconds)
    return os.getpid()


def ended_lines(peer) -> list[str]:
    return [line for line in peer.log().splitlines() if "ended (" in line and "starting a new one" in line]


def test_a_worker_stopped_by_its_tasks_timeout_or_cancel_is_named_so(solo):
    peer, client = solo
    with pytest.raises(gl.TaskTimeout):
        client.submit(nap, (30,), req=CPU, timeout=0.5).result(60)
    wait_until(lambda: any("past its timeout of 0.5 s" in line for line in ended_lines(peer)), 30)
    running = client.submit(nap, (30,), req=CPU)
    wait_until(lambda: client.peers()[0]["busy"] == 1)
    assert running.cancel()
    wait_until(lambda: any("task was stopped" in line for line in ended_lines(peer)), 30)
    gone = Client(key=peer.key.encode(), echo_output=False)  # a submitter that goes while its task runs
    gone.submit(nap, (30,), req=CPU)
    wait_until(lambda: client.peers()[0]["busy"] == 1)
    gone.close()
    wait_until(lambda: len(ended_lines(peer)) == 3, 30)
    assert all("stopped by the peer" in line for line in ended_lines(peer))
    assert "out of memory" not in peer.log()


def test_a_worker_killed_from_outside_keeps_the_hint(solo):
    peer, client = solo
    pid = client.submit(os.getpid, req=CPU).result(60)
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: "killed: out of memory?" in peer.log(), 30)
    assert client.submit(os.getpid, req=CPU).result(60) != pid
