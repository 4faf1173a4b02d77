"""A worker that became an actor: one instance, and the calls that come for it.

Calls come on the worker's link from its peer, and on direct connections: submitters' connections
that the peer handed over to this worker with their channel's keys and counters (ADR 0012), so
that a call goes from the submitter to here and its answer straight back. Each connection is read
by a thread of its own; calls start in the order they arrive on it, at most `conc` at a time over
all of them (with one, in the thread that read it, so no hand-over to another thread).
"""

from __future__ import annotations

import contextlib
import os
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor

from .. import lending, serialization
from ..errors import ProtocolError
from ..protocol import framing, messages
from ..transport import blocking, shm
from .running import flush_output, invoke, run_call

_output = threading.local()  # .sink: where the current thread's stdout and stderr go, while it runs a direct call


class Stream:
    """One connection that calls come on: the peer's link, or a submitter's direct connection."""

    def __init__(self, conn: blocking.BlockingConnection, direct: bool):
        self.conn = conn
        self.direct = direct
        self.cancelled: set = set()
        self._send_lock = threading.Lock()
        self._held: list = []  # encoded replies kept back (`send(..., hold=True)`)

    def send(self, msg: dict, buffers=(), hold: bool = False) -> None:
        """Send a message. With `hold`, a reply without buffers waits for `flush` (or the next message),
        so that the replies to calls that came together go out together: one record, one write."""
        with self._send_lock:
            if hold and not buffers:
                self._held += framing.encode(msg)
                return
            self._flush()
            self.conn.send(msg, buffers)

    def flush(self) -> None:
        with self._send_lock:
            self._flush()

    def _flush(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self.conn.send_encoded(held)


class RoutedOutput:
    """sys.stdout or sys.stderr of an actor's worker: what a thread running a direct call writes goes
    to that call's submitter as LOG messages; anything else to the original stream (the peer's pipe)."""

    def __init__(self, original, name: str):
        self._original = original
        self._name = name

    def write(self, text: str) -> int:
        sink = getattr(_output, "sink", None)
        if sink is None:
            return self._original.write(text)
        sink(self._name, text)
        return len(text)

    def flush(self) -> None:
        self._original.flush()

    def __getattr__(self, name: str):
        return getattr(self._original, name)


def take_connection(link: blocking.BlockingConnection, msg: dict) -> blocking.BlockingConnection | None:
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


def route_output() -> None:
    """Make sys.stdout and sys.stderr RoutedOutput (once), so that `output_to` can take a thread's output."""
    if not isinstance(sys.stdout, RoutedOutput):
        sys.stdout, sys.stderr = RoutedOutput(sys.stdout, "out"), RoutedOutput(sys.stderr, "err")


class Actor:
    """The actor's instance and the connections its calls come on."""

    def __init__(self, conn: blocking.BlockingConnection, instance: object, conc: int):
        self.peer = Stream(conn, direct=False)
        self.instance = instance
        self._turn = threading.Semaphore(conc)
        self._pool = ThreadPoolExecutor(conc, thread_name_prefix="gpulayer-actor") if conc > 1 else None
        self._direct: list[Stream] = []
        self._served_direct = 0  # calls answered on direct connections
        self._reported = 0  # ... as the peer was last told
        self._lock = threading.Lock()

    def serve(self, stream: Stream) -> None:
        """Run the calls that come on `stream` until BYE or its end.

        Before a call starts, every message that has already arrived is read, so that a CANCEL
        sent while an earlier call ran is known before the call it names."""
        backlog: deque = deque()
        try:
            while True:
                if not backlog:  # nothing waits: the replies kept back go now, and the count of them
                    stream.flush()
                    if stream.direct:
                        self._report()
                    if not self._take(stream, backlog, *stream.conn.recv()):
                        return
                while arrived(stream.conn):
                    if not self._take(stream, backlog, *stream.conn.recv()):
                        return
                if not backlog:
                    continue
                msg, buffers = backlog.popleft()
                if self._pool is None:
                    self._call(stream, msg, buffers)
                else:
                    self._pool.submit(self._call, stream, msg, buffers)
                del msg, buffers
        except (ConnectionError, OSError, ProtocolError):
            return

    def _take(self, stream: Stream, backlog: deque, msg: dict, buffers: list) -> bool:
        """Queue a CALL, note a CANCEL, answer a PING, take a direct connection; False at the stream's end."""
        kind = msg["t"]
        if kind == messages.CALL:
            problem = messages.check_call(msg) if stream.direct else None
            if problem is not None:
                stream.send(messages.error("bad-request", problem, msg.get("id")))
            else:
                backlog.append((msg, buffers))
        elif kind == messages.CANCEL:
            stream.cancelled.add(msg.get("id"))
        elif kind == messages.PING and stream.direct:
            stream.send({"t": messages.PONG, "id": msg.get("id")})
        elif kind == messages.DIRECT and not stream.direct:
            self._open_direct(msg)
        elif kind == messages.BYE:
            return False
        elif stream.direct:
            stream.send(messages.error("protocol", f"unexpected message type {messages.printable(repr(kind), 40)} "
                                               "on a direct connection to an actor"))
            return False
        return True

    def _open_direct(self, msg: dict) -> None:
        """Take over a submitter's connection from the peer (the socket came first on the link)."""
        conn = take_connection(self.peer.conn, msg)
        if conn is None:
            return
        stream = Stream(conn, direct=True)
        with self._lock:
            route_output()  # from now on a direct call's output goes to its submitter
            self._direct.append(stream)
        threading.Thread(target=self._serve_direct, args=(stream,), name="gpulayer-direct", daemon=True).start()

    def _serve_direct(self, stream: Stream) -> None:
        try:
            self.serve(stream)
        finally:
            with self._lock:
                self._direct.remove(stream)
            stream.conn.close()

    def _call(self, stream: Stream, msg: dict, buffers: list) -> None:
        call_id = msg.get("id")
        if call_id in stream.cancelled:
            stream.cancelled.discard(call_id)
            return
        name, args = msg.get("method"), msg.get("args")
        with self._turn, self._watched(stream, msg), output_to(stream, call_id):
            reply, out = run_call(call_id, lambda: self._method(name), args, buffers)
        del msg, args, buffers
        more = stream.direct and self._pool is None and arrived(stream.conn)  # calls that came with it wait
        stream.send(reply, out, hold=more)
        if stream.direct:
            with self._lock:
                self._served_direct += 1
            if not more:
                self._report()  # after the reply: its caller waits for nothing else

    def _method(self, name: str):
        method = getattr(self.instance, name)
        if not callable(method):
            raise TypeError(f"{type(self.instance).__qualname__}.{name} is a {type(method).__name__}, not a method")
        return method

    def _report(self) -> None:
        """Tell the peer how many calls were answered on direct connections (for its STATUS), if that
        changed since the last time: once no other call waits here."""
        with self._lock:
            served = self._served_direct
            if served == self._reported:
                return
            self._reported = served
        self.peer.send({"t": messages.STATUS, "served": served})

    @contextlib.contextmanager
    def _watched(self, stream: Stream, msg: dict) -> Iterator[None]:
        """A direct call's timeout: past it, the call fails and the actor ends, as through the peer."""
        timeout = msg.get("timeout") if stream.direct else None
        if timeout is None:
            yield
            return
        timer = threading.Timer(timeout, self._expire, (stream, msg.get("id"), msg.get("method"), timeout))
        timer.daemon = True
        timer.start()
        try:
            yield
        finally:
            timer.cancel()

    def _expire(self, stream: Stream, call_id, method: str, timeout: float) -> None:
        reason = (f"its call of {method} ran past its timeout of {timeout:g} s; its worker was killed "
                  "(a running method cannot be stopped otherwise)")
        try:
            stream.send(messages.error("timeout", reason, call_id))
            with self._lock:
                others = list(self._direct)
            for other in others:  # no id: the connection is about to close, and this is why
                other.send(messages.error("actor-died", f"the actor was stopped: {reason}"))
            self.peer.send({"t": messages.BYE, "reason": reason})
        finally:
            flush_output()
            os._exit(3)


@contextlib.contextmanager
def output_to(stream: Stream, call_id, before: Callable[[], None] | None = None) -> Iterator[None]:
    """While a direct call (or a leased task) runs, what its thread prints goes to its submitter (LOG,
    before the result). `before` runs before each: a lease passes on what came to its descriptors."""
    if not stream.direct:
        yield
        return
    def send(name: str, text: str) -> None:
        if before is not None:
            before()
        stream.send(messages.log(call_id, name, text.encode("utf-8", "replace")))

    _output.sink = send
    try:
        yield
    finally:
        _output.sink = None


def arrived(conn: blocking.BlockingConnection) -> bool:
    """Whether another message is here already (parsed, or bytes waiting on the socket, or its end)."""
    if conn.reader.messages:
        return True
    try:
        conn.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
    except BlockingIOError:
        return False
    return True


def become_actor(conn: blocking.BlockingConnection, msg: dict, buffers: list) -> None:
    """Build the actor's instance from an ACTOR message and serve its calls; this worker runs no task
    after it (the peer starts a fresh one for the slot when the actor ends)."""
    def construct():
        cls = serialization.loads(msg["cls"])
        return getattr(cls, "__gpulayer_class__", cls)  # an @gl.remote class pickled by reference

    instance, failed = invoke(msg.get("id"), construct, msg["args"], buffers)
    del buffers
    if failed is not None:
        conn.send(failed)
    else:
        conn.send({"t": messages.RESULT, "id": msg.get("id"), "data": serialization.dumps(None)[0]})
        actor = Actor(conn, instance, msg.get("conc", 1))
        if lending.lender is not None:  # a call that waits on a future lends the actor's slot (ADR 0014)
            lending.lender.send, lending.lender.actor = actor.peer.send, msg.get("actor")
            lending.lender.concurrency = msg.get("conc", 1)
        actor.serve(actor.peer)
    flush_output()
    os._exit(0)  # without waiting for calls still running in threads: the peer ends this process anyway

