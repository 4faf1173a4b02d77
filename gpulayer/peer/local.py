"""The peer's local links: shared memory with submitters of the same host and user (shm.py, ADR 0009).

The peer listens on an abstract Unix socket, which only processes of its own network namespace
can reach. An authenticated connection that asks (a LOCAL message) is told the socket's name
and a fresh token over its secure channel. A process that connects must be of the peer's own uid
(SO_PEERCRED, the kernel's word) and present a token of a live connection within the time
bound; then the link is that connection's, and only that connection's messages may name
descriptors on it. Anything else is closed without a byte read past the token, and a process of
another user without a byte read at all. Any account can read the socket's name in
/proc/net/unix, so what they cause is logged a line per interval (quiet.py).
"""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Protocol

from .quiet import QuietLog
from ..protocol import messages
from ..transport import shm

PENDING_MAX = 64  # links accepted and waiting for their token; the oldest goes first
TOKEN_TIMEOUT = 2.0  # seconds a link may take to present its token


class Linkable(Protocol):
    """A submitter's connection that can take a local link."""

    link: socket.socket | None


class LocalLinks:
    """The listening socket, the tokens offered to live connections, the links waiting for a token."""

    def __init__(self, loop: asyncio.AbstractEventLoop, quiet: QuietLog):
        self._loop = loop
        self._quiet = quiet
        self.address = shm.listen_address()
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        self._server.bind(self.address)
        self._server.listen(64)
        self._server.setblocking(False)
        self._tokens: dict[bytes, Linkable] = {}
        self._pending: dict[socket.socket, asyncio.TimerHandle] = {}
        loop.add_reader(self._server.fileno(), self._on_accept)

    def offer(self, conn: Linkable) -> messages.Message:
        """The LOCAL answer for an authenticated connection (send it over its secure channel)."""
        token = shm.new_token()
        self._tokens[token] = conn
        return {"t": messages.LOCAL, "addr": self.address, "token": token}

    def forget(self, conn: Linkable) -> None:
        """The connection is gone: its token dies and its link closes."""
        for token in [t for t, c in self._tokens.items() if c is conn]:
            del self._tokens[token]
        if conn.link is not None:
            conn.link.close()
            conn.link = None

    def _on_accept(self) -> None:
        for _ in range(16):
            try:
                link, _ = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._quiet.warning("failed local link accepts", "local link accept failed: %s", exc)
                return
            uid = shm.peer_uid(link)
            if uid != os.getuid():
                link.close()
                self._quiet.warning("local links refused (another user)",
                                    "refused a local link from another user (uid %d)", uid)
                continue
            while len(self._pending) >= PENDING_MAX:
                self._close(next(iter(self._pending)))
            link.setblocking(False)
            self._pending[link] = self._loop.call_later(TOKEN_TIMEOUT, self._close, link)
            self._loop.add_reader(link.fileno(), self._on_token, link)

    def _on_token(self, link: socket.socket) -> None:
        try:
            token = link.recv(shm.TOKEN_BYTES + 1)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            token = b""
        conn = self._tokens.pop(token, None)
        self._close(link, keep=conn is not None and conn.link is None)
        if conn is None or conn.link is not None:
            return
        try:
            link.send(b"\x01")
        except OSError:
            link.close()
            return
        conn.link = link

    def _close(self, link: socket.socket, keep: bool = False) -> None:
        """Stop waiting for the link's token; close it unless `keep`."""
        timer = self._pending.pop(link, None)
        if timer is not None:
            timer.cancel()
            self._loop.remove_reader(link.fileno())
        if not keep:
            link.close()

    def close(self) -> None:
        self._loop.remove_reader(self._server.fileno())
        self._server.close()
        for link in list(self._pending):
            self._close(link)
        self._tokens.clear()

