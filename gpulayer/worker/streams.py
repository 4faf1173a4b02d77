"""The streams that tasks come on in a worker: the peer's link, or a submitter's connection that the
peer handed over with its channel's keys and counters (a lease's, ADR 0013; an actor's direct one,
ADR 0012), each with its queue and what it knows of its tasks' ids.
"""

from __future__ import annotations

import socket
import sys
import threading
import time
from collections import deque
from typing import Any

from ..protocol import framing, messages
from ..transport import blocking, shm

PEER, LEASE, DIRECT = "peer", "lease", "direct"  # the kinds of stream


class Stream:
    """One connection that tasks come on, its queue, and what it knows of their ids."""

    def __init__(self, conn: blocking.BlockingConnection, kind: str):
        self.conn = conn
        self.kind = kind
        self.handed_over = kind != PEER  # a submitter's connection: its tasks' answers and output go to it
        # Looks on the socket for messages behind those it read, so that a CANCEL that came while an earlier
        # call ran is read before the call it names: an actor's streams (the peer's link once it is one). A
        # lease's cancels come through the peer too (a thread reads them while a task runs): no syscall.
        self.peeks = kind == DIRECT
        self.queue: deque[tuple[messages.Message, list[Any]]] = deque()
        self.cancelled: set[int] = set()  # ids cancelled before they started
        self.running: set[Any] = set()  # ids of the tasks that run now
        self.started = 0  # the highest id started (ids rise on a stream; a lease refuses one that does not)
        self.receiving = False  # a message is being read: a big one takes long over a slow link
        self.last = time.monotonic()  # when the last message came
        self._send_lock = threading.Lock()
        self._held: list[Any] = []  # encoded replies kept back (`send(..., hold=True)`)

    def recv(self) -> tuple[messages.Message, list[Any]]:
        self.receiving = True
        msg, buffers = self.conn.recv()
        self.receiving = False
        self.last = time.monotonic()
        return msg, buffers

    def arrived(self) -> bool:
        """Whether another message is here already (parsed, or bytes waiting on the socket, or its end)."""
        if self.conn.reader.messages:
            return True
        if not self.peeks:
            return False
        try:
            self.conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        return True

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = (), hold: bool = False) -> None:
        """Send a message. With `hold`, a reply without buffers waits for `flush` (or the next message),
        so that the replies to calls that came together go out together: one record, one write."""
        with self._send_lock:
            if hold and not buffers:
                self._held += framing.encode(msg)
                return
            self._flush()
            self.conn.send(msg, buffers)

    def tell(self, msg: messages.Outgoing) -> None:
        """Send, where a connection that is gone is no matter (the worker ends at its next read)."""
        try:
            self.send(msg)
        except OSError:
            pass

    def flush(self) -> None:
        if self._held:  # only the thread that serves the stream holds replies back
            with self._send_lock:
                self._flush()

    def _flush(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self.conn.send_encoded(held)

    def cancel(self, task_id: Any) -> None:
        """A task cancelled before it started does not run (a running one is the peer's to stop)."""
        if isinstance(task_id, int) and not isinstance(task_id, bool) and task_id > self.started:
            self.cancelled.add(task_id)


def take_connection(link: blocking.BlockingConnection, msg: messages.Message) -> blocking.BlockingConnection | None:
    """The submitter's connection that the peer handed over (the socket came first on the local link),
    continuing its channel with the keys and counters of `msg` (a DIRECT or a LEASE); None if it did not come."""
    try:
        sock = shm.receive_socket(link.link)  # type: ignore[arg-type]
    except (shm.ShmError, OSError) as exc:
        print(f"gpulayer worker: a handed-over connection did not arrive: {exc}", file=sys.__stderr__)
        return None
    sock.setblocking(True)  # the peer's event loop had it non-blocking (a flag of the socket, not of a descriptor)
    conn = blocking.BlockingConnection(sock, framing.max_message_bytes())
    send_key, recv_key = msg["keys"]
    conn.secure(send_key, recv_key, tuple(msg["counters"]))
    return conn
