"""Tasks that run tasks (ADR 0014) against real peers on loopback: a task blocked on a future lends its
slot, so nested calls, recursive fan-out, gl.map inside a task and an actor calling a task finish on
full peers, a GPU task's reserved memory stays reserved meanwhile, and an actor waiting on a call to
itself fails with WaitCycle instead of hanging."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

import gpulayer as gl
from support import key_config, wait_until, write_override
from gpulayer.protocol import messages

BOUND_S = 90  # every wait here is bounded: today's main hangs on all of these


@pytest.fixture(scope="module")
def key_dir(tmp_path_factory, cluster_key):
    """A config folder with the cluster key file: the peers' tasks (whose environment never holds the key)
    read it, as on a machine where `gpulayer key init` wrote it, to submit tasks of their own."""
    return key_config(tmp_path_factory.mktemp("config"), cluster_key)


@pytest.fixture(scope="module")
def start(peer_factory, cluster_key, key_dir, gl_client):
    """start(name, *args): a peer of the module's cluster whose tasks can reach it with gl."""
    def start_peer(name: str, *args: str):
        return peer_factory(name, "--preload", "", *args, key=cluster_key, env={"XDG_CONFIG_HOME": key_dir})
    return start_peer


@pytest.fixture(scope="module")
def solo(start):
    return start("solo", "--concurrency", "1")


def status(peer) -> dict:
    return gl.default_client().connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request(
        messages.status_request(), 10)


def here() -> str:
    """In a task: the name of its peer (nested calls are pinned to it, so that they need its lent slot)."""
    return os.environ["GPULAYER_PEER_NAME"]


def inner(x):
    return x * 10, os.getpid()


def outer(x):
    value, pid = gl.run(inner, x, peer=here(), accelerator="cpu")
    return value + 1, pid != os.getpid()


def test_a_task_that_runs_a_task_finishes_on_a_one_slot_peer(solo):
    assert gl.submit(outer, 4, peer="solo", accelerator="cpu").result(BOUND_S) == (41, True)
    # the peer is back to its one slot: its load counts no borrowed slot, and the lent slot's worker,
    # kept a while for the next wait, is stopped (one warm worker is left)
    assert wait_until(lambda: status(solo)["load"] == [0, 0], timeout=BOUND_S)
    assert wait_until(lambda: len(solo.workers()) == 1, timeout=BOUND_S)


def test_four_outer_tasks_on_two_slots_all_finish(start):
    start("duo", "--concurrency", "2")
    futures = [gl.submit(outer, i, peer="duo", accelerator="cpu") for i in range(4)]
    assert [f.result(BOUND_S) for f in futures] == [(10 * i + 1, True) for i in range(4)]


def fan_out(depth: int) -> int:
    """A tree of tasks: each level runs two of the next with gl.map inside the task; leaves count 1."""
    if depth == 0:
        return 1
    return sum(gl.map(fan_out, [depth - 1] * 2, peer=here(), accelerator="cpu"))


def test_a_recursive_fan_out_three_levels_deep_finishes_on_a_one_slot_peer(solo):
    assert gl.submit(fan_out, 2, peer="solo", accelerator="cpu").result(BOUND_S) == 4


@gl.remote(accelerator="cpu", peer="solo")
class Caller:
    def __init__(self):
        self.calls = 0

    def call_a_task(self, x):
        self.calls += 1
        return gl.run(inner, x, peer=here(), accelerator="cpu")[0] + self.calls

    def wait_on_myself(self, me):
        return me.call_a_task.submit(1).result()

    def count(self):
        return self.calls


def test_an_actor_that_calls_a_task_finishes_on_the_slot_it_holds(solo):
    actor = Caller()
    try:
        assert actor.call_a_task.submit(2).result(BOUND_S) == 21
        assert actor.call_a_task.submit(3).result(BOUND_S) == 32
    finally:
        actor.close()


def test_an_actor_waiting_on_a_call_to_itself_fails_with_a_clear_error(solo):
    actor = Caller()
    try:
        with pytest.raises(gl.WaitCycle, match="max_concurrency"):
            actor.wait_on_myself.submit(actor).result(BOUND_S)
        # the call it made runs once the one that waited ended; it comes on a connection of the actor's
        # own, so this one may run before or after it
        assert actor.call_a_task.submit(1).result(BOUND_S) in (10 + 1, 10 + 2)
        wait_until(lambda: actor.count() == 2, BOUND_S)
    finally:
        actor.close()


def gated(gate: str) -> str:
    """Say that it started, then wait for the file `gate`; its device."""
    Path(gate + ".started").touch()
    deadline = time.monotonic() + BOUND_S
    while not os.path.exists(gate) and time.monotonic() < deadline:
        time.sleep(0.01)
    return os.environ["GPULAYER_DEVICE"]


def gated_outer(gate: str) -> str:
    return gl.run(gated, gate, peer=here(), accelerator="cpu")


def test_a_task_on_a_lease_that_runs_a_task_finishes(start, tmp_path):
    peer = start("leasing", "--concurrency", "1")
    leases = gl.default_client().leases
    for attempt in range(3):  # a lease ends after 0.5 s without a task: it may end before the task is sent
        wait_until(lambda: gl.submit(os.getpid, peer="leasing", accelerator="cpu").result(BOUND_S)
                   and peer.peer_id in leases.by_peer, timeout=BOUND_S)
        lease = leases.by_peer[peer.peer_id]
        gate = str(tmp_path / f"gate{attempt}")
        future = gl.submit(gated_outer, gate, peer="leasing", accelerator="cpu")
        on_lease = any(task.future is future for task in list(lease.pending.values()))
        wait_until(lambda: os.path.exists(gate + ".started"), timeout=BOUND_S)  # it runs beside the leased task
        Path(gate).touch()
        assert future.result(BOUND_S) == "cpu"
        if on_lease:
            break
    assert on_lease


def gpu_outer(gate: str) -> tuple[str, str]:
    """A 60 GB task on an 80 GB card that runs a 10 GB task and waits for it; the inner one waits for `gate`."""
    return gl.run(gated, gate, peer=here(), accelerator="cuda", gpu_memory_gb=10), os.environ["GPULAYER_DEVICE"]


def test_a_gpu_task_lends_its_slot_but_keeps_its_memory(start, tmp_path):
    override = write_override(tmp_path / "gpu.json", "cuda", memory_gb=80.0)
    gpu = start("gpu", "--concurrency", "1", "--advertise-override", str(override))
    gate = str(tmp_path / "gate")
    outer_future = gl.submit(gpu_outer, gate, peer="gpu", accelerator="cuda", gpu_memory_gb=60)
    wait_until(lambda: os.path.exists(gate + ".started"), timeout=BOUND_S)
    # the slot is lent, but 60 of the 80 GB stay reserved: a 30 GB task waits in the queue
    big = gl.submit(os.getpid, peer="gpu", accelerator="cuda", gpu_memory_gb=30)
    assert wait_until(lambda: status(gpu)["load"][1] == 1, timeout=BOUND_S)
    assert not big.done()
    Path(gate).touch()
    assert outer_future.result(BOUND_S) == ("cuda:0", "cuda:0")
    assert isinstance(big.result(BOUND_S), int)
