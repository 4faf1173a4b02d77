"""A lease: a submitter's connection handed over to a function worker, plus an idle policy (ADR 0013).

The peer hands the connection over with its channel's keys and counters, as for an actor's direct
calls (ADR 0012), and the worker's receiver (receiver.py) runs the tasks sent on it one at a time,
in order, answering each there as it ends, before the next starts: one hop each way instead of two.
The lease ends when no task came for `idle` seconds, when the peer wants the slot back (a queued
task could use it, or the peer stops: looked at before each task starts), or when the submitter
closes the connection. The worker then says LEASE_END to the submitter (a task it sent and got no
answer for did not start: it places it again), tells its peer, and serves its peer again.
"""

from __future__ import annotations

import select
import socket
import threading
import time
from typing import Any

from ..protocol import messages
from .streams import Stream

POLL_S = 0.05  # while idle, how often the lease looks whether the peer wants the slot back
DRAIN_S = 2.0  # after LEASE_END, how long the submitter is given to close its side


class Lease:
    """One lease: the submitter's connection (a stream of the receiver), and what the peer said with it."""

    def __init__(self, stream: Stream, msg: messages.Message):
        self.stream = stream
        self.env = dict(msg.get("env") or {})  # the slot's device variables, under each task's own
        self.idle = float(msg.get("idle") or 1.0)
        self.beat = float(msg.get("beat") or 1.0)  # seconds between signs of life while a task runs or arrives
        self.done = threading.Event()  # no task runs on it any more
        self.served = 0
        self.ending = ""  # why the lease ends, once the peer said so
        self.bye = False  # the peer said BYE (it stops), or is gone: the worker exits after the lease
        self.finished = False  # the peer was told that the lease ended (under the receiver's lock)

    def wait(self) -> str | None:
        """Until a message is here (None), or why the lease ends: the peer wants the slot back, or no
        task came for `idle` seconds."""
        conn = self.stream.conn
        while not conn.reader.messages:
            if self.ending:
                return self.ending
            if select.select([conn.sock], [], [], POLL_S)[0]:
                return None
            if time.monotonic() - self.stream.last >= self.idle:
                return f"no task came for {self.idle:g} s"
        return None

    def keep_alive(self) -> None:
        """While a task runs or arrives, say every `beat` seconds that this worker is alive (a PONG without
        id): the submitter ends a lease whose tasks wait in silence (its path or its host is down), and a
        big argument that crosses a slow link is not silence."""
        def beat() -> None:
            while not self.done.wait(self.beat):
                if self.stream.running or self.stream.receiving:
                    try:
                        self.stream.send({"t": messages.PONG, "id": None})
                    except OSError:
                        return

        threading.Thread(target=beat, name="gpulayer-lease-beat", daemon=True).start()

    def end(self, reason: str) -> None:
        """Say LEASE_END to the submitter and let it close its side (what it sent meanwhile is dropped: it
        places those again); bounded, so that a submitter that goes on sending does not keep the slot."""
        conn = self.stream.conn
        try:
            self.stream.send({"t": messages.LEASE_END, "reason": reason})
            conn.sock.shutdown(socket.SHUT_WR)
            deadline = time.monotonic() + DRAIN_S
            while (left := deadline - time.monotonic()) > 0 and select.select([conn.sock], [], [], left)[0] and \
                    conn.sock.recv(1 << 16):
                pass
        except OSError:
            pass
        conn.close()
