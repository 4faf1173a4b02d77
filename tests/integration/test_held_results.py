"""Held results (issue 12, item 4) against real peers on loopback: a future passed to another task
travels peer to peer (the submitter's received bytes counted at its sockets), used in place on the
peer that holds it, freed on release, on garbage collection and when the submitter leaves; a
killed holder; keep=True; the bound on held bytes; hostile FETCHes and SUBMITs."""

from __future__ import annotations

import gc
import socket
import time

import numpy as np
import pytest

import gpulayer as gl
from gpulayer import held, serialization
from gpulayer.client import Client
from gpulayer.dashboard.status import clean_status
from gpulayer.errors import AuthError, PeerLost, TaskRejected
from gpulayer.matching import Requirements
from gpulayer.peer_table import format_peers
from gpulayer.protocol import handshake, messages
from gpulayer.transport import blocking
from support import new_key, wait_until

MIB = 1 << 20
GRACE = "1"  # GPULAYER_ACTOR_GRACE of the peers: seconds their held results outlive a submitter
CPU = Requirements.build(accelerator="cpu")


def on(name: str) -> Requirements:
    return Requirements.build(accelerator="cpu", peer=name)


def make(nbytes: int):
    return np.arange(nbytes // 8, dtype=np.int64)


def checksum(array) -> tuple[int, int]:
    return int(array.nbytes), int(array[::4096].sum())


def where_am_i(_array) -> str:
    import os

    return os.environ["GPULAYER_PEER_NAME"]


def fail():
    raise KeyError("producer failed")


@pytest.fixture(scope="module", autouse=True)
def inline_only():
    """Everything through the sockets (GPULAYER_SHM=0 here and on the peers), where the bytes are counted:
    on one host big buffers would otherwise pass by shared memory, past that count."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GPULAYER_SHM", "0")
        yield


@pytest.fixture(scope="module")
def key():
    return new_key()


@pytest.fixture(scope="module")
def peers(peer_factory, key):
    env = {"GPULAYER_ACTOR_GRACE": GRACE}  # GPULAYER_SHM=0 comes with the test's environment
    return {name: peer_factory(name, "--concurrency", "1", key=key, env=env) for name in ("pa", "pb")}


@pytest.fixture
def client(key, peers):
    c = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    yield c
    c.close()


def status(client: Client, peer) -> dict:
    return client.connection_to(peer.peer_id, [("127.0.0.1", peer.port)]).request(messages.status_request(), 10)


def held_bytes(client: Client, peer) -> int:
    return status(client, peer)["held_bytes"]


def test_a_result_passed_between_peers_never_reaches_the_submitter(client, peers):
    produced = client.submit(make, (64 * MIB,), req=on("pa"), keep=True)
    before = client.received_bytes()
    consumed = client.submit(checksum, (produced,), req=on("pb"))
    assert consumed.result(60) == checksum(make(64 * MIB))
    assert consumed.peer == "pb" and produced.peer == "pa"
    assert client.received_bytes() - before < MIB  # none of the 64 MiB came through here
    assert held_bytes(client, peers["pa"]) >= 64 * MIB
    before = client.received_bytes()
    assert np.array_equal(produced.result(60), make(64 * MIB))  # brought here when asked
    assert client.received_bytes() - before >= 64 * MIB
    produced.release()
    wait_until(lambda: held_bytes(client, peers["pa"]) == 0, 10)


def test_a_consumer_lands_on_the_holder_and_uses_the_value_in_place(client, peers):
    produced = client.submit(make, (8 * MIB,), req=on("pb"), keep=True)
    produced.exception(30)
    for _ in range(3):  # both peers idle: the holder is preferred
        assert client.submit(where_am_i, (produced,), req=CPU).result(30) == "pb"
    nested = client.submit(checksum, (), {"array": {"list": [produced]}["list"][0]}, req=CPU)
    assert nested.result(30) == checksum(make(8 * MIB)) and nested.peer == "pb"


def test_futures_inside_lists_and_dicts_and_pending_ones(client, peers):
    slow = client.submit(_slow_make, (MIB,), req=on("pa"), keep=True)
    plain = client.submit(make, (MIB,), req=on("pb"))  # not kept: its value travels through here
    summed = client.submit(_total, ([slow, plain], {"again": slow}), req=on("pb"))
    assert summed.result(30) == 3 * int(make(MIB).sum())


def _slow_make(nbytes: int):
    time.sleep(0.5)
    return make(nbytes)


def _total(arrays, more) -> int:
    return int(sum(int(a.sum()) for a in arrays) + int(more["again"].sum()))


def test_a_failed_producer_fails_its_consumer_with_its_exception(client, peers):
    produced = client.submit(fail, req=on("pa"), keep=True)
    with pytest.raises(KeyError, match="producer failed"):
        client.submit(checksum, (produced,), req=on("pb")).result(30)


def test_released_and_garbage_collected_results_are_freed(client, peers):
    produced = client.submit(make, (4 * MIB,), req=on("pa"), keep=True)
    produced.result(30)
    assert held_bytes(client, peers["pa"]) >= 4 * MIB
    produced.release()
    wait_until(lambda: held_bytes(client, peers["pa"]) == 0, 10)
    assert np.array_equal(produced.result(), make(4 * MIB))  # fetched before: still here

    dropped = client.submit(make, (4 * MIB,), req=on("pa"), keep=True)
    dropped.exception(30)
    assert held_bytes(client, peers["pa"]) >= 4 * MIB
    del dropped
    gc.collect()
    wait_until(lambda: held_bytes(client, peers["pa"]) == 0, 10)  # the heartbeat sends the RELEASE


def test_held_results_are_freed_when_their_submitter_leaves(key, peers, client):
    leaving = Client(key=key.encode(), echo_output=False, interfaces=["127.0.0.1"])
    kept = [leaving.submit(make, (2 * MIB,), req=on("pb"), keep=True) for _ in range(3)]
    for future in kept:
        future.exception(30)
    assert status(client, peers["pb"])["held"] == 3
    leaving.close()
    wait_until(lambda: status(client, peers["pb"])["held"] == 0, 15)  # after the grace time
    assert held_bytes(client, peers["pb"]) == 0


def test_keep_sends_nothing_back_until_asked(client, peers):
    before = client.received_bytes()
    produced = client.submit(make, (16 * MIB,), req=on("pa"), keep=True)
    where = wait_until(lambda: produced.held, 30)
    assert where.size >= 16 * MIB and client.received_bytes() - before < MIB
    assert np.array_equal(produced.result(30), make(16 * MIB))
    produced.release()


def test_keep_is_an_option_of_submit_and_refused_where_the_value_is_returned(key, peers):
    gl.configure(key=key.encode(), interfaces=["127.0.0.1"], echo_output=False)
    try:
        future = gl.submit(make, MIB, accelerator="cpu", keep=True)
        assert future.result(30).nbytes == MIB
        remote = gl.remote(make).options(accelerator="cpu", keep=True)
        assert remote.submit(MIB).result(30).nbytes == MIB
        with pytest.raises(ValueError, match="keep=True makes no sense for gl.run"):
            gl.run(make, MIB, keep=True)
        with pytest.raises(ValueError, match="keep=True makes no sense for gl.map"):
            gl.map(make, [MIB], keep=True)
        with pytest.raises(ValueError, match="keep=True makes no sense"):
            remote(MIB)
        with pytest.raises(TypeError, match="keep must be True or False"):
            gl.submit(make, MIB, keep="yes")
    finally:
        gl.api.shutdown()


def test_the_bound_on_held_bytes_gives_a_clear_error(peer_factory, key, client):
    small = peer_factory("small", "--concurrency", "1", key=key, env={"GPULAYER_HELD_MB": "1"})
    with pytest.raises(TaskRejected, match="held-full.*GPULAYER_HELD_MB"):
        client.submit(make, (2 * MIB,), req=on("small"), keep=True).result(30)
    assert held_bytes(client, small) == 0


def test_a_killed_holder_fails_its_consumer_with_peer_lost(peer_factory, key, client, peers):
    doomed = peer_factory("doomed", "--concurrency", "1", key=key)
    produced = client.submit(make, (MIB,), req=on("doomed"), keep=True)
    produced.exception(30)
    doomed.kill()
    with pytest.raises(PeerLost, match="doomed|lost"):
        client.submit(checksum, (produced,), req=on("pb")).result(30)
    with pytest.raises(PeerLost):
        produced.result(30)


def _connect(peer, key: bytes) -> blocking.BlockingConnection:
    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    handshake.client_handshake(conn, key, "intruder")
    return conn


def _answer(conn: blocking.BlockingConnection) -> tuple[dict, list]:
    """The next answer to a request (past the peer's other messages: an offer, a PONG, an ACCEPT)."""
    for _ in range(8):
        msg, buffers = conn.recv(time.monotonic() + 10)
        if msg["t"] in (messages.ERROR, messages.REJECT, messages.RESULT):
            return msg, buffers
    raise AssertionError("no answer among 8 messages")


def test_a_fetch_of_an_unknown_or_anothers_result_gets_nothing(client, key, peers):
    produced = client.submit(make, (MIB,), req=on("pa"), keep=True)
    result_id = wait_until(lambda: produced.held, 30).result_id
    conn = _connect(peers["pa"], key.encode())
    try:
        for asked in (held.new_result_id(), result_id, "x" * 32, 7):  # random, another submitter's, junk
            conn.send(messages.fetch(1, asked))  # type: ignore[arg-type]
            msg, buffers = _answer(conn)
            assert msg["t"] == messages.ERROR and msg["code"] == "no-result" and not buffers
        conn.send(messages.release(result_id))  # not its owner: nothing happens
    finally:
        conn.close()
    assert np.array_equal(produced.result(30), make(MIB))
    produced.release()


def test_a_fetch_without_the_key_reads_nothing(client, key, peers):
    produced = client.submit(make, (MIB,), req=on("pa"), keep=True)
    result_id = wait_until(lambda: produced.held, 30).result_id
    sock = socket.create_connection(("127.0.0.1", peers["pa"].port), timeout=10)
    conn = blocking.BlockingConnection(sock)
    try:
        conn.recv(time.monotonic() + 10)  # HELLO
        conn.send(messages.fetch(1, result_id))  # no AUTH first
        msg, _ = conn.recv(time.monotonic() + 10)
        assert msg["t"] == messages.ERROR and msg["code"] == "auth"
    finally:
        conn.close()
    with pytest.raises(AuthError):
        _connect(peers["pa"], b"not-the-cluster-key-at-all-00000")
    produced.release()


@pytest.mark.parametrize("field, value, problem", [
    ("keep", "abc", "bad 'keep'"),
    ("refs", "nope", "'refs' must be a list"),
    ("refs", [{"ref": "0" * 32, "peer": "p", "at": [["127.0.0.1", 0]]}], "'at'"),
    ("refs", [{"ref": "0" * 31, "peer": "p", "at": [["127.0.0.1", 1]]}], "result id"),
])
def test_malformed_keep_and_refs_are_rejected(client, key, peers, field, value, problem):
    conn = _connect(peers["pb"], key.encode())
    try:
        fn, _ = serialization.dumps(make)
        args, _ = serialization.dumps(((1,), {}))
        msg = messages.submit(1, fn, args, CPU.to_wire(), None, "make")
        msg[field] = value  # type: ignore[literal-required]
        conn.send(msg)
        reply, _ = _answer(conn)
        assert reply["t"] == messages.REJECT and reply["code"] == "bad-request" and problem in reply["message"]
    finally:
        conn.close()


def test_a_ref_to_a_result_the_peer_does_not_hold_fails_the_task(client, key, peers):
    conn = _connect(peers["pb"], key.encode())
    try:
        fn, _ = serialization.dumps(checksum)
        args, _ = serialization.dumps(((), {}))
        refs = [messages.ref(held.new_result_id(), peers["pb"].peer_id, [("127.0.0.1", peers["pb"].port)])]
        conn.send(messages.submit(1, fn, args, CPU.to_wire(), None, "checksum", refs=refs))
        reply, _ = _answer(conn)
        assert reply["code"] == "held-lost" and "holds no result" in reply["message"]
    finally:
        conn.close()
    # the peer lives on and holds nothing for this task; what earlier tests kept there (a killed holder's
    # consumer, say) is released by their heartbeats, so the count is waited for, not read once
    wait_until(lambda: status(client, peers["pb"])["held"] == 0, 15)


def test_a_future_pickled_outside_a_submit_is_its_value(client, peers):
    produced = client.submit(make, (MIB,), req=on("pa"), keep=True)
    data, buffers = serialization.dumps([produced])
    assert np.array_equal(serialization.loads(data, buffers)[0], make(MIB))
    produced.release()


def test_the_peer_table_and_the_dashboard_show_held_bytes(client, peers):
    produced = client.submit(make, (3 * MIB,), req=on("pb"), keep=True)
    produced.exception(30)
    rows = {r["name"]: r for r in client.peers(wait=0.2)}
    assert rows["pb"]["held_bytes"] >= 3 * MIB and rows["pa"]["held_bytes"] == 0
    line = next(line for line in format_peers(list(rows.values())).splitlines() if line.startswith("pb"))
    assert " 3.0 MiB " in line
    assert clean_status(status(client, peers["pb"]))["held_bytes"] >= 3 * MIB
    produced.release()


@pytest.mark.parametrize("value", [-1, True, "12", 1.5, 1 << 60, None, [1]])
def test_the_dashboard_reads_a_hostile_held_field_as_nothing(value):
    assert clean_status({"held_bytes": value, "held": value})["held_bytes"] == 0
    assert clean_status({"held": value})["held"] == 0
