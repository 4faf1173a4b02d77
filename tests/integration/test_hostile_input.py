"""Authentication and bad input against a live peer: nothing runs without the key, and the peer serves on."""

from __future__ import annotations

import os
import re
import resource
import socket
import struct
import time

import msgpack
import pytest

from gpulayer import serialization
from gpulayer.client import Client, PeerConnection
from gpulayer.errors import AuthError, NoMatchingPeer, ProtocolError
from gpulayer.matching import Requirements
from gpulayer.protocol import framing, handshake, messages
from gpulayer.resources.model import PROTOCOL_VERSION
from gpulayer.transport import blocking
from support import new_key, solo_peer, wait_until

ANY = Requirements.build()


@pytest.fixture(scope="module")
def target(peer_factory):
    key = new_key()
    peer = peer_factory("target", "--concurrency", "1", key=key, env={"GPULAYER_MAX_MESSAGE_MB": "8"})
    client = Client(key=key.encode(), echo_output=False)
    yield peer, client
    client.close()


def honest_call_works(client):
    return client.submit(lambda: "still serving", req=ANY).result(30) == "still serving"


def raw(peer) -> tuple[socket.socket, blocking.BlockingConnection, dict]:
    sock = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
    conn = blocking.BlockingConnection(sock)
    hello, _ = conn.recv()
    assert hello["t"] == messages.HELLO
    return sock, conn, hello


def closing_error(conn: blocking.BlockingConnection) -> dict:
    """The ERROR the peer sends before it closes; then EOF."""
    msg, _ = conn.recv()
    assert msg["t"] == messages.ERROR
    with pytest.raises((ConnectionError, OSError)):
        conn.recv()
    return msg


def side_effect(path):
    open(path, "w").close()
    return "ran"


def test_a_wrong_key_is_refused_both_ways_and_logged(target):
    peer, client = target
    intruder = Client(key=b"not-the-key", peers=peer.address, mdns=False, echo_output=False)
    try:
        with pytest.raises(AuthError, match="refused authentication"):
            PeerConnection(intruder, [("127.0.0.1", peer.port)], intruder.key, intruder.submitter_id)
        with pytest.raises(NoMatchingPeer, match="static peer unreachable"):
            intruder.submit(lambda: 1, req=ANY)
    finally:
        intruder.close()
    assert "authentication failed" in peer.log()
    assert honest_call_works(client)


def test_submit_without_auth_never_runs_code(target, tmp_path):
    peer, client = target
    marker = tmp_path / "pwned"
    sock, conn, _ = raw(peer)
    msg = {"t": messages.SUBMIT, "id": 1, "fn": serialization.dumps(side_effect)[0],
           "args": serialization.dumps(((str(marker),), {}))[0], "req": {}}
    conn.send(msg)
    reply = closing_error(conn)
    assert reply["code"] == "auth"
    sock.close()
    # the peer has one slot and runs its tasks in turn: had it taken the SUBMIT, that task would have run
    # before this later, honest one
    assert honest_call_works(client)
    assert not marker.exists()


@pytest.mark.parametrize("kind", [messages.STATUS, messages.PING, messages.LEASE, messages.DIRECT, messages.LOCAL,
                                  messages.FETCH, messages.CANCEL, messages.BYE])
def test_before_auth_every_kind_but_auth_is_refused(target, kind):
    """Before authentication the peer's only handlers are AUTH's and an invite's: a STATUS gets no
    status, a LEASE no worker, a LOCAL no link; each closes the connection as a failed authentication."""
    peer, client = target
    sock, conn, _ = raw(peer)
    conn.send({"t": kind, "id": 1, "beat": 1.0, "req": {}, "ref": {}})
    reply = closing_error(conn)
    assert (reply["t"], reply["code"]) == (messages.ERROR, "auth")
    sock.close()
    assert honest_call_works(client)


def test_a_replayed_auth_is_refused(target):
    peer, client = target
    _, first, hello1 = raw(peer)
    nonce_s = os.urandom(32)
    recorded, _ = handshake.auth(hello1, peer.key.encode(), "recorded", nonce_s)
    _, second, hello2 = raw(peer)
    assert hello1["nonce"] != hello2["nonce"]
    second.send(dict(recorded))  # valid for the first connection's nonce only
    assert closing_error(second)["code"] == "auth"
    first.send(dict(recorded))
    assert first.recv()[0]["t"] == messages.AUTH_OK
    assert honest_call_works(client)


@pytest.mark.parametrize("payload, code", [
    (b"\x00\x00\x00\x05hello", "protocol"),  # not msgpack
    (struct.pack(">I", 0xFFFFFFF0), "too-large"),  # a huge length prefix before auth
    (struct.pack(">I", 3) + msgpack.packb([1, 2]), "protocol"),  # not a map
    (b"".join(framing.encode({"t": "launch-missiles"})), "protocol"),  # unknown type
])
def test_malformed_frames_close_the_connection_with_a_clear_error(target, payload, code):
    peer, client = target
    sock, conn, _ = raw(peer)
    sock.sendall(payload)
    reply = closing_error(conn)
    assert reply["code"] == code and reply["message"]
    assert honest_call_works(client)


def authenticated(peer) -> blocking.BlockingConnection:
    conn = blocking.BlockingConnection(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
    handshake.client_handshake(conn, peer.key.encode(), "hostile9876")
    return conn


def answer(conn: blocking.BlockingConnection, request_id: int | None) -> dict:
    """The next answer with this id (past the peer's unasked messages: a PONG with its advert, say)."""
    for _ in range(8):
        msg, _ = conn.recv(time.monotonic() + 10)
        if msg.get("id") == request_id and msg["t"] != messages.PONG:
            return msg
    raise AssertionError(f"no answer with id {request_id} among 8 messages")


ACTOR_ID = "ab" * (messages.ACTOR_ID_HEX // 2)


@pytest.mark.parametrize("bad, refused", [
    (messages.lease(1, {}, float("nan")), (1, "a LEASE needs 'beat'")),
    (messages.lease(2, {}, 0.0), (2, "a LEASE needs 'beat'")),
    ({**messages.lease(3, {}, 1.0), "id": "three"}, (None, "a LEASE needs an integer 'id'")),
    (messages.direct(4, "nope"), (4, "an actor id is 32 lowercase hex digits")),
    ({**messages.direct(5, ACTOR_ID), "id": True}, (None, "a DIRECT needs an integer 'id'")),
    (messages.close(6, ACTOR_ID.upper()), (6, "an actor id is 32 lowercase hex digits")),
    ({**messages.close(7, ACTOR_ID), "id": None}, (None, "a CLOSE needs an integer 'id'")),
    ({**messages.call(8, ACTOR_ID, "run", b"", None), "id": 8.5}, (None, "a CALL needs an integer 'id'")),
    (messages.call(9, "x", "run", b"", None), (9, "an actor id is 32 lowercase hex digits")),
    ({**messages.fetch(10, "0" * 32), "for": 7}, (10, "a FETCH's 'for' names a submitter")),
    ({**messages.fetch(11, "0" * 32), "id": "eleven"}, (None, "a FETCH needs an integer 'id'")),
    ({**messages.release("0" * 32), "ref": 7}, (None, "a result id is 32 lowercase hex digits")),
], ids=lambda value: value["t"] if isinstance(value, dict) else "")
def test_each_malformed_request_is_refused_by_its_validator(target, bad, refused):
    """After authentication each kind's validator (protocol/messages.CHECKS) answers a malformed request
    before its handler runs: ERROR bad-request with the reason, and the connection serves on."""
    peer, client = target
    conn = authenticated(peer)
    try:
        conn.send(bad)
        reply = answer(conn, refused[0])
        assert (reply["t"], reply["code"]) == (messages.ERROR, "bad-request")
        assert refused[1] in reply["message"]
        conn.send({"t": messages.STATUS, "id": 99})  # the connection serves on
        assert answer(conn, 99)["t"] == messages.STATUS
    finally:
        conn.close()
    assert honest_call_works(client)


@pytest.mark.parametrize("nonce", [b"short", "not bytes", None])
def test_an_auth_without_a_nonce_is_refused_as_a_failed_authentication(target, nonce):
    peer, client = target
    sock, conn, hello = raw(peer)
    good, _ = handshake.auth(hello, peer.key.encode(), "shapeless")
    conn.send({**good, "nonce": nonce})
    assert closing_error(conn)["code"] == "auth"
    sock.close()
    assert honest_call_works(client)


def test_a_wrong_protocol_version_is_named(target):
    peer, client = target
    sock, conn, _ = raw(peer)
    body = msgpack.packb({"t": messages.AUTH, "v": PROTOCOL_VERSION + 41})
    sock.sendall(struct.pack(">I", len(body)) + body)
    reply = closing_error(conn)
    assert reply["code"] == "version" and str(PROTOCOL_VERSION + 41) in reply["message"]


def test_a_truncated_frame_then_silence_times_out(target):
    peer, client = target
    sock, conn, _ = raw(peer)
    sock.sendall(struct.pack(">I", 100) + b"only part")
    reply = closing_error(conn)  # after the 5 s handshake timeout
    assert reply["code"] == "timeout"
    assert honest_call_works(client)


def test_an_oversized_message_after_auth_is_refused_clearly(target):
    np = pytest.importorskip("numpy")
    peer, client = target
    big = np.zeros(16 << 20, dtype=np.uint8)  # the peer was started with an 8 MiB limit
    with pytest.raises(ProtocolError, match="too-large"):
        client.submit(len, (big,), req=ANY).result(30)
    assert honest_call_works(client)


def test_a_flood_of_half_open_connections_does_not_lock_out_an_honest_submitter(target):
    peer, client = target
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 8192), hard))
    flood = []
    try:
        for _ in range(600):  # more than the peer's 256 unauthenticated places
            flood.append(socket.create_connection(("127.0.0.1", peer.port), timeout=10))
        fresh = Client(key=peer.key.encode(), peers=peer.address, mdns=False, echo_output=False)
        try:
            assert fresh.submit(lambda: "through", req=ANY).result(30) == "through"
        finally:
            fresh.close()
    finally:
        for s in flood:
            s.close()
    assert peer.alive() and honest_call_works(client)


# Run as another local account: find the peer's local-link socket as any account can (its abstract
# name in /proc/net/unix), then connect and hang up `rounds` times; then as often, open a TCP
# connection, send a frame that is not msgpack, and hang up.
KNOCK = """
import socket, sys
pid, port, rounds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
names = [line.split()[-1] for line in open("/proc/net/unix") if f" @gpulayer-{pid}-" in line]
assert names, "the peer's local-link socket is not in /proc/net/unix"
for _ in range(rounds):
    with socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET) as s:
        s.connect("\\0" + names[0][1:])
for _ in range(rounds):
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(b"\\x00\\x00\\x00\\x05hello")
print("knocked", rounds)
"""


def logged(text: str, line: str, kind: str) -> int:
    """How many events of `kind` a log records: its lines that start with `line`, plus the counts
    of its lines that say how many more there were (peer/quiet.py)."""
    counts = re.findall(re.escape(kind) + r": (\d+) more", text)
    return text.count(line) + sum(map(int, counts))


@pytest.fixture
def fresh(peer_factory):
    """A peer of its own, whose log no other test has written to."""
    yield from solo_peer(peer_factory, "fresh")


def test_another_local_user_cannot_flood_the_log_through_links_or_tcp(fresh, other_user):
    peer, client = fresh
    rounds = 2000
    offset = len(peer.log())

    def since() -> str:
        return peer.log()[offset:]

    knocked = other_user.run(KNOCK, str(peer.pid), str(peer.port), str(rounds), timeout=120)
    assert knocked.returncode == 0 and f"knocked {rounds}" in knocked.stdout, knocked.stderr
    # every refused link is accounted for: the first in full, the rest counted, a line per 10 s
    wait_until(lambda: logged(since(), "refused a local link from another user",
                              "local links refused (another user)") >= rounds, 60)
    assert f"(uid {other_user.uid})" in since()
    wait_until(lambda: "connections refused before authentication (protocol): " in since()
               or len(since().splitlines()) >= 40, 60)
    lines = since().splitlines()
    assert len(lines) < 40, f"{len(lines)} lines for {2 * rounds} bad connections:\n" + "\n".join(lines[:40])
    assert "closing connection from 127.0.0.1" in since()  # the first of the TCP ones, in full
    assert peer.alive() and honest_call_works(client)
