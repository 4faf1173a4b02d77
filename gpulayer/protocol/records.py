"""The secure channel's record layer, sans-IO: the frame stream of a connection, sealed in AEAD records.

After the handshake, each direction of a connection carries records instead of bare frames
(ADR 0008)::

    record  = length || AES-256-GCM(key, nonce, plaintext, aad=length)    # ciphertext || 16-byte tag
    length  = 4 bytes, big-endian: the size of ciphertext and tag (16 .. max_record + 16)
    nonce   = 4 zero bytes || counter (8 bytes, big-endian): 0, 1, 2, ... in each direction

Each direction has its own key (`security.session_keys`), so a counter never repeats under a key
and a record sent one way cannot be reflected back. The plaintext is a piece of the byte stream
that `framing.encode` makes; records need not line up with frames. A `Sealer` turns parts into
records: small parts are gathered into one record (a small message costs one AEAD call), large
buffers are sealed straight from their memory in pieces of at most `RECORD_MAX` bytes, so that
neither side holds more than a record or blocks its event loop for long. An `Opener` is fed
ciphertext like `framing.MessageReader` (`buffer()`, then `feed(n)`) and gives back the plaintext,
or opens it straight into a MessageReader (`feed_into`).

Any failure (a tag that does not verify, a length outside the limit, a counter at its end, a
stream that ends inside a record) raises `ChannelError`, and the object opens or seals nothing
more: the connection must close. Neither class is thread-safe; a direction has one of each.
"""

from __future__ import annotations

import struct
from typing import Callable, Iterable, Iterator, NoReturn, Protocol, Union

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from ..errors import ProtocolError

AEAD = AESGCM  # chosen by bench/aead.py (ADR 0008): 2.3x ChaCha20-Poly1305 on small frames, 3.7x on 1 MiB here
KEY_BYTES = 32
TAG = 16
HEADER = struct.Struct(">I")
OVERHEAD = HEADER.size + TAG  # bytes a record adds to its plaintext
RECORD_MAX = 1 << 20  # plaintext bytes a record carries at most (bench/aead.py, record sweep; ADR 0008)
LENGTH_MAX = (1 << 32) - 1  # what the 4-byte header can say
COUNTER_LIMIT = 1 << 64  # records per direction: the 8-byte counter never wraps
_NONCE = struct.Struct(">4xQ")  # 4 zero bytes, then the counter
_COPY_MAX = 16 << 10  # parts below this are gathered by copying; larger ones are sealed from their memory
_INITIAL = 64 << 10  # the Opener's first receive buffer: many small records, no big allocation before one comes
_BOUNDED = _INITIAL // 2  # records above this are received on their own, so they never need moving


BytesLike = Union[bytes, bytearray, memoryview]


class Reader(Protocol):
    """Where plaintext goes: what `framing.MessageReader` offers."""

    def buffer(self) -> memoryview: ...

    def feed(self, n: int) -> None: ...


class ChannelError(ProtocolError):
    """A record failed authentication, broke a limit or was cut off: the connection must close."""

    code = "channel"


def _byte_view(part: BytesLike) -> memoryview:
    view = memoryview(part)
    return view if view.format == "B" and view.ndim == 1 else view.cast("B")


def _cipher(key: bytes, limit: int, name: str) -> AESGCM:
    """The AEAD of one direction, after checking its session key and its record limit."""
    if len(key) != KEY_BYTES:
        raise ValueError(f"a session key has {KEY_BYTES} bytes, not {len(key)}")
    if not 0 < limit <= LENGTH_MAX - TAG:
        raise ValueError(f"{name} must be between 1 and {LENGTH_MAX - TAG}, not {limit}")
    return AEAD(key)


class Sealer:
    """Seals one direction's plaintext stream into records, counting from 0."""

    def __init__(self, key: bytes, *, record_max: int = RECORD_MAX):
        self._aead = _cipher(key, record_max, "record_max")
        self.record_max = record_max
        self.counter = 0  # the next record's counter
        self._scratch: bytearray | None = None

    def seal(self, parts: Iterable[BytesLike]) -> list[bytearray]:
        """The records of `parts` (bytes-like, e.g. what `framing.encode` returns), to send in this order.

        Each record is a bytearray of its own. For large buffers prefer `stream`, which holds one
        record at a time.
        """
        if (isinstance(parts, list) and len(parts) == 1 and isinstance(parts[0], (bytes, bytearray))
                and 0 < len(parts[0]) <= self.record_max):
            return [self._record(parts[0])]  # a message without buffers: no gathering at all
        return [self._record(chunk) for chunk in self._chunks(parts)]

    def records(self, parts: Iterable[BytesLike],
                allocate: Callable[[int], bytearray | memoryview] = bytearray) -> Iterator[bytearray | memoryview]:
        """The records of `parts`, each in a buffer of its own (`allocate(size)`: a fresh bytearray by default),
        sealed only when asked for.

        Counters are given at sealing: records of a later message must not be sealed before
        this iterator is exhausted.
        """
        for chunk in self._chunks(parts):
            record = allocate(len(chunk) + OVERHEAD)
            self._seal(chunk, memoryview(record))
            yield record

    def stream(self, parts: Iterable[BytesLike]) -> Iterator[memoryview]:
        """The records of `parts`, sealed one at a time as they are asked for.

        Every record is a view of one scratch buffer, valid until the next one is asked for: send
        it (wholly) first. Records must go out in the order they come, one stream at a time.
        """
        if self._scratch is None:
            self._scratch = bytearray(self.record_max + OVERHEAD)
        scratch = memoryview(self._scratch)
        for chunk in self._chunks(parts):
            view = scratch[:len(chunk) + OVERHEAD]
            self._seal(chunk, view)
            yield view

    def _chunks(self, parts: Iterable[BytesLike]) -> Iterator[bytes | memoryview]:
        """The plaintext of each record: small parts gathered, large ones in slices of their memory."""
        limit = self.record_max
        gather: list[memoryview] = []
        size = 0
        for part in parts:
            view = _byte_view(part)
            n = view.nbytes
            if n < _COPY_MAX and n <= limit:
                if size + n > limit:
                    yield gather[0] if len(gather) == 1 else b"".join(gather)
                    gather, size = [], 0
                if n:
                    gather.append(view)
                    size += n
                continue
            if size:
                yield gather[0] if len(gather) == 1 else b"".join(gather)
                gather, size = [], 0
            offset = 0
            while n - offset > limit:
                yield view[offset:offset + limit]
                offset += limit
            tail = view[offset:]
            if tail.nbytes < _COPY_MAX:  # a short end of a buffer may share a record with what follows
                gather, size = [tail], tail.nbytes
            else:
                yield tail
        if size:
            yield gather[0] if len(gather) == 1 else b"".join(gather)

    def _record(self, chunk: bytes | bytearray | memoryview) -> bytearray:
        record = bytearray(len(chunk) + OVERHEAD)
        self._seal(chunk, memoryview(record))
        return record

    def _seal(self, chunk: bytes | bytearray | memoryview, view: memoryview) -> None:
        """Seal `chunk` (bytes, or a memoryview of format "B") into `view`, of its size + OVERHEAD."""
        counter = self.counter
        if counter >= COUNTER_LIMIT:
            raise ChannelError("the record counter is at its end; the connection must be opened again")
        self.counter = counter + 1
        HEADER.pack_into(view, 0, len(chunk) + TAG)
        self._aead.encrypt_into(_NONCE.pack(counter), chunk, view[:4], view[4:])


class Opener:
    """Opens one direction's records, fed incrementally, counting from 0.

    `max_record` bounds the plaintext of a record; a length header above it fails at once,
    before its record is received or any memory is set aside for it.
    """

    def __init__(self, key: bytes, *, max_record: int = RECORD_MAX):
        self._aead = _cipher(key, max_record, "max_record")
        self.max_record = max_record
        self.counter = 0  # the next record's counter
        self._buf = bytearray(min(_INITIAL, max_record + OVERHEAD))
        self._view = memoryview(self._buf)
        self._start = self._end = 0
        self._need = 0  # the size of the record at _start, once its header is in
        self._offered = 0
        self._error: str | None = None

    @property
    def remaining(self) -> int:
        """Bytes still to come of the record being received, or 0 when its header has not come."""
        return self._need - (self._end - self._start) if self._need else 0

    @property
    def mid_record(self) -> bool:
        """Whether part of a record has arrived and the rest is awaited."""
        return self._end > self._start

    def buffer(self) -> memoryview:
        """Where the next ciphertext bytes from the socket should go."""
        if self._error is not None:
            self._check()
        start, end, need, size = self._start, self._end, self._need, len(self._buf)
        if start == end:  # nothing unread (so no header either): start over at the front
            start = end = self._start = self._end = 0
        if need:
            if start + need > size:
                self._make_room(need)
                start, end, size = 0, self._end, len(self._buf)
            stop = start + need if need > _BOUNDED else size  # a big record is received on its own
        else:
            if end == size:
                self._make_room(0)
                end = self._end
            stop = size
        self._offered = stop - end
        return self._view[end:stop]

    def feed(self, n: int) -> list[bytearray]:
        """Account for n bytes written into `buffer()`; the plaintext of the records now complete.

        On a bad record it raises at once: what this call had opened before it is dropped too.
        """
        self._account(n)
        pieces = []
        while need := self._next():
            piece = bytearray(need - OVERHEAD)
            self._open(self._start - need, need, piece)
            if need > OVERHEAD:
                pieces.append(piece)
        return pieces

    def feed_into(self, n: int, reader: Reader) -> int:
        """Like `feed`, but each plaintext goes into `reader` (a `framing.MessageReader`); returns its bytes.

        A record is opened straight into the reader's buffer when it fits there, else copied in.
        The reader's ProtocolError on what the plaintext says propagates.
        """
        self._account(n)
        delivered = 0
        while need := self._next():
            size = need - OVERHEAD
            dest = reader.buffer()
            if len(dest) >= size:
                self._open(self._start - need, need, dest[:size])  # on a bad tag nothing is fed, and we fail
                reader.feed(size)
            else:
                piece = bytearray(size)
                self._open(self._start - need, need, piece)
                deliver(reader, piece)
            delivered += size
        return delivered

    def feed_bytes_into(self, data: BytesLike, reader: Reader) -> None:
        """Open ciphertext already read from the socket (`data`) into `reader`, as `feed_into` does."""
        view = _byte_view(data)
        while view:
            dest = self.buffer()
            k = min(len(dest), len(view))
            dest[:k] = view[:k]
            self.feed_into(k, reader)
            view = view[k:]

    def eof(self) -> None:
        """The other side closed: raises ChannelError when that cut a record off."""
        self._check()
        if self.mid_record:
            self._fail(f"the connection ended inside a record ({self._end - self._start} bytes of it came)")

    def _account(self, n: int) -> None:
        if self._error is not None:
            self._check()
        if not 0 <= n <= self._offered:
            raise ValueError(f"fed {n} bytes into a buffer of {self._offered}")
        self._offered = 0
        self._end += n

    def _next(self) -> int:
        """The size of the next complete record, now consumed (it ends at the new _start); or 0."""
        start, avail, need = self._start, self._end - self._start, self._need
        if not need:
            if avail < 4:
                return 0
            (length,) = HEADER.unpack_from(self._buf, start)
            if length < TAG or length > self.max_record + TAG:
                self._fail(f"a record of {length} bytes is outside the limit of {self.max_record + TAG}")
            need = self._need = length + 4
        if avail < need:
            return 0
        self._start, self._need = start + need, 0
        return need

    def _open(self, start: int, need: int, dest: bytearray | memoryview) -> None:
        counter = self.counter
        if counter >= COUNTER_LIMIT:
            self._fail("the record counter is at its end")
        view = self._view
        try:
            self._aead.decrypt_into(_NONCE.pack(counter), view[start + 4:start + need], view[start:start + 4], dest)
        except InvalidTag:
            self._fail(f"record {counter} failed authentication (tampered, replayed, reordered, "
                       "dropped or not for this key)")
        self.counter = counter + 1

    def _make_room(self, need: int) -> None:
        """Move the unread bytes to the front, into a larger buffer when `need` does not fit."""
        kept = self._buf[self._start:self._end]  # a copy: the regions may overlap
        if need > len(self._buf):
            self._buf = bytearray(max(need, min(2 * len(self._buf), self.max_record + OVERHEAD)))
            self._view = memoryview(self._buf)
        self._buf[:len(kept)] = kept
        self._start, self._end = 0, len(kept)

    def _fail(self, message: str) -> NoReturn:
        self._error = message
        self._buf, self._view = bytearray(), memoryview(b"")
        self._start = self._end = self._need = self._offered = 0
        raise ChannelError(message)

    def _check(self) -> None:
        if self._error is not None:
            raise ChannelError(f"the channel failed earlier and opens nothing more: {self._error}")


def deliver(reader: Reader, data: BytesLike) -> None:
    """Copy `data` into `reader` (anything with framing.MessageReader's `buffer()` and `feed(n)`)."""
    view = _byte_view(data)
    while view:
        dest = reader.buffer()
        k = min(len(dest), len(view))
        if not k:
            raise RuntimeError("the reader offered no room")
        dest[:k] = view[:k]
        reader.feed(k)
        view = view[k:]
