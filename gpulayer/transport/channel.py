"""Messages over a non-blocking socket on the peer's event loop, driven by callbacks.

Reading: one reader callback per readiness event drains the socket into a MessageReader and
hands each complete message to `on_message` at once (no task or future per message).
Writing: synchronous and ordered (a LOG written before a RESULT arrives first), batched into
one sendmsg call where several are pending, and zero-copy: what the kernel does not take at
once stays queued as memoryviews of the caller's buffers, never copied into a bigger one.
A large message is sealed a few records ahead of the socket, into record buffers used again
once sent; `write(..., sealed=)` tells the caller when its buffers may be used again.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable, Iterator
from itertools import islice
from typing import Any

from ..errors import ProtocolError
from ..protocol import framing, messages, records

_IOV = 64  # parts per sendmsg call
_READS_PER_EVENT = 16  # then let other connections have a turn
_RECORDS_AHEAD = 4  # records of a large message sealed ahead of the socket


OnMessage = Callable[[dict[str, Any], list[Any]], None]  # one complete message and its buffers
OnClosed = Callable[[str, "ProtocolError | None"], None]  # why it closed; the error when input was bad


_DISCARD = memoryview(bytearray(1 << 16))  # where closing channels drop their input: one for all, on one loop
_CLOSED_READER = framing.MessageReader()  # what a closed channel keeps: nothing is fed to it


def _ignore(*_args: Any) -> None:
    pass


class AsyncChannel:
    """`on_message(msg, buffers)` for each message; `on_closed(reason, error)` once, at EOF or bad input."""

    def __init__(self, sock: socket.socket, max_frame: int, on_message: OnMessage, on_closed: OnClosed):
        sock.setblocking(False)
        self.sock = sock
        self.reader = framing.connection_reader(max_frame)
        self.closed = False
        self.on_message = on_message
        self.on_closed = on_closed
        self.last_received = time.monotonic()  # any bytes: a big message takes a while to arrive
        self._loop = asyncio.get_running_loop()
        self._fd = sock.fileno()
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._writing = False
        self._flushed: asyncio.Future[None] | None = None
        self._eof: asyncio.Future[None] | None = None  # set while closing: input is read and dropped
        self._closing: asyncio.Task[None] | None = None
        self._paused = False  # reading stopped for good: the connection is being handed over
        self._held = False  # reading stopped for now (`hold`)
        self._sealer: records.Sealer | None = None
        self._opener: records.Opener | None = None
        self._keys: tuple[bytes, bytes] | None = None
        # large messages, sealed as the socket takes them, and what to call once each is sealed
        self._unsealed: deque[tuple[Iterator[bytearray | memoryview], Callable[[], None] | None]] = deque()
        self._spare: list[bytearray] = []  # record buffers sent, to seal into again
        self._lent: set[int] = set()  # the ids of those queued to send
        self._loop.add_reader(self._fd, self._on_readable)

    def secure(self, send_key: bytes, recv_key: bytes) -> None:
        """Seal what is written and open what is read from now on, with the post-auth message limit."""
        self._sealer, self._opener = records.Sealer(send_key), records.Opener(recv_key)
        self._keys = (send_key, recv_key)
        self.reader.allow(framing.max_message_bytes())
        try:
            self._opener.feed_bytes_into(self.reader.take_unread(), self.reader)
        except ProtocolError as exc:
            self._lost(str(exc), exc)

    # ---- reading ----------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        reader = self.reader
        for _ in range(_READS_PER_EVENT):
            if self.closed or self._paused or self._held:  # a handler closed it, is handing it over, or is behind
                return
            closing = self._eof is not None
            opener = self._opener
            if closing:  # input is dropped into the shared scratch buffer: the reader's may be full
                into = _DISCARD
            else:
                into = reader.buffer() if opener is None else opener.buffer()
            try:
                n = self.sock.recv_into(into)
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                return self._lost(f"receive failed: {exc}")
            if n == 0:
                return self._lost("closed by the other side")
            self.last_received = time.monotonic()
            if closing:  # input is dropped
                continue
            try:
                if opener is None:
                    reader.feed(n)
                else:
                    opener.feed_into(n, reader)
            except ProtocolError as exc:
                return self._lost(str(exc), exc)
            while reader.messages and not self.closed and not self._paused and self._eof is None:
                self.on_message(*reader.messages.popleft())
                if reader.one_at_a_time and not reader.messages and not self.closed:
                    reader.feed(0)  # before the switch to records, messages are parsed one at a time

    def _lost(self, reason: str, error: ProtocolError | None = None) -> None:
        if self._eof is not None:
            if not self._eof.done():
                self._eof.set_result(None)
            return
        if not self.closed:
            self.on_closed(reason, error)
        if self._eof is None:  # unless the owner chose to close gracefully
            self.close()

    # ---- writing ----------------------------------------------------------------------------------

    def write(self, msg: messages.Outgoing, buffers: messages.Buffers = (),
              sealed: Callable[[], None] | None = None) -> None:
        """Queue a message and send as much as the socket takes now; never blocks. On a secure channel,
        `sealed()` is called once the buffers are sealed (and so free to be used again); never if it closes
        first."""
        if self.closed:
            return
        parts = framing.encode(msg, buffers)
        if self._sealer is None:
            self._queue(parts)
        else:
            size = sum(memoryview(p).nbytes for p in parts)
            if self._unsealed or size > records.RECORD_MAX:  # big: sealed piece by piece as it goes out
                self._unsealed.append((self._sealer.records(parts, self._record_buffer), sealed))
                self._out_bytes += size
                sealed = None
            else:
                self._queue(self._sealer.seal(parts))
        if sealed is not None and self._sealer is not None:
            sealed()
        if not self._writing:
            self._flush()

    def _record_buffer(self, size: int) -> memoryview:
        """Where a record of `size` bytes is sealed: a spare buffer, back in `_spare` once sent."""
        assert self._sealer is not None
        buf = self._spare.pop() if self._spare else bytearray(self._sealer.record_max + records.OVERHEAD)
        self._lent.add(id(buf))
        return memoryview(buf)[:size]

    def _queue(self, parts: list[Any]) -> None:
        for part in parts:
            view = memoryview(part)
            self._out.append(view)
            self._out_bytes += view.nbytes

    async def drain(self, limit: int = 0) -> None:
        """Wait until at most `limit` bytes are queued (or the channel closed)."""
        while self._out_bytes > limit and not self.closed:
            if self._flushed is None:
                self._flushed = self._loop.create_future()
            await self._flushed

    def _seal_more(self) -> None:
        """Seal the next records of the large messages waiting (a few MiB at most)."""
        while self._unsealed and len(self._out) < _RECORDS_AHEAD:
            record = next(self._unsealed[0][0], None)
            if record is None:
                sealed = self._unsealed.popleft()[1]
                if sealed is not None:
                    sealed()
                continue
            self._out.append(memoryview(record))
            self._out_bytes += records.OVERHEAD  # its plaintext was counted when it was written

    def _flush(self) -> None:
        out = self._out
        while True:
            if not out and self._unsealed:
                self._seal_more()
            if not out:
                break
            try:
                sent = self.sock.sendmsg(list(islice(out, _IOV)))
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self._lost(f"send failed: {exc}")
                return
            self._out_bytes -= sent
            while sent:
                head = out[0]
                if sent >= head.nbytes:
                    sent -= head.nbytes
                    out.popleft()
                    if id(head.obj) in self._lent:  # a record buffer: sealed into again
                        self._lent.discard(id(head.obj))
                        self._spare.append(head.obj)  # type: ignore[arg-type]
                else:
                    out[0] = head[sent:]
                    sent = 0
        if not out and not self._unsealed:  # all sent: the record buffers are not kept while idle
            self._spare.clear()
        if out and not self._writing:
            self._loop.add_writer(self._fd, self._flush)
            self._writing = True
        elif not out and self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._wake()

    def _wake(self) -> None:
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)
        self._flushed = None

    def hold(self, held: bool) -> None:
        """Stop reading from the socket for now (`held`), or read again: back-pressure from a consumer of the
        messages that is behind (an upload's disk work), which holds the sender through TCP's window instead
        of blocking the event loop. What was read already is still handed over."""
        if held == self._held or self.closed or self._paused or self._eof is not None:
            return
        self._held = held
        if held:
            self._loop.remove_reader(self._fd)
        else:
            self._loop.add_reader(self._fd, self._on_readable)

    # ---- handing over -----------------------------------------------------------------------------

    def pause_reading(self) -> None:
        """Read nothing more from the socket, nor handle what was read already (the connection is
        about to be handed over, and what came after the request goes with it, or stops it)."""
        self._paused = True
        if not self.closed:
            self._loop.remove_reader(self._fd)

    def hand_over(self) -> tuple[socket.socket, tuple[bytes, bytes], tuple[int, int]]:
        """Give up the connection, whole, to another process that continues its channel (ADR 0012):
        the socket, the session keys (send, receive) and the counters of the next records.

        Only a secure channel with nothing still to send, nothing received and not yet handled
        and no record half read can be handed over; ProtocolError otherwise. The channel is closed
        after, without closing the socket, which is the caller's."""
        opener, sealer = self._opener, self._sealer
        if self.closed or opener is None or sealer is None or self._keys is None:
            raise ProtocolError("only an open, authenticated connection can be handed over")
        if self._out or self._unsealed or opener.mid_record or self.reader.messages or self.reader.mid_message:
            raise ProtocolError("the connection carried more than its DIRECT request")
        handed = (self.sock.dup(), self._keys, (sealer.counter, opener.counter))
        self.close()
        return handed

    # ---- closing ----------------------------------------------------------------------------------

    def close_gracefully(self, timeout: float = 1.0) -> asyncio.Task[None]:
        """Send what is queued (an ERROR, say), then close without resetting the connection.

        Closing with unread input makes the kernel send a reset, which can destroy the ERROR
        before the other side reads it; so from now on input is read and dropped, for up to
        `timeout`, in the background. Returns that background task.
        """
        if self._closing is None:
            self._eof = self._loop.create_future()
            self._closing = self._loop.create_task(self._linger(timeout))
        return self._closing

    async def _linger(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.drain(0), timeout)
            self.sock.shutdown(socket.SHUT_WR)
            if self._eof is not None:
                await asyncio.wait_for(asyncio.shield(self._eof), timeout)
        except (asyncio.TimeoutError, OSError):
            pass
        self.close()

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._loop.remove_reader(self._fd)
        if self._writing:
            self._loop.remove_writer(self._fd)
            self._writing = False
        self._out.clear()
        self._unsealed.clear()
        self._spare.clear()
        self._lent.clear()
        self._out_bytes = 0
        self._wake()
        if self._eof is not None and not self._eof.done():
            self._eof.set_result(None)
        try:
            self.sock.close()
        except OSError:
            pass
        # let go of the owner and the buffers now: under a flood of connections, waiting for the
        # cycle collector would let memory pile up
        self.on_message = self.on_closed = _ignore
        self.reader = _CLOSED_READER
