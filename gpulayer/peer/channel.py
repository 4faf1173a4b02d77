"""Messages over a non-blocking socket on the peer's event loop.

Writes are synchronous and ordered (a LOG written before a RESULT arrives first), batched
into one sendmsg call where several are pending, and zero-copy: what the kernel does not take
at once stays queued as memoryviews of the caller's buffers, never copied into a bigger one.
"""

from __future__ import annotations

import asyncio
import socket
from collections import deque
from itertools import islice

from .. import wire

_IOV = 64  # parts per sendmsg call
HIGH_WATER = 4 << 20  # queued bytes above which `drain()` waits


class AsyncChannel:
    def __init__(self, sock: socket.socket, max_frame: int):
        sock.setblocking(False)
        self.sock = sock
        self.reader = wire.MessageReader(max_frame)
        self.closed = False
        self._loop = asyncio.get_running_loop()
        self._out: deque[memoryview] = deque()
        self._out_bytes = 0
        self._writing = False
        self._flushed: asyncio.Future | None = None

    async def recv(self) -> tuple[dict, list]:
        """The next message. Raises ConnectionError at EOF, ProtocolError on bad input."""
        reader = self.reader
        while not reader.messages:
            n = await self._loop.sock_recv_into(self.sock, reader.buffer())
            if n == 0:
                raise ConnectionError("connection closed by the other side")
            reader.feed(n)
        return reader.messages.popleft()

    def write(self, msg: dict, buffers=()) -> None:
        """Queue a message and send as much as the socket takes now; never blocks."""
        if self.closed:
            return
        for part in wire.encode(msg, buffers):
            view = memoryview(part)
            self._out.append(view)
            self._out_bytes += view.nbytes
        if not self._writing:
            self._flush()

    async def drain(self, limit: int = HIGH_WATER) -> None:
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
            except OSError:
                self.close()
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
            self._loop.add_writer(self.sock.fileno(), self._flush)
            self._writing = True
        elif not out and self._writing:
            self._loop.remove_writer(self.sock.fileno())
            self._writing = False
        self._wake()

    def _wake(self) -> None:
        if self._flushed is not None and not self._flushed.done():
            self._flushed.set_result(None)
        self._flushed = None

    async def aclose(self, timeout: float = 1.0) -> None:
        """Send what is queued (an ERROR, say), then close without resetting the connection.

        Closing with unread input makes the kernel send a reset, which can destroy the ERROR
        before the other side reads it; so input is read and dropped for up to `timeout` first.
        """
        try:
            await asyncio.wait_for(self.drain(0), timeout)
            self.sock.shutdown(socket.SHUT_WR)
            await asyncio.wait_for(self._discard_input(), timeout)
        except (asyncio.TimeoutError, OSError):
            pass
        self.close()

    async def _discard_input(self) -> None:
        scratch = bytearray(1 << 16)
        while await self._loop.sock_recv_into(self.sock, scratch):
            pass

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._writing:
            self._loop.remove_writer(self.sock.fileno())
            self._writing = False
        self._out.clear()
        self._out_bytes = 0
        self._wake()
        try:
            self.sock.close()
        except OSError:
            pass
