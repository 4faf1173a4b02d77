"""Work stealing (ADR 0011) against real peers on loopback: a task waiting in a slow peer's queue is
withdrawn and sent to a peer with a free slot, each task runs exactly once, a task pinned to a peer
never moves, an idle peer tells the other submitters that contend for it, and hostile WITHDRAWs
change nothing."""

from __future__ import annotations

import threading
import time

import pytest

from gpulayer import serialization
from gpulayer.client import Client
from gpulayer.matching import Requirements
from gpulayer.protocol import messages
from support import authenticated, new_key, wait_until

SLOWDOWN = "STEAL_SLOWDOWN"  # read by `nap`: how many times slower this peer's tasks run
CPU = Requirements.build(accelerator="cpu")


def nap(path: str, seconds: float) -> str:
    """Sleep `seconds` times the peer's slowdown, note the peer in `path` (one line a run), return its name."""
    import os
    import time

    time.sleep(seconds * float(os.environ.get("STEAL_SLOWDOWN", "1")))
    name = os.environ["GPULAYER_PEER_NAME"]
    with open(path, "a") as out:
        out.write(name + "\n")
    return name


@pytest.fixture(scope="module")
def key():
    return new_key()


@pytest.fixture(scope="module")
def peers(peer_factory, key):
    return {"quick": peer_factory("quick", "--concurrency", "1", key=key),
            "slow": peer_factory("slow", "--concurrency", "1", key=key, env={SLOWDOWN: "20"})}


def client_of(key: str) -> Client:
    return Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])


def status(client: Client, peer) -> dict:
    return client.connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request(messages.status_request(), 10)


def test_tasks_queued_on_a_slow_peer_move_to_a_free_one_and_run_once(key, peers, tmp_path):
    clients = [client_of(key) for _ in range(2)]
    try:
        for c in clients:  # both know both peers before the work starts
            c.start()
            assert c.directory.wait_for(lambda records: sum(r.up for r in records) == 2, 30)
        withdrawn_before = status(clients[0], peers["slow"])["withdrawn"]
        paths = {c: [str(tmp_path / f"{i}-{j}") for j in range(12)] for i, c in enumerate(clients)}
        pinned = clients[0].submit(nap, (str(tmp_path / "pinned"), 0.01), req=Requirements.build(
            accelerator="cpu", peer="slow"))
        results: dict[Client, list[str]] = {}

        def work(c: Client) -> None:
            results[c] = c.map(nap, [(p, 0.05) for p in paths[c]], req=CPU, progress=False)

        threads = [threading.Thread(target=work, args=(c,)) for c in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join(180)
        assert sorted(map(len, results.values())) == [12, 12]
        assert pinned.result(60) == "slow"
        runs = {p: (tmp_path / p.rsplit("/", 1)[1]).read_text().split() for ps in paths.values() for p in ps}
        assert all(len(ran) == 1 for ran in runs.values()), runs  # exactly once, wherever it ran
        on_slow = sum(ran == ["slow"] for ran in runs.values())
        withdrawn = status(clients[0], peers["slow"])["withdrawn"] - withdrawn_before
        # 24 tasks of 0.05 s on the quick peer against 1 s each on the slow one: without stealing, every
        # task that queued on the slow peer would wait there for a second per task ahead of it
        assert withdrawn >= 1 and on_slow <= 4, (withdrawn, on_slow)
    finally:
        for c in clients:
            c.close()


def submit(conn, task_id: int, path, seconds: float) -> None:
    conn.send(messages.submit(task_id, serialization.dumps(nap)[0], serialization.dumps(((str(path), seconds), {}))[0],
                              CPU.to_wire(), None, "nap"))


def next_message(conn, kinds: tuple[str, ...], timeout: float = 10.0) -> dict:
    """The next message of one of `kinds` (past the peer's others)."""
    deadline = time.monotonic() + timeout
    for _ in range(16):
        msg, _ = conn.recv(deadline)
        if msg["t"] in kinds:
            return msg
    raise AssertionError(f"no {kinds} among 16 messages")


def test_withdraw_takes_back_a_queued_task_only(peers, tmp_path):
    quick = peers["quick"]
    conn = authenticated(quick)
    try:
        submit(conn, 1, tmp_path / "running", 0.5)
        submit(conn, 2, tmp_path / "queued", 0.0)
        accept = next_message(conn, (messages.ACCEPT,))
        assert accept["id"] == 2 and accept["w"] is True  # it waits, and may be withdrawn
        conn.send(messages.withdraw(1))  # it runs already: nothing happens to it
        conn.send(messages.withdraw(2))
        reject = next_message(conn, (messages.REJECT, messages.RESULT))
        assert reject["t"] == messages.REJECT and reject["id"] == 2 and reject["code"] == "withdrawn"
        for hostile in (2, 3, "2", None, 2**63, -1, [1]):  # taken back already, unknown, or not an id at all
            conn.send({"t": messages.WITHDRAW, "id": hostile})
        result = next_message(conn, (messages.RESULT, messages.REJECT, messages.ERROR))
        assert result["t"] == messages.RESULT and result["id"] == 1, result
        conn.send(messages.ping())
        assert next_message(conn, (messages.PONG,))["load"] == [0, 0]  # the connection and the peer live on
    finally:
        conn.close()
    assert (tmp_path / "running").read_text() == "quick\n"
    assert not (tmp_path / "queued").exists()  # withdrawn before it started: it never ran here


def test_a_peer_with_a_free_slot_tells_the_other_contending_submitters(peers, tmp_path):
    quick = peers["quick"]
    first, second, watcher = (authenticated(quick, name) for name in ("first", "second", "watcher"))

    def busy() -> bool:
        watcher.send(messages.ping())
        return next_message(watcher, (messages.PONG,))["load"][0] == 1

    try:
        submit(first, 1, tmp_path / "a", 0.3)
        wait_until(busy, 10)  # it started
        submit(second, 1, tmp_path / "b", 0.0)  # queued behind it: both contend for the slot
        assert next_message(second, (messages.ACCEPT,))["id"] == 1
        assert next_message(first, (messages.RESULT,))["id"] == 1
        assert next_message(second, (messages.RESULT,))["id"] == 1  # then the slot is free, and nothing waits
        notice = next_message(first, (messages.PONG,), timeout=5)
        assert notice.get("id") is None and notice["load"] == [0, 0]  # unasked: "a slot is free here"
    finally:
        for conn in (first, second, watcher):
            conn.close()
