"""Authentication and bad input against a live peer: nothing runs without the key, and the peer serves on."""

from __future__ import annotations

import os
import resource
import socket
import struct
import time

import msgpack
import pytest

from gpulayer import serialization, wire
from gpulayer.client import Client, PeerConnection
from gpulayer.errors import AuthError, NoMatchingPeer, ProtocolError
from gpulayer.matching import Requirements
from gpulayer.resources.model import PROTOCOL_VERSION
from support import new_key

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


def raw(peer) -> tuple[socket.socket, wire.BlockingConnection, dict]:
    sock = socket.create_connection(("127.0.0.1", peer.port), timeout=10)
    conn = wire.BlockingConnection(sock)
    hello, _ = conn.recv()
    assert hello["t"] == wire.HELLO
    return sock, conn, hello


def closing_error(conn: wire.BlockingConnection) -> dict:
    """The ERROR the peer sends before it closes; then EOF."""
    msg, _ = conn.recv()
    assert msg["t"] == wire.ERROR
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
            PeerConnection(intruder, [("127.0.0.1", peer.port)], intruder.key, intruder.client_id)
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
    msg = {"t": wire.SUBMIT, "id": 1, "fn": serialization.dumps(side_effect)[0],
           "args": serialization.dumps(((str(marker),), {}))[0], "req": {}}
    conn.send(msg)
    reply = closing_error(conn)
    assert reply["code"] == "auth"
    sock.close()
    time.sleep(1.0)
    assert not marker.exists()
    assert honest_call_works(client)


def test_a_replayed_auth_is_refused(target):
    peer, client = target
    _, first, hello1 = raw(peer)
    nonce_s = os.urandom(32)
    recorded, _ = wire.auth(hello1, peer.key.encode(), "recorded", nonce_s)
    _, second, hello2 = raw(peer)
    assert hello1["nonce"] != hello2["nonce"]
    second.send(dict(recorded))  # valid for the first connection's nonce only
    assert closing_error(second)["code"] == "auth"
    first.send(dict(recorded))
    assert first.recv()[0]["t"] == wire.AUTH_OK
    assert honest_call_works(client)


@pytest.mark.parametrize("payload, code", [
    (b"\x00\x00\x00\x05hello", "protocol"),  # not msgpack
    (struct.pack(">I", 0xFFFFFFF0), "too-large"),  # a huge length prefix before auth
    (struct.pack(">I", 3) + msgpack.packb([1, 2]), "protocol"),  # not a map
    (b"".join(wire.encode({"t": "launch-missiles"})), "protocol"),  # unknown type
])
def test_malformed_frames_close_the_connection_with_a_clear_error(target, payload, code):
    peer, client = target
    sock, conn, _ = raw(peer)
    sock.sendall(payload)
    reply = closing_error(conn)
    assert reply["code"] == code and reply["message"]
    assert honest_call_works(client)


def test_a_wrong_protocol_version_is_named(target):
    peer, client = target
    sock, conn, _ = raw(peer)
    body = msgpack.packb({"t": wire.AUTH, "v": PROTOCOL_VERSION + 41})
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
