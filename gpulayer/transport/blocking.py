"""The blocking connection: frames over a socket, sealed once secure; used by submitters and workers."""

from __future__ import annotations

import socket
import time
from collections.abc import Generator
from typing import TYPE_CHECKING, Any

from ..errors import ProtocolError
from ..protocol.framing import BULK_PIECE, PRE_AUTH_MAX_FRAME, connection_reader, encode, join_small, max_message_bytes
from ..protocol import handshake
from ..protocol.messages import Buffers, Message, Outgoing
from . import shm, sockets

if TYPE_CHECKING:
    from ..protocol import records


def send_parts(sock: socket.socket, parts: list[Any]) -> None:
    """Blocking send of encoded parts; big buffers are sent from their memory as is."""
    for part in join_small(parts):
        sock.sendall(part)


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
        from ..protocol import records  # here: only a worker that takes a direct connection needs cryptography

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


def dial(address: tuple[str, int], timeout: float) -> BlockingConnection:
    """A connection to `address` (host, port), its socket tuned as every GPUlayer connection's; OSError if none."""
    sock = socket.create_connection(address, timeout)
    sockets.tune(sock)
    return BlockingConnection(sock)


def connections(addresses: list[tuple[str, int]], timeout: float,
                errors: list[str]) -> Generator[tuple[str, BlockingConnection], None, None]:
    """("host:port", a connection) for each of `addresses` that accepts one, in order, each closed when the
    caller moves on (or stops: `with contextlib.closing(...)`); why the others did not, into `errors`."""
    for host, port in addresses:
        label = f"{host}:{port}"
        try:
            conn = dial((host, port), timeout)
        except OSError as exc:
            errors.append(f"{label} ({exc.strerror or exc})")
            continue
        try:
            yield label, conn
        finally:
            conn.close()


class Unreachable(ConnectionError):
    """No address of a peer accepted a connection; the message says why for each."""


def handshaken(addresses: list[tuple[str, int]], key: bytes, client_id: str,
               timeout: float) -> tuple[BlockingConnection, Message, tuple[str, int]]:
    """A connection to the first of `addresses` that accepts one, past the submitter's half of the handshake,
    the peer's HELLO, and that address. Raises Unreachable, or what the handshake raises (the connection
    closed)."""
    errors = []
    for host, port in addresses:
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
            address = (host, port)
            break
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
    else:
        raise Unreachable("; ".join(errors) or "no address")
    sockets.tune(sock)
    conn = BlockingConnection(sock)
    try:
        return conn, handshake.client_handshake(conn, key, client_id), address
    except BaseException:
        conn.close()
        raise
