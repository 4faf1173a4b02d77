"""Exactly once on leases (ADR 0013, issue 24 items 2 and 7), against real peers on loopback.

A batch of tasks goes to a leased worker: A runs alone, and B, C, D and E, sent while it runs, reach
the worker together when its answer comes. Then the lease's connection is cut as the batch's answers
come back, or those answers are held back (a stalled path: the submitter gives up on the silence), or
task C ends its own worker. With `retries=0` no task runs twice, every answered task has its result,
and every task whose fate the submitter cannot know fails saying so; with retries every task ends up
run, and none that was answered runs twice. Each task counts its runs itself, as a line in a file.
Then a submitter that keeps its lease busy with a task every 40 ms does not keep the slot from another
submitter, and a submitter's own longer tasks wait on its lease rather than in the peer's queue.
"""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest

from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.client.leases import SHORT_TASK_S
from gpulayer.errors import PeerLost, WorkerDied
from gpulayer.matching import Requirements
from gpulayer.protocol import messages
from support import authenticated, new_key, paced, wait_until, write_override
from test_secure_channel import Pipe, Proxy, runs

CPU = Requirements.build(accelerator="cpu")
ANSWER = 2000  # bytes of text a task returns: a record of its answer is larger than any LOG or PONG record
BATCH = "BCDE"  # the tasks sent while A runs


def mark(path: str, tag: str, seconds: float = 0.0, die: str = "") -> str:
    """Append "<tag> <peer>" to `path` (one line a run), sleep `seconds`, and return ANSWER bytes of text.
    With `die`, the first run ends its own worker: "exit" (os._exit) or "kill" (SIGKILL of itself)."""
    with open(path, "a") as f:
        f.write(f"{tag} {os.environ['GPULAYER_PEER_NAME']}\n")
    if die:
        try:
            os.close(os.open(path + ".died", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass  # it died once already: this run lives
        else:
            if die == "exit":
                os._exit(1)
            os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(seconds)
    return "x" * ANSWER


def count(marker: Path) -> dict[str, int]:
    """How many times each task ran, by the lines it wrote."""
    lines = [line.split()[0] for line in runs(marker)]
    return {tag: lines.count(tag) for tag in "A" + BATCH}


@pytest.fixture(scope="module")
def pair(peer_factory, tmp_path_factory):
    """Two peers of one cluster: "near" (no GPU, six slots: it takes every CPU task while it has a free
    slot) and "far" (a GPU by --advertise-override: it takes the tasks retried away from near)."""
    key = new_key()
    gpu = write_override(tmp_path_factory.mktemp("override") / "gpu.json", "cuda")
    near = peer_factory("near", "--no-mdns", "--concurrency", "6", key=key)
    far = peer_factory("far", "--no-mdns", "--concurrency", "2", "--advertise-override", str(gpu), key=key)
    return near, far


def lease_of(client: Client, peer) -> object:
    """After a trivial task: the client's open lease of `peer`, once the peer's typical run time is that of
    trivial tasks (then any number of tasks queue up on the lease); else None."""
    assert client.submit(abs, (-1,), req=CPU).result(30) == 1
    lease = client.leases.by_peer.get(peer.peer_id)
    short = client.placement.contention.typical(peer.peer_id) < SHORT_TASK_S
    return lease if lease is not None and not lease.closed and short else None


def pipe_of(proxy: Proxy, conn) -> Pipe:
    """The proxy's pipe that carries the connection `conn` (by the submitter's port)."""
    port = conn._wire.sock.getsockname()[1]
    return next(p for p in proxy.pipes if p.sources["c2p"].getpeername()[1] == port)


def after_two_answers(act):
    """The proxy's hook: on the armed pipe, records from the peer's side that carry one answer each pass
    until two did (A's, and the batch's first); the record that would bring more, and every one after
    it, go to `act(pipe, record)` instead. Everything else passes."""

    def hook(pipe: Pipe, direction: str, record: bytes) -> None:
        state = pipe.state
        if direction == "p2c" and state.get("armed"):
            answers = len(record) // ANSWER
            if state.get("acted") or answers > 1 or (answers and state["passed"] >= 2):
                state["acted"] = True
                return act(pipe, record)
            state["passed"] += answers
        pipe.send(direction, record)

    return hook


def cut(pipe: Pipe, record: bytes) -> None:
    """Reset the connection both ways: this record and all after it are lost."""
    for sock in pipe.sources.values():
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    pipe.sources["c2p"].shutdown(socket.SHUT_RDWR)  # wakes the pump that reads the submitter's side
    pipe.sources["p2c"].close()  # a reset to the worker (the pump that reads it runs this hook)


def stall(pipe: Pipe, record: bytes) -> None:
    """Nothing more from the worker passes (this record, those after it, nor its end) until the test
    releases the path (the sockets stay open); then the record goes on, late."""
    pipe.state["release"].wait(60)
    pipe.send("p2c", record)


def send_a_batch(client: Client, lease, marker: Path, retries: int, die: str = "") -> dict:
    """A on the lease, then the batch while A runs (kept back, and written together when A's answer
    comes); C ends its worker when `die` says how. Returns the futures by tag."""
    futures = {"A": client.submit(mark, (str(marker), "A", 0.5), req=CPU, retries=retries)}
    wait_until(lambda: runs(marker), 20)
    for tag in BATCH:
        futures[tag] = client.submit(mark, (str(marker), tag, 0.0, die if tag == "C" else ""), req=CPU,
                                     retries=retries)
    assert len(lease.pending) == 5  # all on the lease
    return futures


def check_outcomes(futures: dict, marker: Path, retries: int, answered: str, lost: type) -> None:
    """Once every task has its outcome: with retries=0, none ran twice, the answered tasks have their
    result, and the others fail as `lost`, saying that their fate is unknown. With retries, every task
    ran and has its result, and the answered ones ran once."""
    errors = {tag: future.exception(60) for tag, future in futures.items()}
    ran = count(marker)
    if retries:
        assert all(ran[tag] >= 1 for tag in ran) and all(ran[tag] == 1 for tag in answered), ran
        assert {line.split()[1] for line in runs(marker)} <= {"near", "far"}
    else:
        assert all(ran[tag] <= 1 for tag in ran), ran
    for tag, error in errors.items():
        if tag in answered or retries:
            assert error is None and futures[tag].result() == "x" * ANSWER, (tag, error)
        else:
            assert isinstance(error, lost) and "its fate is unknown" in str(error), (tag, error)


def relayed(pair, hook, heartbeat: float = 1.0) -> tuple[Proxy, Client]:
    near, far = pair
    proxy = Proxy(("127.0.0.1", near.port), hook)
    client = Client(key=near.key.encode(), peers=f"{proxy.address},{far.address}", mdns=False, echo_output=False,
                    heartbeat=heartbeat)
    return proxy, client


@pytest.mark.parametrize("retries", [0, 1])
def test_a_lease_cut_as_a_batch_is_answered_runs_no_task_twice(pair, tmp_path, retries):
    """The relay forwards A's answer and B's, then resets the lease's connection both ways."""
    near, _ = pair
    marker = tmp_path / "runs"
    proxy, client = relayed(pair, after_two_answers(cut))
    try:
        lease = wait_until(lambda: lease_of(client, near), 30)
        pipe = pipe_of(proxy, lease)
        pipe.state.update(armed=True, passed=0)
        futures = send_a_batch(client, lease, marker, retries)
        check_outcomes(futures, marker, retries, "AB", WorkerDied)
        assert pipe.state.get("acted")
    finally:
        client.close()
        proxy.close()


@pytest.mark.parametrize("retries", [0, 1])
def test_a_lease_whose_answers_stall_runs_no_task_twice(pair, tmp_path, retries):
    """The relay forwards A's answer and B's, then holds back everything the worker sends without
    resetting anything: the submitter hears nothing for three heartbeats and gives up on the lease,
    while the worker runs C, D and E."""
    near, _ = pair
    marker = tmp_path / "runs"
    proxy, client = relayed(pair, after_two_answers(stall), heartbeat=0.5)
    release = threading.Event()
    try:
        lease = wait_until(lambda: lease_of(client, near), 30)
        pipe = pipe_of(proxy, lease)
        pipe.state.update(armed=True, passed=0, release=release)
        futures = send_a_batch(client, lease, marker, retries)
        check_outcomes(futures, marker, retries, "AB", PeerLost)
        assert pipe.state.get("acted")
    finally:
        release.set()  # the late answers find the submitter gone
        client.close()
        proxy.close()


@pytest.mark.parametrize("die, retries", [("exit", 0), ("kill", 0), ("exit", 1), ("kill", 1)])
def test_a_task_that_ends_its_leased_worker_runs_no_task_twice(pair, tmp_path, die, retries):
    """C ends its own worker (once): B, answered before C started, keeps its result; C, D and E were
    sent to the worker, which may have started them as far as the submitter can know."""
    near, far = pair
    marker = tmp_path / "runs"
    client = Client(key=near.key.encode(), peers=f"{near.address},{far.address}", mdns=False, echo_output=False)
    try:
        lease = wait_until(lambda: lease_of(client, near), 30)
        futures = send_a_batch(client, lease, marker, retries, die)
        check_outcomes(futures, marker, retries, "AB", WorkerDied)
        if not retries:
            assert count(marker) == {"A": 1, "B": 1, "C": 1, "D": 0, "E": 0}
    finally:
        client.close()


# ---- item 7: a lease gives its slot back -------------------------------------------------------------


@pytest.fixture(scope="module")
def single(peer_factory):
    key = new_key()
    return peer_factory("single", "--no-mdns", "--concurrency", "1", key=key)


def test_a_lease_kept_busy_gives_the_slot_to_another_submitters_task(single, tmp_path):
    """A greedy submitter keeps its lease busy, sending a task of 80 ms every 40 ms without waiting for
    answers (its own client): its worker always has the next task at hand. When its lease ends, it goes
    on sending through the peer. Another submitter's trivial task, sent once the worker runs the greedy
    tasks, completes while the greedy one is still sending."""
    naps = tmp_path / "naps"
    fn, args = serialization.dumps(mark)[0], serialization.dumps(((str(naps), "nap", 0.08), {}))[0]
    other = Client(key=single.key.encode(), peers=single.address, mdns=False, echo_output=False, leases=False)
    assert other.submit(abs, (-1,), req=CPU).result(30) == 1  # connected: its next task is placed at once
    greedy = authenticated(single, "greedy")
    through_peer = authenticated(single, "greedy")
    events: list[str] = []
    ended = threading.Event()

    def read_the_lease() -> None:
        try:
            while greedy.recv()[0]["t"] != messages.LEASE_END:
                pass
        except (ConnectionError, OSError):
            pass
        ended.set()

    try:
        greedy.send(messages.lease(1, CPU.to_wire(), 1.0))
        assert greedy.recv(time.monotonic() + 10)[0]["t"] == messages.LEASE
        threading.Thread(target=read_the_lease, daemon=True).start()
        future = None
        for task_id in paced(range(2, 150), 0.04):  # at most 6 s of sending
            conn = through_peer if ended.is_set() else greedy
            conn.send(messages.submit(task_id, fn, args, CPU.to_wire(), None, "greedy"))
            if future is None and len(runs(naps)) >= 2:  # the worker runs the greedy tasks: the other's comes
                future = other.submit(abs, (-5,), req=CPU)
                future.add_done_callback(lambda _: events.append("the other's task"))
            if future is not None and future.done():
                break
        events.append("the greedy loop")
        assert future is not None and future.result(60) == 5
        assert events[0] == "the other's task", events
        assert ended.is_set()  # the lease ended for it
    finally:
        other.close()
        greedy.close()
        through_peer.close()


def test_a_submitters_own_longer_tasks_wait_on_its_lease_not_in_the_peers_queue(single):
    """On a peer whose only slot is lent to the submitter, its tasks of 20 ms sent together all go on
    the lease (none through the peer, where they would wait behind the lease and end it)."""
    client = Client(key=single.key.encode(), peers=single.address, mdns=False, echo_output=False)
    try:
        lease = wait_until(lambda: lease_of(client, single), 30)
        for _ in range(3):  # the peer's typical run time grows towards 20 ms: longer tasks
            assert client.submit(time.sleep, (0.02,), req=CPU).result(30) is None
        assert client.placement.contention.typical(single.peer_id) >= SHORT_TASK_S
        futures = [client.submit(time.sleep, (0.02,), req=CPU) for _ in range(10)]
        assert [f.result(30) for f in futures] == [None] * 10
        assert client.leases.by_peer.get(single.peer_id) is lease  # the same lease throughout
        status = client.connection_to(single.peer_id, [("127.0.0.1", single.port)]).request(
            messages.status_request(), 10)
        assert not [t for t in status["finished"] if t["name"] == "sleep"]  # none ran through the peer
    finally:
        client.close()
