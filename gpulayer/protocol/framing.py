"""Frames and their limits, sans-IO: what a connection's bytes are, read by `MessageReader`.

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
import struct
from collections import deque
from collections.abc import Callable
from typing import Any

import msgpack

from ..errors import ConfigError, FrameTooLarge, ProtocolError, VersionMismatch
from .messages import MESSAGE_TYPES, PROTOCOL_VERSION, Buffers, Message, Outgoing

MAX_BUFFERS = 4096  # out-of-band buffers of one message, inline and by descriptor (the shared memory's too)
HEADER = struct.Struct(">I")
PRE_AUTH_MAX_FRAME = 4096
_SMALL = 1 << 18  # the shared receive buffer after auth; bigger frames get a buffer of their own
_HUGE_MIN = 4 << 20
BULK_PIECE = 1 << 20  # while a large frame arrives, wake up for this much at a time
_DROP = memoryview(bytearray(BULK_PIECE))  # where refused buffers are received and dropped
REFUSED = "_refused"  # set by a reader with a `budget` on a message whose buffers it dropped, with the reason
_MADV_HUGEPAGE = getattr(mmap, "MADV_HUGEPAGE", None)


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
                buffers.append(bytearray(frame) if isinstance(frame, memoryview) and frame.obj is self._buf
                               else frame)
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

