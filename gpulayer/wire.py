"""Frames, messages, limits and the authentication handshake.

A frame is a 4-byte big-endian length followed by that many bytes. A message is one frame
holding a msgpack map {"t": type, "v": version, ...}; when the map has "nb": N, the next N
frames are raw out-of-band buffers that belong to it (large arrays travel this way, never
re-copied into one big bytes object).

`MessageReader` is sans-IO: the caller fills `buffer()` from its socket (blocking or asyncio)
and calls `feed(n)`. Large frames are read straight into their own bytearray.
"""

from __future__ import annotations

import mmap
import os
import socket
import struct
import time
from collections import deque
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any, TypedDict, Union

import msgpack

from . import held, security, shm
from .checks import check_timeout
from .errors import AuthError, ConfigError, FrameTooLarge, ProtocolError, VersionMismatch
from .shm import MAX_BUFFERS as MAX_BUFFERS  # re-exported: the frame header's buffer count is checked against it

if TYPE_CHECKING:
    from . import records

PROTOCOL_VERSION = 2  # in every message ("v") and every advert ("ver"); bump on any incompatible change

HELLO, AUTH, AUTH_OK = "hello", "auth", "auth_ok"
SUBMIT, ACCEPT, REJECT = "submit", "accept", "reject"
LOG, RESULT, ERROR, CANCEL = "log", "result", "error", "cancel"
PING, PONG, STATUS, BYE = "ping", "pong", "status", "bye"
ACTOR, CALL, CLOSE, ACTOR_END = "actor", "call", "close", "actor_end"  # actors (docs/actors.md)
FETCH, RELEASE = "fetch", "release"  # held results (docs/data.md)
LOCAL = "local"  # the peer's offer of a local link for shared memory (shm.py, ADR 0009)
WITHDRAW = "withdraw"  # the submitter takes back a task still queued on the peer (ADR 0011)
DIRECT = "direct"  # the submitter asks that this connection be handed to an actor's worker (ADR 0012)
LEASE, LEASE_END = "lease", "lease_end"  # a warm worker lent to one submitter's connection (ADR 0013)
WAIT = "wait"  # a worker's task blocks on a future, or goes on: its slot is lent meanwhile (ADR 0014)
BLOB, FILE = "blob", "file"  # a job's working folder up, its files down (gpulayer/jobs/transfer.py)
# jobs (ADR 0016; their builders and checks are in jobs/messages.py): requests, then the peer's replies
JOB_SUBMIT, JOB_LIST, JOB_LOGS, JOB_WAIT, JOB_STOP, JOB_FETCH, JOB_RM = (
    "job_submit", "job_list", "job_logs", "job_wait", "job_stop", "job_fetch", "job_rm")
JOB_NEED, JOB_INFO, JOB_LOG = "job_need", "job_info", "job_log"
JOB_REQUESTS = frozenset({JOB_SUBMIT, BLOB, JOB_LIST, JOB_LOGS, JOB_WAIT, JOB_STOP, JOB_FETCH, JOB_RM})
MESSAGE_TYPES = frozenset({HELLO, AUTH, AUTH_OK, SUBMIT, ACCEPT, REJECT, LOG, RESULT, ERROR,
                           CANCEL, PING, PONG, STATUS, BYE, ACTOR, CALL, CLOSE, ACTOR_END, FETCH, RELEASE,
                           LOCAL, WITHDRAW, DIRECT, LEASE, LEASE_END, WAIT, BLOB, FILE, *JOB_REQUESTS, JOB_NEED,
                           JOB_INFO, JOB_LOG})

# The messages (docs/wire.md has the full table). "id" is the task id, or a request id for
# STATUS and PING; "load" ([busy, queued]) and, on a GPU peer, "free" (GB) ride on the peer's replies.
Message = dict[str, Any]  # any decoded message: check "t" before reading the rest


class Envelope(TypedDict, total=False):
    """The keys any message may carry; `encode` sets "v" and "nb"."""

    v: int  # the protocol version
    nb: int  # how many out-of-band buffer frames follow
    fds: list[list[int]]  # [position, size] of the buffers that came first on the local link (shm.py)
    id: int | None
    load: list[int]
    free: float  # on a GPU peer's replies: the most GB one task may take now on one device
    submitters: int  # on the peer's replies: how many submitters contend for its slots (ADR 0011)
    ran: float  # on a task's outcome: the seconds it ran (ADR 0011)
    w: bool  # on an ACCEPT: the task is queued, and WITHDRAW may take it back until it starts (ADR 0011)


class _SubmitOptions(TypedDict, total=False):
    env: dict[str, str]  # the task's environment variables (check_env); omitted when there are none
    keep: str  # keep the result on the peer under this id (held.new_result_id; docs/data.md)
    refs: list[dict[str, Any]]  # the held results among its arguments (`ref` entries)


class SubmitMessage(Envelope, _SubmitOptions):
    t: str
    fn: bytes  # the pickled function
    args: bytes  # the pickled (args, kwargs), with "nb" out-of-band buffers after it
    req: dict[str, Any]  # Requirements.to_wire()
    timeout: float | None
    name: str


class ErrorMessage(Envelope, total=False):
    t: str
    code: str  # auth, protocol, too-large, version, bad-request, timeout, cancelled, exception, worker-died, ...
    message: str
    type: str  # for "exception": the qualified type name; "exc" the pickled exception, "tb" the traceback
    exc: bytes | None
    tb: str


class RejectMessage(Envelope):
    t: str
    code: str  # busy, no-match, bad-request
    message: str


class LogMessage(Envelope):
    t: str
    stream: str  # "out" or "err"
    data: bytes


class HelloMessage(Envelope):
    t: str
    nonce: bytes
    peer: str
    cluster: str
    advert: dict[str, str]


# Union, not "|": a job interpreter may be a Python older than 3.10 (see docs/apple-silicon.md)
Outgoing = Union[Message, Envelope]  # what the senders take: a typed message or a plain map
Buffers = Union[list[Any], tuple[Any, ...]]  # out-of-band buffers: anything with the buffer protocol


def submit(task_id: int, fn: bytes, args: bytes, req: dict[str, Any], timeout: float | None,
           name: str, env: Mapping[str, str] | None = None, keep: str | None = None,
           refs: list[dict[str, Any]] | None = None) -> SubmitMessage:
    msg: SubmitMessage = {"t": SUBMIT, "id": task_id, "fn": fn, "args": args, "req": req, "timeout": timeout,
                          "name": name}
    if env:
        msg["env"] = dict(env)
    if keep is not None:
        msg["keep"] = keep
    if refs:
        msg["refs"] = refs
    return msg


ACTOR_ID_HEX = 32  # an actor id: 16 random bytes in hex, unguessable


def actor(task_id: int, cls: bytes, args: bytes, req: dict[str, Any], timeout: float | None, name: str,
          concurrency: int, env: Mapping[str, str] | None = None) -> Message:
    """Create an actor: like SUBMIT, with the pickled class in "cls" and its max_concurrency in "conc"."""
    msg: Message = {"t": ACTOR, "id": task_id, "cls": cls, "args": args, "req": req, "timeout": timeout,
                    "name": name, "conc": concurrency}
    if env:
        msg["env"] = dict(env)
    return msg


def call(call_id: int, actor_id: str, method: str, args: bytes, timeout: float | None) -> Message:
    """Call a method of a live actor; answered like a task (LOG, RESULT, ERROR), matched by "id"."""
    return {"t": CALL, "id": call_id, "actor": actor_id, "method": method, "args": args, "timeout": timeout}


def direct(request_id: int, actor_id: str) -> Message:
    """Ask, as the first message after AUTH_OK, that the connection go to the actor's worker (ADR 0012)."""
    return {"t": DIRECT, "id": request_id, "actor": actor_id}


BEAT_MIN, BEAT_MAX = 0.05, 60.0  # seconds between a leased worker's signs of life, at least and at most


def lease(request_id: int, req: dict[str, Any], beat: float) -> Message:
    """Ask, as the first message after AUTH_OK, that the connection go to a warm worker that runs this
    submitter's tasks of requirements `req` until the lease ends, and that says it is alive every
    `beat` seconds while a task runs (ADR 0013)."""
    return {"t": LEASE, "id": request_id, "req": req, "beat": beat}


def close(request_id: int, actor_id: str) -> Message:
    return {"t": CLOSE, "id": request_id, "actor": actor_id}


def actor_end(actor_id: str, code: str, reason: str, served: int, request_id: int | None = None) -> Message:
    """The peer's word that an actor ended: code "closed" or "died", with the calls it answered."""
    return {"t": ACTOR_END, "id": request_id, "actor": actor_id, "code": code, "message": reason, "served": served}


def check_actor_id(value: Any) -> str | None:
    """Why `value` is not an actor id (ACTOR_ID_HEX lowercase hex digits), or None."""
    if not isinstance(value, str) or len(value) != ACTOR_ID_HEX or value.strip("0123456789abcdef"):
        return f"an actor id is {ACTOR_ID_HEX} lowercase hex digits, not {printable(repr(value), 60)}"
    return None


def check_method(value: Any) -> str | None:
    """Why `value` may not be called as an actor's method (an identifier, not a dunder), or None."""
    if not isinstance(value, str) or not value.isidentifier() or value.startswith("__"):
        return f"an actor method is an identifier not starting with '__', not {printable(repr(value), 60)}"
    return None


def check_call(msg: Mapping[str, Any]) -> str | None:
    """What is wrong with a CALL's method, arguments or timeout, or None."""
    problem = check_method(msg.get("method"))
    if problem is None and not isinstance(msg.get("args"), bytes):
        problem = "a CALL needs 'args' as a binary pickle"
    if problem is None:
        try:
            check_timeout(msg.get("timeout"))
        except ValueError:
            problem = (f"bad timeout {printable(repr(msg.get('timeout')), 60)}: "
                       "a positive, finite number of seconds or nil")
    return problem


MAX_REFS = 256  # held results one task may take as arguments
MAX_REF_ADDRESSES = 8  # addresses of the peer holding one


def check_result_id(value: Any) -> str | None:
    """Why `value` is not a held result's id (RESULT_ID_HEX lowercase hex digits), or None."""
    if not isinstance(value, str) or len(value) != held.RESULT_ID_HEX or value.strip("0123456789abcdef"):
        return f"a result id is {held.RESULT_ID_HEX} lowercase hex digits, not {printable(repr(value), 60)}"
    return None


def ref(result_id: str, peer_id: str, addresses: list[tuple[str, int]]) -> dict[str, Any]:
    """A SUBMIT's "refs" entry: a held result it takes as an argument, and the peer that holds it."""
    return {"ref": result_id, "peer": peer_id, "at": [[host, port] for host, port in addresses]}


def _address(value: Any) -> bool:
    return isinstance(value, list) and len(value) == 2 and isinstance(value[0], str) and len(value[0]) <= 255 \
        and isinstance(value[1], int) and not isinstance(value[1], bool) and 0 < value[1] < 65536


def check_refs(value: Any) -> str | None:
    """Why a SUBMIT's "refs" is not a list of `ref` entries (at most MAX_REFS), or None."""
    if not isinstance(value, list) or len(value) > MAX_REFS:
        return f"'refs' must be a list of at most {MAX_REFS} held results"
    for entry in value:
        if not isinstance(entry, dict):
            return "each of 'refs' must be a map with 'ref', 'peer' and 'at'"
        problem = check_result_id(entry.get("ref"))
        if problem is not None:
            return problem
        at = entry.get("at")
        if not isinstance(entry.get("peer"), str) or not isinstance(at, list) \
                or not 0 < len(at) <= MAX_REF_ADDRESSES or not all(_address(a) for a in at):
            return f"a held result's 'peer' is its peer id and 'at' 1 to {MAX_REF_ADDRESSES} [host, port] pairs"
    return None


def fetch(request_id: int, result_id: str, owner: str | None = None) -> Message:
    """Ask for a held result; answered with a RESULT (its pickle and buffers) or ERROR "no-result".

    A peer fetching for a task names the submitter that owns the result in "for"."""
    msg: Message = {"t": FETCH, "id": request_id, "ref": result_id}
    if owner is not None:
        msg["for"] = owner
    return msg


def release(result_id: str) -> Message:
    """The submitter no longer needs a held result: its peer frees it (no answer)."""
    return {"t": RELEASE, "ref": result_id}


def reject(task_id: int | None, code: str, message: str) -> RejectMessage:
    return {"t": REJECT, "id": task_id, "code": code, "message": message}


def log(task_id: int, stream: str, data: bytes) -> LogMessage:
    return {"t": LOG, "id": task_id, "stream": stream, "data": data}


def cancel(task_id: int) -> Message:
    return {"t": CANCEL, "id": task_id}


def withdraw(task_id: int) -> Message:
    """Take back a queued task: REJECT "withdrawn" if it had not started, else nothing (it runs)."""
    return {"t": WITHDRAW, "id": task_id}


def ping() -> Message:
    return {"t": PING}


def status_request() -> Message:
    return {"t": STATUS}


HEADER = struct.Struct(">I")
PRE_AUTH_MAX_FRAME = 4096
_SMALL = 1 << 18  # the shared receive buffer after auth; bigger frames get a buffer of their own
_HUGE_MIN = 4 << 20
BULK_PIECE = 1 << 20  # while a large frame arrives, wake up for this much at a time
_DROP = memoryview(bytearray(BULK_PIECE))  # where refused buffers are received and dropped
REFUSED = "_refused"  # set by a reader with a `budget` on a message whose buffers it dropped, with the reason
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


KEEPALIVE_IDLE, KEEPALIVE_INTERVAL, KEEPALIVE_COUNT = 10, 5, 3  # a dead link is seen in about 25 s
USER_TIMEOUT_MS = 30_000  # sent data unacknowledged this long closes the connection


def tune(sock: socket.socket) -> None:
    """Options for every GPUlayer TCP connection: no Nagle delay, keepalive, a bound on unacked data.

    Keepalive and TCP_USER_TIMEOUT notice a cut link or a vanished host even when no task is
    running (a frozen process still acknowledges: that is the heartbeat's job). Options the
    OS lacks are skipped.
    """
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for name, value in (("TCP_KEEPIDLE", KEEPALIVE_IDLE), ("TCP_KEEPINTVL", KEEPALIVE_INTERVAL),
                        ("TCP_KEEPCNT", KEEPALIVE_COUNT), ("TCP_USER_TIMEOUT", USER_TIMEOUT_MS)):
        option = getattr(socket, name, None)
        if option is not None:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, option, value)
            except OSError:
                pass


def max_message_bytes() -> int:
    """Post-auth bound on one message (its frame and its buffers together); GPULAYER_MAX_MESSAGE_MB."""
    value = os.environ.get("GPULAYER_MAX_MESSAGE_MB", "4096")
    if not value.isdigit() or int(value) < 1:
        raise ConfigError(f"GPULAYER_MAX_MESSAGE_MB must be a positive whole number of MiB, not {value!r}")
    return int(value) << 20


FRAME_MAX = (1 << 32) - 1  # the most bytes a frame's 4-byte length can say
ENVELOPE_ROOM = 1 << 16  # what a message's map may add to its payload (type, id, options, the peer's load)
SMALLEST_MESSAGE_LIMIT = 1 << 20  # GPULAYER_MAX_MESSAGE_MB is a whole number of MiB, at least 1


def frame_header(length: int) -> bytes:
    """A frame's 4-byte length; FrameTooLarge for one over FRAME_MAX, which no header can say."""
    if length > FRAME_MAX:
        raise FrameTooLarge(f"a frame of {length} bytes is over the {FRAME_MAX} bytes (4 GiB) that a frame can carry")
    return HEADER.pack(length)


def check_size(what: str, frames: list[int]) -> None:
    """ValueError, before anything is sent, for a message whose payload (its pickle, then its buffers:
    `frames`, in bytes) the wire would refuse: over GPULAYER_MAX_MESSAGE_MB in all, or a frame over 4 GiB."""
    total = sum(frames)
    if total + ENVELOPE_ROOM <= SMALLEST_MESSAGE_LIMIT:  # fits any limit that can be set: no look at the env
        return
    limit = max_message_bytes()
    if total + ENVELOPE_ROOM > limit:
        raise ValueError(f"{what} take {total / 2**20:.1f} MiB, over the {limit >> 20} MiB message limit "
                         "(GPULAYER_MAX_MESSAGE_MB, on the submitter and its peers)")
    if max(frames, default=0) + ENVELOPE_ROOM > FRAME_MAX:
        raise ValueError(f"{what} hold a buffer of {max(frames) / 2**20:.0f} MiB, over the 4 GiB that one "
                         "frame can carry: split it")


def encode(msg: Outgoing, buffers: Buffers = ()) -> list[Any]:
    """The frames of one message, as a list of bytes-like parts ready to send in order; FrameTooLarge
    (nothing is sent) where one is over the 4 GiB a frame can carry.

    It sets the message's "v" (and "nb" when there are buffers) in `msg` itself.
    """
    msg["v"] = PROTOCOL_VERSION
    if buffers:
        msg["nb"] = len(buffers)
    body = msgpack.packb(msg)
    parts = [frame_header(len(body)) + body]
    for buf in buffers:
        view = memoryview(buf).cast("B")
        parts.append(frame_header(view.nbytes))
        parts.append(view)
    return parts


def receive_buffer(nbytes: int) -> bytearray | mmap.mmap:
    """A writable buffer for one large incoming frame.

    Large ones are anonymous memory maps backed by transparent huge pages where the OS offers
    them (Linux): filling fresh memory is then several times faster than with 4 KiB pages,
    which matters when every hop of a big transfer lands in a new buffer.
    """
    if nbytes >= _HUGE_MIN and _MADV_HUGEPAGE is not None:
        buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        try:
            buf.madvise(_MADV_HUGEPAGE)
        except OSError:
            pass
        return buf
    return bytearray(nbytes)


def join_small(parts: list[Any]) -> list[Any]:
    """Merge parts into one bytes object when the message is small (one syscall)."""
    if len(parts) > 1 and sum(len(p) for p in parts) <= _SMALL:
        return [b"".join(parts)]
    return parts


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Blocking send of encoded parts; big buffers are sent from their memory as is."""
    for part in join_small(parts):
        sock.sendall(part)


class MessageReader:
    """Incremental decoder of frames into (message, buffers) pairs, with size limits."""

    def __init__(self, max_frame: int = PRE_AUTH_MAX_FRAME, buffers: bool = True):
        self.max_frame = max_frame
        self.messages: deque[tuple[Message, list[Any]]] = deque()
        self._buf = bytearray(_SMALL if max_frame > PRE_AUTH_MAX_FRAME else 2 * PRE_AUTH_MAX_FRAME)
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._big: bytearray | mmap.mmap | None = None
        self._big_fill = 0
        self._pending: tuple[Message, list[Any], int] | None = None
        self._pending_bytes = 0
        self.buffers_allowed = buffers
        self.one_at_a_time = not buffers  # before authentication: the bytes after a message may be records
        self.allocate: Callable[[int], Any] = receive_buffer  # where a large frame is received
        # why a message whose buffers come to at least N bytes may not be received now, or None;
        # asked at each large buffer frame: the rest of a refused message is read and dropped
        self.budget: Callable[[int], str | None] | None = None
        self._refused: str | None = None
        self._drop = 0  # bytes still to drop of a refused message's frame

    def allow(self, max_frame: int) -> None:
        """Raise the limit (after authentication), with a receive buffer to match; allow buffers."""
        self.max_frame = max_frame
        self.buffers_allowed = True
        self.one_at_a_time = False
        if len(self._buf) < _SMALL:
            kept = self._buf[self._start:self._end]
            self._buf = bytearray(_SMALL)
            self._buf[:len(kept)] = kept
            self._view = memoryview(self._buf)
            self._start, self._end = 0, len(kept)

    @property
    def big_remaining(self) -> int:
        """Bytes still to come of the large frame being read, or 0."""
        return len(self._big) - self._big_fill if self._big is not None else 0

    @property
    def mid_message(self) -> bool:
        """Whether part of a message has arrived and the rest is awaited."""
        return self._big is not None or self._pending is not None or self._end > self._start or self._drop > 0

    def buffer(self) -> memoryview:
        """Where the next bytes from the socket should go."""
        if self._drop:
            return _DROP[:self._drop]
        if self._big is not None:
            return memoryview(self._big)[self._big_fill:]
        if self._start == self._end:
            self._start = self._end = 0
        elif self._end == len(self._buf):
            n = self._end - self._start
            self._buf[:n] = self._buf[self._start:self._end]
            self._start, self._end = 0, n
        return self._view[self._end:]

    def take_unread(self) -> bytes:
        """The bytes received past the last whole message, removed from the reader.

        At the switch to the secure channel these are the first records, not frames. Raises
        ProtocolError when a message was still incomplete: the switch cannot cut one.
        """
        if self._big is not None or self._pending is not None:
            raise ProtocolError("a message was still arriving when the channel became secure")
        data = bytes(self._buf[self._start:self._end])
        self._start = self._end = 0
        return data

    def feed(self, n: int) -> None:
        """Account for n bytes written into `buffer()`; parse what is complete.

        Raises ProtocolError (or a subclass) on bad input; the connection must then close.
        """
        if self._drop:
            self._drop -= n
            if self._drop:
                return
            self._on_frame(b"")
        elif self._big is None:
            self._end += n
        else:
            self._big_fill += n
            if self._big_fill < len(self._big):
                return
            frame, self._big = self._big, None
            self._on_frame(frame)
        self._parse()

    def _parse(self) -> None:
        while self._end - self._start >= 4 and not (self.one_at_a_time and self.messages):
            (length,) = HEADER.unpack_from(self._buf, self._start)
            room = self.max_frame - (self._pending_bytes if self._pending is not None else 0)
            if length > room:
                raise FrameTooLarge(f"a frame of {length} bytes exceeds the limit of {self.max_frame} bytes a message")
            body = self._start + 4
            available = self._end - body
            if length > len(self._buf) // 2:
                take = min(available, length)
                if self._pending is not None and self.budget is not None and self._refused is None:
                    self._refused = self.budget(self._pending_bytes + length)
                if self._refused is not None:  # dropped as it comes: nothing is allocated for it
                    self._start = body + take
                    if take < length:
                        self._drop = length - take
                        return
                    self._on_frame(b"")
                    continue
                big = self.allocate(length)
                big[:take] = self._view[body:body + take]
                self._start = body + take
                if take < length:
                    self._big, self._big_fill = big, take
                    return
                self._on_frame(big)
                continue
            if available < length:
                return
            self._start = body + length
            self._on_frame(self._view[body:self._start])

    def _on_frame(self, frame: Any) -> None:
        if self._pending is not None:
            msg, buffers, count = self._pending
            if self._refused is None:
                # a small frame is a view of the shared buffer: copy it out (writable, like big ones)
                buffers.append(bytearray(frame) if isinstance(frame, memoryview) else frame)
                self._pending_bytes += len(frame)
            else:
                buffers.append(None)
            if len(buffers) == count:
                self._pending = None
                if self._refused is not None:  # delivered without its buffers, with the reason
                    msg[REFUSED], buffers, self._refused = self._refused, [], None
                self.messages.append((msg, buffers))
            return
        msg = decode(frame)
        count = msg.get("nb", 0)
        if not isinstance(count, int) or not 0 <= count <= MAX_BUFFERS:
            raise ProtocolError(f"bad buffer count {count!r}")
        if count and not self.buffers_allowed:
            raise ProtocolError("out-of-band buffers are not allowed before authentication")
        if count:
            self._pending, self._pending_bytes = (msg, [], count), len(frame)
        else:
            self.messages.append((msg, []))


def connection_reader(max_frame: int) -> MessageReader:
    """The reader of a connection: below the post-auth limit (before AUTH_OK), no out-of-band buffers."""
    return MessageReader(max_frame, buffers=max_frame > PRE_AUTH_MAX_FRAME)


def decode(frame: Any) -> Message:
    """One message map from a frame; checks its shape, type and protocol version."""
    try:
        msg = msgpack.unpackb(frame, raw=False)
    except Exception as exc:
        raise ProtocolError(f"undecodable frame: {type(exc).__name__}") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("t"), str):
        raise ProtocolError("a message must be a msgpack map with a string 't'")
    if msg.get("v") != PROTOCOL_VERSION:
        raise VersionMismatch(f"protocol version {msg.get('v')!r} is not supported (this side speaks {PROTOCOL_VERSION})")
    if msg["t"] not in MESSAGE_TYPES:
        raise ProtocolError(f"unknown message type {msg['t'][:40]!r}")
    return msg


def error(code: str, message: str, task_id: int | None = None) -> ErrorMessage:
    return {"t": ERROR, "id": task_id, "code": code, "message": message}


class BlockingConnection:
    """A blocking socket speaking frames: used by submitters and workers.

    After `secure()`, every byte both ways travels in sealed records (records.py). With a local
    `link` (shm.py), big buffers go as shared-memory descriptors over it, and arrive mapped (their
    pages at once where `populate`: a worker, whose tasks read their arguments).
    """

    def __init__(self, sock: socket.socket, max_frame: int = PRE_AUTH_MAX_FRAME,
                 link: socket.socket | None = None, populate: bool = False):
        self.sock = sock
        self.link = link
        self.populate = populate
        self.reader = connection_reader(max_frame)
        self.last_received = time.monotonic()  # any bytes, not only whole messages: a big one takes time
        self.received = 0  # bytes read from the socket, records and all
        self._sealer: records.Sealer | None = None
        self._opener: records.Opener | None = None

    def secure(self, send_key: bytes, recv_key: bytes, counters: tuple[int, int] = (0, 0)) -> None:
        """Seal what is sent and open what is received from now on, with the post-auth message limit.

        `counters` (the next record's, sent and received) continue a channel that another process
        began: an actor's worker taking a submitter's connection over from its peer (ADR 0012)."""
        from . import records  # here: only a worker that takes a direct connection needs cryptography

        self._sealer, self._opener = records.Sealer(send_key), records.Opener(recv_key)
        self._sealer.counter, self._opener.counter = counters
        self.reader.allow(max_message_bytes())
        self._opener.feed_bytes_into(self.reader.take_unread(), self.reader)

    def send(self, msg: Outgoing, buffers: Buffers = ()) -> None:
        if self.link is not None:
            buffers = shm.send_over(self.link, msg, buffers, copy=True)
        self.send_encoded(encode(msg, buffers))

    def send_encoded(self, parts: list[Any]) -> None:
        """Send what `encode` made: one message, or several one after another (sealed together)."""
        if self._sealer is None:
            send_parts(self.sock, parts)
            return
        for record in self._sealer.stream(parts):
            self.sock.sendall(record)

    def recv(self, deadline: float | None = None) -> tuple[Message, list[Any]]:
        """The next message; raises ConnectionError at EOF, socket.timeout past `deadline` (monotonic)."""
        reader = self.reader
        if reader.one_at_a_time and not reader.messages:
            reader.feed(0)  # a whole message may wait in the buffer, parsed one at a time before the switch
        while not reader.messages:
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise socket.timeout("timed out")
                self.sock.settimeout(left)
            n = self._receive()
            self.received += n
            if n == 0:
                if self._opener is not None:
                    self._opener.eof()
                raise ConnectionError("connection closed by the other side")
            self.last_received = time.monotonic()
        msg, buffers = reader.messages.popleft()
        try:
            return msg, shm.receive_with(self.link, msg, buffers, self.populate)
        except shm.ShmError as exc:
            raise ProtocolError(str(exc)) from None

    def _receive(self) -> int:
        """Read once from the socket into the reader (through the opener, once secure)."""
        reader, opener = self.reader, self._opener
        if opener is None:
            if reader.big_remaining:  # wait for a good piece of a large frame, not for every packet
                n = self.sock.recv_into(reader.buffer(), min(reader.big_remaining, BULK_PIECE), socket.MSG_WAITALL)
            else:
                n = self.sock.recv_into(reader.buffer())
            if n:
                reader.feed(n)
            return n
        if opener.remaining > BULK_PIECE // 4:  # the rest of a large record at once
            n = self.sock.recv_into(opener.buffer(), opener.remaining, socket.MSG_WAITALL)
        else:
            n = self.sock.recv_into(opener.buffer())
        if n:
            opener.feed_into(n, reader)
        return n

    def close(self) -> None:
        for sock in (self.sock, self.link):
            try:
                if sock is not None:
                    sock.close()
            except OSError:
                pass


def printable(value: object, limit: int = 200) -> str:
    """Peer-supplied text fit for a terminal: no control characters, at most `limit` characters."""
    return "".join(ch for ch in str(value) if ch.isprintable())[:limit]


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


def client_handshake(conn: BlockingConnection, key: bytes, client_id: str,
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
    nonce_p = msg.get("nonce")
    if msg["t"] != HELLO or not isinstance(nonce_p, bytes) or len(nonce_p) != security.NONCE_BYTES \
            or not isinstance(msg.get("peer"), str):
        raise ProtocolError("expected HELLO with a nonce and a peer id from the peer")
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
    nonce_s, client = msg.get("nonce"), msg.get("client", "")
    if msg["t"] != AUTH or not isinstance(nonce_s, bytes) or len(nonce_s) != security.NONCE_BYTES \
            or not isinstance(client, str):
        return None
    proven = transcript(hello_msg, nonce_s, client)
    if not security.proofs_equal(msg.get("mac"), security.submitter_proof(key, proven)):
        return None
    return {"t": AUTH_OK, "mac": security.peer_proof(key, proven)}, security.session_keys(key, proven, security.PEER)
