"""A scripted raw-socket attacker against a live peer, bounded in rounds and in time.

    python lan_attacker.py '{"host": ..., "port": ..., "key": ..., "marker": ..., "seconds": 30, ...}'

It cycles through hostile inputs: random bytes, random frames, truncated frames, huge length
prefixes, valid frames of unknown type or version, non-map messages, bad buffer counts, SUBMIT
and other messages before AUTH (carrying pickles that would create `marker` if anything
unpickled them), AUTH with a wrong key, AUTH proving another handshake (a changed HELLO, another
client name), AUTH replayed from another connection (and after AUTH_OK, in clear and sealed),
floods of half-open connections, and connections that go silent mid-frame.

After a real AUTH (the attacker holds a stolen key there: `authenticated()` runs the protocol v2
handshake and derives the session keys, so it reads the peer's sealed replies and seals frames
of its own), every byte must be a record: garbage sent in clear is refused with code "channel",
and so are replayed, reordered, reflected, bit-flipped and foreign records; garbage frames
sealed properly are refused with the frame codes (too-large, protocol, version).

For each it records how the peer reacted, and a violation whenever the peer did something it
must not: accept a bad AUTH, answer a task before AUTH, answer with an unexpected error, send a
record that does not open, or leave a bad connection open past its bounds. It prints one JSON
line of statistics at the end.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import resource
import select
import socket
import struct
import sys
import time
from collections import Counter, defaultdict

import msgpack

from gpulayer import security
from gpulayer.errors import ProtocolError
from gpulayer.protocol import framing, handshake, messages, records
from gpulayer.resources.model import PROTOCOL_VERSION

HEADER = struct.Struct(">I")
HANDSHAKE_TIMEOUT = 5.0  # the peer's; a silent half-frame must be closed by then (plus slack)


class Bomb:
    """Unpickling this creates a file: proof that something unpickled attacker data."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "a"))


def frame(obj) -> bytes:
    body = msgpack.packb(obj) if not isinstance(obj, (bytes, bytearray)) else bytes(obj)
    return HEADER.pack(len(body)) + body


def message(**fields) -> bytes:
    return frame({"v": PROTOCOL_VERSION, **fields})


class Session:
    """A connection that passed the handshake with the (stolen) key, and its secure channel."""

    def __init__(self, sock: socket.socket, hello: dict, auth: bytes, key: bytes, transcript: bytes):
        self.sock, self.hello, self.auth = sock, hello, auth
        self.send_key, self.recv_key = security.session_keys(key, transcript, security.SUBMITTER)
        self.sealer, self.opener = records.Sealer(self.send_key), records.Opener(self.recv_key)

    def seal(self, data: bytes) -> bytes:
        """`data` (frame bytes, or anything) as the next record of this connection."""
        return b"".join(self.sealer.seal([data]))


class Attacker:
    def __init__(self, cfg: dict):
        self.cfg = cfg
        self.address = (cfg["host"], cfg["port"])
        self.key = cfg["key"].encode()
        self.rng = random.Random(cfg.get("seed", 1))
        self.bomb = pickle.dumps(Bomb(cfg["marker"]))
        self.stats = defaultdict(Counter)  # kind -> reaction -> count
        self.violations: list[str] = []
        self.held: list[tuple[socket.socket, float, str]] = []  # silent half-frames, and their deadline
        self.rounds = 0
        self.connections = 0

    # ---- plumbing ----------------------------------------------------------------------------------

    def connect(self) -> socket.socket:
        sock = socket.create_connection(self.address, timeout=10)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.connections += 1
        return sock

    @staticmethod
    def read(sock: socket.socket, timeout: float, until_eof: bool = True,
             opener: records.Opener | None = None) -> tuple[list[dict], str]:
        """The messages the peer sends within `timeout`, and how the connection ended: eof, reset or open.

        With `opener` (after AUTH_OK) what arrives is opened as records first. A record that does
        not open, or a frame the codec refuses, ends the reading with state "bad-records" or
        "bad-frames": the peer must never send either.
        """
        reader = framing.MessageReader(1 << 22)
        deadline = time.monotonic() + timeout
        state = "open"
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or (not until_eof and reader.messages):
                break
            poller = select.poll()  # not select(): the attacker holds more than 1024 descriptors at times
            poller.register(sock, select.POLLIN)
            if not poller.poll(left * 1000):
                break
            try:
                data = sock.recv(65536)
            except (ConnectionResetError, OSError):
                state = "reset"
                break
            if not data:
                state = "eof"
                break
            try:
                if opener is None:
                    records.deliver(reader, data)
                else:
                    opener.feed_bytes_into(data, reader)
            except records.ChannelError:
                state = "bad-records"
                break
            except ProtocolError:
                state = "bad-frames"
                break
        return [m for m, _ in reader.messages], state

    def hello(self, sock: socket.socket) -> dict:
        msgs, state = self.read(sock, 5, until_eof=False)
        if not msgs or msgs[0].get("t") != messages.HELLO:
            raise RuntimeError(f"no HELLO from the peer ({state}): {msgs!r}")
        return msgs[0]

    def expect_refusal(self, kind: str, sock: socket.socket, codes: set[str], timeout: float = 6.0,
                       session: Session | None = None, answered: int = 0) -> None:
        """The peer must answer with one ERROR of an allowed code and close (or reset); nothing else.

        With `session`, the answer is read as sealed records. `answered`: how many PONGs may come
        before the ERROR (honest PINGs sent just before the bad input; the peer may answer them,
        or close before it reads them).
        """
        msgs, state = self.read(sock, timeout, opener=session.opener if session else None)
        sock.close()
        first = [m.get("t") for m in msgs]
        while answered and msgs and msgs[0].get("t") == messages.PONG:
            msgs, answered = msgs[1:], answered - 1
        kinds = [m.get("t") for m in msgs]
        code = msgs[0].get("code") if msgs and msgs[0].get("t") == messages.ERROR else None
        self.stats[kind][f"{code or ','.join(kinds) or '-'}/{state}"] += 1
        if state in ("bad-records", "bad-frames"):
            self.violations.append(f"{kind}: the peer's reply did not open or decode ({state}) after {first}")
        elif any(t in (messages.AUTH_OK, messages.RESULT, messages.ACCEPT, messages.LOG) for t in kinds):
            self.violations.append(f"{kind}: the peer answered {kinds}")
        elif msgs and code not in codes:
            self.violations.append(f"{kind}: unexpected answer {msgs[0]!r} (allowed: {sorted(codes)})")
        elif state == "open":
            self.violations.append(f"{kind}: the peer kept the connection open for {timeout} s")
        elif len(msgs) > 1:
            self.violations.append(f"{kind}: more than one answer: {kinds}")

    def hold(self, kind: str, sock: socket.socket) -> None:
        """A connection left silent mid-frame: the peer must close it after its handshake timeout."""
        self.held.append((sock, time.monotonic() + HANDSHAKE_TIMEOUT + 3.0, kind))

    def reap(self, force: bool = False) -> None:
        now = time.monotonic()
        keep = []
        for sock, deadline, kind in self.held:
            if not force and deadline > now:
                keep.append((sock, deadline, kind))
                continue
            wait = max(0.0, deadline - now) if force else 0.05
            self.expect_refusal(kind, sock, {"timeout"}, timeout=wait + 0.05)
            now = time.monotonic()
        self.held = keep

    def authenticated(self) -> Session:
        """A connection that really authenticated (the attacker stole the key: only for post-auth input).

        The protocol v2 handshake: AUTH proves the whole transcript (handshake.auth), the peer's
        AUTH_OK must prove it too, and both sides then hold the session keys of this connection.
        """
        sock = self.connect()
        hello = self.hello(sock)
        request, transcript = handshake.auth(hello, self.key, "attacker", security.new_nonce())
        auth = message(**request)
        sock.sendall(auth)
        msgs, state = self.read(sock, 5, until_eof=False)  # AUTH_OK is the last frame in clear; nothing follows
        if not msgs or msgs[0].get("t") != messages.AUTH_OK:
            raise RuntimeError(f"the real key was refused: {msgs!r} {state}")
        if not security.proofs_equal(msgs[0].get("mac"), security.peer_proof(self.key, transcript)):
            self.violations.append("authenticated: AUTH_OK did not prove the transcript")
        if len(msgs) > 1:
            self.violations.append(f"authenticated: frames in clear after AUTH_OK: {[m.get('t') for m in msgs]}")
        return Session(sock, hello, auth, self.key, transcript)

    # ---- the attacks ---------------------------------------------------------------------------------

    def random_bytes(self) -> None:
        sock = self.connect()
        self.hello(sock)
        size = self.rng.choice([1, 2, 3, 5, 17, 100, 1000, 4100, 9000])
        payload = self.rng.randbytes(size)
        sock.sendall(payload)
        (length,) = HEADER.unpack(payload[:4]) if size >= 4 else (None,)
        if length is None or (length <= framing.PRE_AUTH_MAX_FRAME and size - 4 < length):
            self.hold("random_bytes_incomplete", sock)  # an incomplete frame: the peer waits, then times out
        else:
            self.expect_refusal("random_bytes", sock, {"too-large", "protocol", "version", "auth"})

    def random_frame(self) -> None:
        sock = self.connect()
        self.hello(sock)
        sock.sendall(frame(self.rng.randbytes(self.rng.randint(0, framing.PRE_AUTH_MAX_FRAME))))
        self.expect_refusal("random_frame", sock, {"protocol", "version", "auth"})

    def truncated(self) -> None:
        sock = self.connect()
        self.hello(sock)
        whole = message(t=messages.AUTH, nonce=os.urandom(32), mac=os.urandom(32), client="x" * 30)
        cut = self.rng.randint(1, len(whole) - 1)
        sock.sendall(whole[:cut])
        if self.rng.random() < 0.15:
            self.hold("truncated_then_silent", sock)
        else:
            sock.close()  # truncated, then gone
            self.stats["truncated_then_close"]["sent"] += 1

    def huge_length(self) -> None:
        sock = self.connect()
        self.hello(sock)
        length = self.rng.choice([framing.PRE_AUTH_MAX_FRAME + 1, 1 << 20, 1 << 31, 0xFFFFFFFF])
        sock.sendall(HEADER.pack(length) + self.rng.randbytes(self.rng.randint(0, 64)))
        self.expect_refusal("huge_length", sock, {"too-large"})

    def unknown_type(self) -> None:
        sock = self.connect()
        self.hello(sock)
        name = self.rng.choice(["frobnicate", "", "x" * 200, "SUBMIT", "hello\x00", "exec"])
        sock.sendall(message(t=name, payload=self.bomb))
        self.expect_refusal("unknown_type", sock, {"protocol"})

    def wrong_version(self) -> None:
        sock = self.connect()
        self.hello(sock)
        version = self.rng.choice([PROTOCOL_VERSION + 1, -1, "1", None, 2 ** 40])
        sock.sendall(frame({"t": messages.AUTH, "v": version, "nonce": os.urandom(32), "mac": os.urandom(32)}))
        self.expect_refusal("wrong_version", sock, {"version"})

    def not_a_map(self) -> None:
        sock = self.connect()
        self.hello(sock)
        sock.sendall(frame(self.rng.choice([[1, 2, 3], 42, "auth", None, b"\x00" * 10, {"t": 5},
                                            {1: 2}, [{"t": "auth"}]])))
        self.expect_refusal("not_a_map", sock, {"protocol"})

    def bad_buffer_count(self) -> None:
        sock = self.connect()
        self.hello(sock)
        nb = self.rng.choice([-1, framing.MAX_BUFFERS + 1, 10 ** 9, "3", 2.5])
        sock.sendall(message(t=messages.AUTH, nb=nb, nonce=os.urandom(32), mac=os.urandom(32)))
        self.expect_refusal("bad_buffer_count", sock, {"protocol", "auth"})

    def buffers_before_auth(self) -> None:
        """Out-of-band buffers before AUTH: refused at their message's header."""
        sock = self.connect()
        self.hello(sock)
        sock.sendall(message(t=messages.SUBMIT, nb=4, id=1, fn=self.bomb, args=self.bomb)
                     + b"".join(frame(self.rng.randbytes(2000)) for _ in range(4)))
        self.expect_refusal("buffers_before_auth", sock, {"protocol", "auth"})

    def submit_before_auth(self) -> None:
        sock = self.connect()
        self.hello(sock)
        kind = self.rng.choice([messages.SUBMIT, messages.STATUS, messages.PING, messages.CANCEL, messages.RESULT,
                                messages.BYE])
        sock.sendall(message(t=kind, id=self.rng.randint(0, 2 ** 31), fn=self.bomb, args=self.bomb, req={},
                             data=self.bomb))
        self.expect_refusal(f"{kind}_before_auth", sock, {"auth"})

    def bombs_in_auth(self) -> None:
        sock = self.connect()
        self.hello(sock)
        sock.sendall(message(t=messages.AUTH, nonce=self.bomb[:32].ljust(32, b"\0"), mac=self.bomb, client=self.bomb))
        self.expect_refusal("bombs_in_auth", sock, {"auth"})

    def wrong_key(self) -> None:
        sock = self.connect()
        hello = self.hello(sock)
        key = self.rng.choice([b"wrong", self.key + b"x", self.key[:-1], b""])
        request, _ = handshake.auth(hello, key, "intruder", security.new_nonce())
        sock.sendall(message(**request))
        self.expect_refusal("wrong_key", sock, {"auth"})

    def spliced_auth(self) -> None:
        """The right key, but a proof of another handshake: what a relay that changes HELLO or AUTH gets."""
        sock = self.connect()
        hello = self.hello(sock)
        choice = self.rng.randrange(4)
        if choice == 0:  # HELLO changed on the way (a relay advertising better resources)
            request, _ = handshake.auth({**hello, "advert": {**hello["advert"], "sl": "64"}}, self.key, "x")
        elif choice == 1:  # another peer's id
            request, _ = handshake.auth({**hello, "peer": "someone-else"}, self.key, "x")
        elif choice == 2:  # another peer nonce (a HELLO of another connection)
            request, _ = handshake.auth({**hello, "nonce": security.new_nonce()}, self.key, "x")
        else:  # the client name changed after the proof
            request, _ = handshake.auth(hello, self.key, "honest")
            request["client"] = "attacker"
        sock.sendall(message(**request))
        self.expect_refusal(f"spliced_auth_{choice}", sock, {"auth"})

    def replayed_auth(self) -> None:
        session = self.authenticated()  # an AUTH seen on the wire, valid for that connection only
        other = self.connect()
        self.hello(other)
        other.sendall(session.auth)
        self.expect_refusal("replayed_auth_other_connection", other, {"auth"})
        if self.rng.random() < 0.5:  # and again on its own connection, after AUTH_OK: in clear, not a record
            session.sock.sendall(session.auth)
            self.expect_refusal("replayed_auth_same_connection_clear", session.sock, {"channel"}, session=session)
        else:  # sealed: a valid record of an AUTH, which is not a submitter's message after the handshake
            session.sock.sendall(session.seal(session.auth))
            self.expect_refusal("replayed_auth_same_connection_sealed", session.sock, {"protocol"},
                                session=session)

    def post_auth_garbage(self) -> None:
        """Garbage in clear after AUTH_OK: not a record, so the channel refuses it, whatever it says."""
        session = self.authenticated()
        choice = self.rng.randrange(5)
        if choice == 0:
            data = HEADER.pack(0xFFFFFFFF)  # a length no record has: refused at its header
        elif choice == 1:
            data = frame(self.rng.randbytes(self.rng.randint(1, 3000)))
        elif choice == 2:
            data = message(t="frobnicate")
        elif choice == 3:  # a well-formed SUBMIT in clear, carrying bombs: what a relay would inject
            data = message(t=messages.SUBMIT, id=1, fn=self.bomb, args=self.bomb, req={}, timeout=None, name="x")
        else:
            data = self.rng.randbytes(self.rng.choice([4, 20, 100]))
            data = HEADER.pack(self.rng.randint(0, 15)) + data  # shorter than a tag
        session.sock.sendall(data)
        self.expect_refusal(f"post_auth_clear_{choice}", session.sock, {"channel"}, session=session)

    def post_auth_sealed_garbage(self) -> None:
        """Garbage frames sealed properly: the records open, and the frame codec refuses what they say."""
        session = self.authenticated()
        choice = self.rng.randrange(4)
        if choice == 0:
            data, codes = HEADER.pack(0xFFFFFFFF), {"too-large"}  # the peer runs with an 8 MiB message limit
        elif choice == 1:
            data, codes = frame(self.rng.randbytes(self.rng.randint(1, 3000))), {"protocol", "version"}
        elif choice == 2:
            data, codes = message(t="frobnicate"), {"protocol"}
        else:
            data, codes = frame({"t": messages.PING, "v": self.rng.choice([1, PROTOCOL_VERSION + 1, None])}), {"version"}
        session.sock.sendall(session.seal(data))
        self.expect_refusal(f"post_auth_sealed_{choice}", session.sock, codes, session=session)

    def post_auth_bad_records(self) -> None:
        """Records that do not belong here: replayed, reordered, bit-flipped, reflected, of another connection."""
        session = self.authenticated()
        ping = message(t=messages.PING, id=7)
        choice = self.rng.randrange(6)
        answered = 0
        if choice == 0:  # a record replayed: it opened once (a PONG may come), its counter is spent
            record = session.seal(ping)
            data, answered = record + record, 1
        elif choice == 1:  # two records swapped
            first, second = session.seal(ping), session.seal(ping)
            data = second + first
        elif choice == 2:  # one bit flipped, anywhere past the length
            record = bytearray(session.seal(ping))
            record[self.rng.randrange(4, len(record))] ^= 1 << self.rng.randrange(8)
            data = bytes(record)
        elif choice == 3:  # sealed with the other direction's key (a reflected record)
            data = b"".join(records.Sealer(session.recv_key).seal([ping]))
        elif choice == 4:  # a record of another connection (its keys are its own)
            other = self.authenticated()
            data = other.seal(ping)
            other.sock.close()
        else:  # a length out of bounds, in a record's header
            data = HEADER.pack(self.rng.choice([0, 15, records.RECORD_MAX + records.TAG + 1])) + bytes(32)
        session.sock.sendall(data)
        self.expect_refusal(f"post_auth_record_{choice}", session.sock, {"channel"}, session=session,
                            answered=answered)

    def flood(self, count: int) -> None:
        """Many connections that never send a byte (half-open at the protocol level), held a moment."""
        socks = []
        try:
            for _ in range(count):
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.setblocking(False)
                try:
                    s.connect(self.address)
                except BlockingIOError:
                    pass
                socks.append(s)
            self.connections += count
            time.sleep(1.5)
        finally:
            for s in socks:
                s.close()
        self.stats["half_open_flood"][f"{count} held 1.5 s"] += 1

    # ---- the loop --------------------------------------------------------------------------------------

    def run(self) -> dict:
        attacks = [self.random_bytes, self.random_frame, self.truncated, self.huge_length, self.unknown_type,
                   self.wrong_version, self.not_a_map, self.bad_buffer_count, self.buffers_before_auth,
                   self.submit_before_auth, self.bombs_in_auth, self.wrong_key, self.spliced_auth,
                   self.replayed_auth, self.post_auth_garbage, self.post_auth_sealed_garbage,
                   self.post_auth_bad_records]
        if self.cfg.get("kinds"):
            attacks = [a for a in attacks if a.__name__ in self.cfg["kinds"]]
        started = time.monotonic()
        seconds, max_rounds = self.cfg.get("seconds", 30), self.cfg.get("max_rounds", 20_000)
        flood_every, flood_size = self.cfg.get("flood_every", 8.0), self.cfg.get("flood", 2000)
        next_flood = started + 1.0
        errors = Counter()
        while self.rounds < max_rounds and time.monotonic() - started < seconds:
            self.rounds += 1
            try:
                if flood_size and time.monotonic() >= next_flood:
                    self.flood(flood_size)
                    next_flood = time.monotonic() + flood_every
                else:
                    attacks[self.rounds % len(attacks)]()
            except (OSError, RuntimeError) as exc:  # the peer must keep accepting; count what went wrong
                errors[f"{type(exc).__name__}: {exc}"[:120]] += 1
            if self.rounds % 20 == 0:
                self.reap()
        self.reap(force=True)
        if sum(errors.values()) > max(5, self.rounds // 100):
            self.violations.append(f"connecting or handshaking failed too often: {dict(errors)}")
        return {"rounds": self.rounds, "connections": self.connections, "seconds": time.monotonic() - started,
                "marker_exists": os.path.exists(self.cfg["marker"]), "errors": dict(errors),
                "violations": self.violations[:50], "violation_count": len(self.violations),
                "reactions": {kind: dict(c) for kind, c in sorted(self.stats.items())}}


def main() -> None:
    cfg = json.loads(sys.argv[1])
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    print(json.dumps(Attacker(cfg).run()), flush=True)


if __name__ == "__main__":
    main()
