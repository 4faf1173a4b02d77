"""The authentication handshake: HELLO, AUTH, AUTH_OK, and the session keys it gives (ADR 0003, 0008).

The peer greets with a nonce and its advert; the submitter proves the cluster key over the whole
transcript, the peer proves it back, and both derive the channel's keys from the transcript.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any, Protocol

from .. import security
from ..errors import AuthError, ProtocolError
from .messages import AUTH, AUTH_OK, ERROR, HELLO, PROTOCOL_VERSION, HelloMessage, Message, Outgoing, printable
from .messages import check_auth as check_auth_shape, check_hello


class Link(Protocol):
    """What the submitter's half runs over: a blocking connection (transport/blocking.py)."""

    def send(self, msg: Outgoing) -> None: ...

    def recv(self, deadline: float | None = None) -> tuple[Message, list[Any]]: ...

    def secure(self, send_key: bytes, recv_key: bytes) -> None: ...


HANDSHAKE_TIMEOUT = 3.0  # the submitter's bound on the whole handshake, slow drips included (the peer's: PeerConfig)


def hello(nonce: bytes, peer_id: str, cluster: str, txt: dict[str, str]) -> HelloMessage:
    """The peer's greeting: a fresh nonce and its (public) advert. It carries "v" already,
    so that both sides digest the same map."""
    return {"t": HELLO, "v": PROTOCOL_VERSION, "nonce": nonce, "peer": peer_id, "cluster": cluster, "advert": txt}


def transcript(hello_msg: Mapping[str, Any], nonce_s: bytes, client_id: str) -> bytes:
    """The handshake transcript both sides compute: the version, both nonces, the peer id, HELLO, the client."""
    return security.handshake_transcript(PROTOCOL_VERSION, hello_msg["nonce"], nonce_s, str(hello_msg["peer"]),
                                         security.hello_digest(hello_msg), client_id)


def auth(hello_msg: Message, key: bytes, client_id: str, nonce_s: bytes | None = None) -> tuple[Message, bytes]:
    """The submitter's AUTH answering `hello_msg`, and the transcript it proves."""
    nonce_s = nonce_s or security.new_nonce()
    proven = transcript(hello_msg, nonce_s, client_id)
    return {"t": AUTH, "nonce": nonce_s, "mac": security.submitter_proof(key, proven), "client": client_id}, proven


def client_handshake(conn: Link, key: bytes, client_id: str,
                     timeout: float = HANDSHAKE_TIMEOUT) -> Message:
    """Run the submitter's half of the handshake within `timeout` in all; return the peer's HELLO.

    Both proofs cover the whole transcript; then the connection is secured with the session
    keys derived from it. Raises AuthError when either side's proof fails, socket.timeout
    when the peer is too slow (a slow drip of bytes included).
    """
    deadline = time.monotonic() + timeout
    msg, _ = conn.recv(deadline)
    if msg["t"] == ERROR:
        raise ProtocolError(f"peer refused the connection: {printable(msg.get('message'))}")
    problem = check_hello(msg)
    if problem is not None:
        raise ProtocolError(problem)
    name = printable(msg["peer"])
    request, proven = auth(msg, key, client_id)
    conn.send(request)
    reply, _ = conn.recv(deadline)
    if reply["t"] == ERROR:
        raise AuthError(f"peer {name} refused authentication: {printable(reply.get('message'))}")
    if reply["t"] != AUTH_OK or not security.proofs_equal(reply.get("mac"), security.peer_proof(key, proven)):
        raise AuthError(f"peer {name} failed to prove the cluster key")
    conn.secure(*security.session_keys(key, proven, security.SUBMITTER))
    return msg


def check_auth(msg: Message, key: bytes, hello_msg: Mapping[str, Any]) -> tuple[Message, tuple[bytes, bytes]] | None:
    """The peer's check of an AUTH answering `hello_msg`: (AUTH_OK, (send_key, recv_key)), or None."""
    if check_auth_shape(msg) is not None:
        return None
    proven = transcript(hello_msg, msg["nonce"], msg.get("client", ""))
    if not security.proofs_equal(msg.get("mac"), security.submitter_proof(key, proven)):
        return None
    return {"t": AUTH_OK, "mac": security.peer_proof(key, proven)}, security.session_keys(key, proven, security.PEER)
