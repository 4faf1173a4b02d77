"""Invite codes: a new machine gets the cluster key from a peer by typing a short code (SPAKE2).

`gpulayer invite` asks a peer (over the secure channel) to open an invite; the peer answers with
a code like `417-harp-moss`: a channel number, which says which invite is meant and travels in
clear, and two words of WORDS, 16 bits that never leave either side. `gpulayer join --invite CODE`
connects to the peer, unauthenticated, and the two run SPAKE2 (the `spake2` package) with the code
as the password. The joiner proves first that it derived the same key (a MAC under it); only then
does the peer send its own proof and the cluster key sealed (AES-GCM) under a key derived from the
exchange. Someone on the path sees two SPAKE2 messages, two MACs and a sealed box: nothing that
tests a guess of the code offline. Someone who guesses gets one guess per attempt; after
MAX_FAILED wrong ones the peer closes the invite and says so in its log. An invite ends at its
time to live, or once it was used `uses` times.

The connection of an exchange can do nothing else: the peer never unpickles anything on it, and
it closes after the exchange (docs/security.md, "Invite codes").
"""

from __future__ import annotations

import hashlib
import hmac
import re
import secrets
import socket
import struct
import time
from collections import deque
from contextlib import closing
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import security
from .protocol import handshake, messages
from .transport.blocking import BlockingConnection, connections
from .errors import ConfigError, GPULayerError, ProtocolError

MAX_FAILED = 3  # wrong codes an invite takes before its peer closes it
MAX_INVITES = 16  # open invites one peer holds at most
MAX_SESSIONS = 32  # exchanges half done (a PAKE message answered, no proof yet) one peer holds at most
SESSION_SECONDS = 10.0  # the time a joiner has between its two messages
MAX_STARTS = 8  # exchanges a peer starts a second at most (each costs it about 10 ms of CPU)
DEFAULT_TTL = 600.0
CHANNELS = 1000  # channel numbers 1..999
MAX_CANDIDATES = 64  # addresses a joiner tries at most
NO_INVITE = "no-invite"  # the error code of a peer without an open invite on that channel
REFUSED = "invite"  # the error code of a refused exchange (a wrong code, a closed invite)
_IDS = (b"gpulayer/invite/joiner", b"gpulayer/invite/peer")
_SEAL_NONCE = bytes(12)  # each seal key seals one key once

WORDS = tuple("""
able acid aged also area army away baby back ball band bank base bath bear beat bell belt bend best bike bird
blue boat body bold bone book boot born boss bowl bulk burn bush busy cake calm camp card care cart case cash cast cave
chef chip city clay club coal coat code coin cold cook cool cope copy cord core corn cost crew crop cube cure dark data
dawn deal dear deck deep deer desk dial dice diet disk dock dome door dose down draw drop drum duck dust duty each east
easy edge envy epic even exit face fact fair fall farm fast fern film fine fire firm fish five flag flat fork form fort
four free frog fuel full fund gain game gate gear gift girl glad glow goal gold golf good grab gray grid grow gulf hair
half hall hand harp hawk head heat herb hero high hill hint hold hole home hook hope horn host hour huge idea inch iron
item jade jazz joke jump jury keen kept kind king kite knee knot lake lamp land lane last leaf lens life lift lime line
link lion list load loan lock loft long loop lord mail main mask meal melt mild milk mind
mint mode moon moss moth nest news nice noon nose note oak ocean open oval oven pace page palm park path peak pear pine
pink plan plum poem pond pool port quiz rain ramp reef rice ring river road robe rock roof rose ruby safe sail salt sand
""".split())
_CODE = re.compile(r"^\s*(\d{1,3})[-\s]+([a-z]+)[-\s]+([a-z]+)\s*$")


class InviteError(GPULayerError):
    """An invite could not be made, or its code was refused or found nowhere."""


class NoOpenInvite(InviteError):
    """No peer tried has the invite's channel open (none refused the code)."""


def new_code(channel: int) -> str:
    """A code for `channel`: the number and two random words."""
    return f"{channel}-{secrets.choice(WORDS)}-{secrets.choice(WORDS)}"


def parse_code(text: str) -> tuple[int, bytes]:
    """(channel, password) of a code as a person typed it (any case, dashes or spaces); else ConfigError."""
    found = _CODE.match(text.lower())
    if not found or not 0 < int(found[1]) < CHANNELS or found[2] not in WORDS or found[3] not in WORDS:
        raise ConfigError(f"{text!r} is not an invite code: expected a number and two words, like 417-harp-moss "
                          "(`gpulayer invite` prints one)")
    channel = int(found[1])
    return channel, f"{channel}-{found[2]}-{found[3]}".encode()


def parse_ttl(text: str) -> float:
    """Seconds of `--ttl`: a number with s, m or h (seconds without), at most a day; else ValueError."""
    found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([smh]?)\s*", text)
    seconds = float(found[1]) * {"": 1, "s": 1, "m": 60, "h": 3600}[found[2]] if found else 0.0
    if not 0 < seconds <= messages.INVITE_MAX_TTL:
        raise ValueError(f"bad time to live {text!r}: expected like 90s, 10m or 2h, at most 24h")
    return seconds


def transcript(channel: int, hello: Mapping[str, Any], joiner: bytes, peer: bytes) -> bytes:
    """What both proofs and the seal key cover: the channel, the peer's HELLO, both SPAKE2 messages."""
    fields = [b"gpulayer/invite/v1", str(channel).encode(), security.hello_digest(hello), joiner, peer]
    return b"".join(struct.pack(">I", len(f)) + f for f in fields)


def _proof(key: bytes, said: bytes) -> bytes:
    return hmac.new(key, said, hashlib.sha256).digest()


def _seal(key: bytes, secret: bytes, said: bytes) -> bytes:
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key).encrypt(_SEAL_NONCE, secret, said)


def _open(key: bytes, sealed: bytes, said: bytes) -> bytes:
    from cryptography.exceptions import InvalidTag
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    try:
        return AESGCM(key).decrypt(_SEAL_NONCE, sealed, said)
    except InvalidTag:
        return b""


def _spake(password: bytes, side: int) -> Any:
    from spake2 import SPAKE2_A, SPAKE2_B  # here: only a peer that serves an invite, or a joiner, needs it

    return (SPAKE2_A if side == 0 else SPAKE2_B)(password, idA=_IDS[0], idB=_IDS[1])


def _refusal(code: str, text: str, request_id: Any = None) -> messages.Message:
    """An ERROR message (as a plain map: the peer reads its code)."""
    return dict(messages.error(code, text, request_id))


# ---- the peer's side --------------------------------------------------------------------------------

@dataclass
class Invite:
    channel: int
    code: str
    expires: float  # monotonic
    uses: int  # left
    failed: int = 0


@dataclass
class _Session:
    invite: Invite
    said: bytes  # the transcript
    keys: tuple[bytes, bytes, bytes]  # (joiner's proof key, peer's proof key, seal key)
    deadline: float


@dataclass
class Invites:
    """A peer's open invites and the exchanges under way; used on its event loop only.

    `step` answers each unauthenticated PAKE or PAKE_CONFIRM message; `warn` is told, in a
    sentence, of each wrong code and of an invite closed after MAX_FAILED of them."""

    key: bytes
    warn: Callable[[str], None]
    clock: Callable[[], float] = time.monotonic
    open: dict[int, Invite] = field(default_factory=dict)  # channel -> invite
    _sessions: dict[object, _Session] = field(default_factory=dict)  # connection -> its exchange
    _starts: deque[float] = field(default_factory=deque)  # when the exchanges of the last second started

    def make(self, ttl: float, uses: int) -> Invite:
        """Open an invite on a free channel; InviteError when MAX_INVITES are open."""
        self._expire()
        if len(self.open) >= MAX_INVITES:
            raise InviteError(f"this peer has {MAX_INVITES} open invites already; let one expire first")
        channel = secrets.choice([c for c in range(1, CHANNELS) if c not in self.open])
        invite = self.open[channel] = Invite(channel, new_code(channel), self.clock() + ttl, uses)
        return invite

    def answer(self, msg: Mapping[str, Any]) -> messages.Message:
        """The reply to an authenticated INVITE request: the new code, or an ERROR."""
        problem = messages.check_invite(msg)
        if problem is not None:
            return _refusal("bad-request", problem, msg.get("id"))
        try:
            invite = self.make(float(msg["ttl"]), msg["uses"])
        except InviteError as exc:
            return _refusal(REFUSED, str(exc), msg.get("id"))
        return {"t": messages.INVITE, "id": msg.get("id"), "code": invite.code, "ttl": msg["ttl"], "uses": invite.uses}

    def step(self, conn: object, hello: Mapping[str, Any], msg: Mapping[str, Any]) -> tuple[messages.Message, bool]:
        """The reply to one message of an exchange on `conn`, and whether the exchange goes on."""
        self._expire()
        if msg["t"] == messages.PAKE:
            return self._start(conn, hello, msg)
        session = self._sessions.pop(conn, None)
        if session is None:
            return _refusal("protocol", "a PAKE_CONFIRM needs a PAKE first on this connection"), False
        problem = messages.check_pake_confirm(msg, from_joiner=True)
        if problem is not None:
            return _refusal("protocol", problem), False
        invite = session.invite
        if self.open.get(invite.channel) is not invite:
            return _refusal(REFUSED, "the invite closed during the exchange"), False
        joiner_key, peer_key, seal_key = session.keys
        if not security.proofs_equal(msg.get("mac"), _proof(joiner_key, session.said)):
            invite.failed += 1
            if invite.failed >= MAX_FAILED:
                del self.open[invite.channel]
                self.warn(f"invite on channel {invite.channel} closed after {invite.failed} attempts with a wrong "
                          "code; make a new one with `gpulayer invite`")
            else:
                self.warn(f"an attempt with a wrong code for the invite on channel {invite.channel} "
                          f"({invite.failed} of {MAX_FAILED})")
            return _refusal(REFUSED, "wrong code"), False
        invite.uses -= 1
        if not invite.uses:
            del self.open[invite.channel]
        return {"t": messages.PAKE_CONFIRM, "mac": _proof(peer_key, session.said),
                "box": _seal(seal_key, self.key, session.said)}, False

    def _start(self, conn: object, hello: Mapping[str, Any], msg: Mapping[str, Any]) -> tuple[messages.Message, bool]:
        problem = messages.check_pake(msg, from_joiner=True)
        if problem is not None:
            return _refusal("protocol", problem), False
        channel, joiner = msg["ch"], msg["m"]
        invite = self.open.get(channel)
        if invite is None:
            return _refusal(NO_INVITE, f"no open invite on channel {channel} here "
                                         "(expired, used up, closed, or made on another peer)"), False
        if conn in self._sessions:
            return _refusal("protocol", "one PAKE a connection"), False
        now = self.clock()
        while self._starts and self._starts[0] <= now - 1.0:
            self._starts.popleft()
        if len(self._starts) >= MAX_STARTS:
            return _refusal("busy", f"more than {MAX_STARTS} exchanges a second: try again"), False
        self._starts.append(now)
        spake = _spake(invite.code.encode(), 1)
        peer = spake.start()
        try:
            shared = spake.finish(joiner)
        except Exception as exc:  # spake2 raises its own errors (and ValueError) for a bad element
            return _refusal("protocol", f"bad PAKE message: {type(exc).__name__}"), False
        said = transcript(invite.channel, hello, joiner, peer)
        while len(self._sessions) >= MAX_SESSIONS:
            del self._sessions[next(iter(self._sessions))]  # the oldest goes: a flood never locks the right one out
        self._sessions[conn] = _Session(invite, said, security.invite_keys(shared, said), now + SESSION_SECONDS)
        return {"t": messages.PAKE, "m": peer}, True

    def forget(self, conn: object) -> None:
        """The connection closed: its exchange, if half done, ends."""
        self._sessions.pop(conn, None)

    def _expire(self) -> None:
        now = self.clock()
        for channel in [c for c, invite in self.open.items() if invite.expires <= now]:
            del self.open[channel]
        for conn in [c for c, session in self._sessions.items() if session.deadline <= now]:
            del self._sessions[conn]


# ---- the joiner's side ------------------------------------------------------------------------------

def request(key: bytes, address: tuple[str, int], ttl: float, uses: int, timeout: float = 5.0) -> messages.Message:
    """Ask the peer at `address` (as a key holder) to open an invite; its reply (the code, ttl, uses)."""
    deadline = time.monotonic() + timeout
    conn = BlockingConnection(socket.create_connection(address, timeout))
    try:
        handshake.client_handshake(conn, key, f"invite-{secrets.token_hex(4)}", timeout)
        conn.send({"t": messages.INVITE, "id": 1, "ttl": ttl, "uses": uses})
        reply, _ = conn.recv(deadline)
        if reply["t"] == messages.ERROR:
            raise InviteError(f"the peer made no invite: {messages.printable(reply.get('message'))}")
        if reply["t"] != messages.INVITE or (problem := messages.check_invite_reply(reply)) is not None:
            raise ProtocolError(f"expected the peer's INVITE reply: {problem or messages.printable(reply['t'], 20)}")
        return reply
    finally:
        conn.close()


def receive_key(code: str, addresses: list[tuple[str, int]], timeout: float = 10.0) -> tuple[bytes, str]:
    """Run the exchange for `code` with the first of `addresses` that has its invite open; return the
    cluster key and the name of the peer that gave it. InviteError when the code is refused (each
    refusal counts as a wrong try there) or no peer has the invite."""
    channel, password = parse_code(code)
    tried: list[str] = []
    with closing(connections(addresses[:MAX_CANDIDATES], timeout, tried)) as reachable:
        for label, conn in reachable:
            try:
                found = _exchange(conn, channel, password, time.monotonic() + timeout)
            except (OSError, ProtocolError) as exc:
                tried.append(f"{label} ({exc})")
                continue
            if found is not None:
                return found
            tried.append(f"{label} (no invite on channel {channel})")
    raise NoOpenInvite(f"no peer has an open invite on channel {channel}: tried "
                      f"{'; '.join(tried) or 'nothing: no peer was found (give --seed HOST:PORT)'}")


def _exchange(conn: BlockingConnection, channel: int, password: bytes,
              deadline: float) -> tuple[bytes, str] | None:
    """The joiner's half on one connection: (key, peer name), or None when that peer has no such invite."""
    hello, _ = conn.recv(deadline)
    if hello["t"] != messages.HELLO or not isinstance(hello.get("peer"), str):
        raise ProtocolError("expected the peer's HELLO")
    spake = _spake(password, 0)
    joiner = spake.start()
    conn.send({"t": messages.PAKE, "ch": channel, "m": joiner})
    reply, _ = conn.recv(deadline)
    if reply["t"] == messages.ERROR and reply.get("code") == NO_INVITE:
        return None
    if reply["t"] == messages.ERROR:
        raise InviteError(f"the peer refused the exchange: {messages.printable(reply.get('message'))}")
    if reply["t"] != messages.PAKE or (problem := messages.check_pake(reply, from_joiner=False)) is not None:
        raise ProtocolError(f"expected the peer's PAKE message: {problem or messages.printable(reply['t'], 20)}")
    peer = reply["m"]
    try:
        shared = spake.finish(peer)
    except Exception as exc:  # spake2's errors for a bad element
        raise ProtocolError(f"bad PAKE message from the peer: {type(exc).__name__}") from None
    said = transcript(channel, hello, joiner, peer)
    joiner_key, peer_key, seal_key = security.invite_keys(shared, said)
    conn.send({"t": messages.PAKE_CONFIRM, "mac": _proof(joiner_key, said)})
    reply, _ = conn.recv(deadline)
    name = messages.printable(hello.get("advert", {}).get("n", hello["peer"]) if isinstance(hello.get("advert"), dict)
                          else hello["peer"], 64)
    if reply["t"] == messages.ERROR:
        raise InviteError(f"peer {name} refused the code ({messages.printable(reply.get('message'))}): check it; "
                          f"each wrong try counts, and the invite closes after {MAX_FAILED}")
    if reply["t"] != messages.PAKE_CONFIRM or messages.check_pake_confirm(reply, from_joiner=False) is not None \
            or not security.proofs_equal(reply["mac"], _proof(peer_key, said)):
        raise InviteError(f"peer {name} did not prove that it knows the code: not taking a key from it")
    key = _open(seal_key, reply["box"], said)
    if not key:
        raise InviteError(f"the key from peer {name} did not open")
    try:
        security.check_key(key, f"the invite of peer {name}").decode()
    except (UnicodeDecodeError, ConfigError) as exc:
        raise InviteError(f"the key from peer {name} is no good: {exc}") from None
    if security.cluster_id(key) != hello.get("cluster"):
        raise InviteError(f"the key from peer {name} is not that of the cluster it advertises")
    return key, name
