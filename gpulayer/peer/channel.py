"""Messages over a non-blocking socket on the peer's event loop, driven by callbacks.

Reading: one reader callback per readiness event drains the socket into a MessageReader and
hands each complete message to `on_message` at once (no task or future per message).
Writing: synchronous and ordered (a LOG written before a RESULT arrives first), batched into
one sendmsg call where several are pending, and zero-copy: what the kernel does not take at
once stays queued as memoryviews of the caller's buffers, never copied into a bigger one.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections import deque
from collections.abc import Callable
from itertools import islice
from typing import Any

from .. import wire
from ..errors import ProtocolError

_IOV = 64  # parts per sendmsg call
_READS_PER_EVENT = 16  # then let other connections have a turn


OnMessage = Callable[[dict[str, Any], list[Any]], None]  # one complete message and its buffers
OnClosed = Callable[[str, "ProtocolError | None"], None]  # why it closed; the error when input was bad


_CLOSED_READER = wire.MessageReader()  # what a closed channel keeps: nothing is fed to it


def _ignore(*_args: Any) -> None:
    pass


class AsyncChannel:
    """`on_message(msg, buffers)` for each message; `on_closed(reason, error)` once, at EOF or bad input."""

    def __init__(self, sock: socket.socket, max_frame: int, on_message: OnMessage, on_closed: OnClosed):
        sock.setblocking(False)
        self.sock = sock
        self.reader = wire.connection_reader(max_frame)
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
        self._scratch: bytearray | None = None
        self._closing: asyncio.Task[None] | None = None
        self._loop.add_reader(self._fd, self._on_readable)

    # ---- reading ----------------------------------------------------------------------------------

    def _on_readable(self) -> None:
        reader = self.reader
        for _ in range(_READS_PER_EVENT):
            if self.closed:  # a handler closed it
                return
            closing = self._eof is not None
            try:  # while closing, input goes to a scratch buffer: the reader's may have no room left
                n = self.sock.recv_into(self._scratch if self._scratch is not None and closing else reader.buffer())
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
                reader.feed(n)
            except ProtocolError as exc:
                return self._lost(str(exc), exc)
            while reader.messages and not self.closed and self._eof is None:
                self.on_message(*reader.messages.popleft())

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

    def write(self, msg: wire.Outgoing, buffers: wire.Buffers = ()) -> None:
        """Queue a message and send as much as the socket takes now; never blocks."""
        if self.closed:
            return
        for part in wire.encode(msg, buffers):
            view = memoryview(part)
            self._out.append(view)
            self._out_bytes += view.nbytes
        if not self._writing:
            self._flush()

    async def drain(self, limit: int = 0) -> None:
        """Wait until at most `limit` bytes are queued (or the channel closed)."""
        while self._out_bytes > limit and not self.closed:
            if self._flushed is None:
                self._flushed = self._loop.create_future()
            await self._flushed

    def _flush(self) -> None:
        out = self._out
        while out:
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
                else:
                    out[0] = head[sent:]
                    sent = 0
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

    # ---- closing ----------------------------------------------------------------------------------

    def close_gracefully(self, timeout: float = 1.0) -> asyncio.Task[None]:
        """Send what is queued (an ERROR, say), then close without resetting the connection.

        Closing with unread input makes the kernel send a reset, which can destroy the ERROR
        before the other side reads it; so from now on input is read and dropped, for up to
        `timeout`, in the background. Returns that background task.
        """
        if self._closing is None:
            self._scratch = bytearray(1 << 16)
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
