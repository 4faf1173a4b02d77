"""One authenticated connection to a peer, or to a worker that the peer handed it to; shared by many tasks
and multiplexed by task id.

A reader thread routes each message through one table (`PeerConnection.ROUTES`, extended by a lease's
connection in leases.py): a task's LOG to that task, its outcome (RESULT, REJECT, ERROR) to the
listener, replies to STATUS and PING to the waiting request. The connection knows nothing of retries
or placement; it reports what happened to its `Listener`. When it is alive is the pool's (pool.py).
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable
from typing import Any, ClassVar, Protocol

from ..errors import GPULayerError, PeerLost, ProtocolError
from ..protocol import handshake, messages
from ..resources.model import Advert
from ..resources.utilisation import MAX_GB, finite
from ..transport import blocking, shm, sockets

CONNECT_TIMEOUT = 2.0


class DirectRefused(GPULayerError):
    """The peer did not hand the connection to a worker (an actor's, or one to lease): what would go
    on it goes through the peer."""


class ConnectionTask(Protocol):
    """What a connection needs of a task it carries."""

    task_id: int

    def accepted(self, queued: bool, started: bool) -> None:
        """The peer's ACCEPT: queued and withdrawable ("w"), or an actor that took its slot ("s")."""

    def message(self) -> tuple[messages.Outgoing, list[Any]]: ...

    def on_output(self, stream: str, data: bytes) -> None: ...


class Listener:
    """Where a connection reports, on its reader thread. The one base of the engine (each peer's own
    connection), the leases and the direct actor connections: what a kind of connection never hears
    of, or does not care about, is ignored here."""

    def on_outcome(self, conn: PeerConnection, task: Any, msg: dict[str, Any], buffers: list[Any]) -> None:
        """A task's RESULT, REJECT or ERROR arrived (once per task)."""

    def on_actor_end(self, conn: PeerConnection, msg: dict[str, Any]) -> None:
        """The peer said that an actor ended (ACTOR_END)."""

    def on_leaving(self, conn: PeerConnection) -> None:
        """The peer said BYE: it is shutting down."""

    def on_idle(self, conn: PeerConnection) -> None:
        """The peer said, unasked, that it has a free slot and nothing queued (ADR 0011)."""

    def on_advert(self, conn: PeerConnection, advert: Advert) -> None:
        """The peer said, unasked, that it advertises something else now (a new probe found it)."""

    def on_lost(self, conn: PeerConnection, tasks: list[Any], reason: str) -> None:
        """The connection closed; `tasks` were still in flight on it."""


Route = Callable[[Any, dict[str, Any], list[Any]], None]  # a routing table's entry: (connection, message, buffers)


class PeerConnection:
    """One authenticated connection to a peer; safe to use from any thread."""

    beats: ClassVar[bool] = True
    """Whether the other end says something every heartbeat while it owes answers: a peer answers PINGs,
    a leased worker sends PONGs while it runs. The pool's liveness rule reads it (pool.py)."""

    def __init__(self, listener: Listener, addresses: list[tuple[str, int]], key: bytes, submitter_id: str,
                 hand_over: messages.Message | None = None):
        """`hand_over`, a DIRECT or a LEASE request, asks the peer to give the connection to a worker;
        the peer's answer is then `handed_over`."""
        self.listener = listener
        self.addresses = addresses  # where it was opened (an actor's handle passes them on)
        self.pending: dict[int, Any] = {}
        self.closed = False
        self.silent = False  # lost because it stopped answering (not reset or closed)
        self.refusal = ""  # why the peer closed the connection, when it said so
        self.send_error = ""
        self.load: tuple[int, ...] = (0, 0)
        self._load_base = 0
        self.free: float | None = None  # GB one task may take now on the peer's best device, at its last report
        self.handed_over: dict[str, Any] = {}  # the peer's answer to `hand_over`
        self.owing_since = 0.0  # when its tasks in flight last went from none to some (the pool's liveness rule)
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards pending, closed and the waiters
        self._send_lock = threading.Lock()
        self._waiters: dict[int, Future[dict[str, Any]]] = {}
        sock, self.address = _connect(addresses)
        started = time.perf_counter()
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            self._wire = blocking.BlockingConnection(sock)
            hello = handshake.client_handshake(self._wire, key, submitter_id)
            self.advert = Advert.from_txt(hello.get("advert") or {})
            if hand_over is not None:
                self.handed_over = self._ask_hand_over(hand_over)
        except ValueError as exc:  # the peer proved the key, but its advert is malformed
            sock.close()
            raise ProtocolError(f"{self.address} sent a bad advert: {exc}") from None
        except BaseException:
            sock.close()
            raise
        self.latency = time.perf_counter() - started
        self.peer_id = self.advert.peer_id
        self.name = self.advert.name
        sock.settimeout(None)
        # whether a local link was asked for (before the first big send); an actor's worker offers none
        self._asked_local = not shm.enabled() or hand_over is not None
        self._local_lock = threading.Lock()  # one asks; another sender of a big buffer waits for its answer
        threading.Thread(target=self._read_loop, name=f"gpulayer-{self.name}", daemon=True).start()

    def _ask_hand_over(self, request: messages.Message) -> dict[str, Any]:
        """Ask the peer to hand this connection to a worker; its answer, or DirectRefused.

        The peer answers, then the worker continues the same channel (its keys and counters), so
        nothing is sent before the answer has come (ADR 0012)."""
        request = {**request, "id": next(self._ids)}
        self._wire.send(request)
        reply, _ = self._wire.recv(time.monotonic() + CONNECT_TIMEOUT)
        if reply["t"] != request["t"] or reply.get("id") != request["id"]:
            raise DirectRefused(f"{messages.printable(reply.get('code', reply['t']), 40)}: "
                                f"{messages.printable(reply.get('message'))}")
        return reply

    # ---- sending ----------------------------------------------------------------------------------

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None:
        if not self._asked_local and any(memoryview(b).nbytes >= shm.SHM_MIN for b in buffers):
            with self._local_lock:
                if not self._asked_local:
                    self._ask_local()
        with self._send_lock:
            self._wire.send(msg, buffers)

    def _ask_local(self) -> None:
        """Ask the peer, once, for a local link: shared memory when it is on this host, as this user."""
        self._asked_local = True
        try:
            reply = self.request({"t": messages.LOCAL}, shm.LINK_TIMEOUT)
        except (PeerLost, TimeoutError, FutureTimeout):  # distinct classes before Python 3.11
            return
        self._wire.link = shm.open_link(reply.get("addr"), reply.get("token"))

    def submit(self, task: ConnectionTask) -> None:
        """Send the task's SUBMIT under a fresh id; its outcome reaches the listener."""
        if not self._register(task):
            return
        msg, buffers = task.message()
        try:
            self.send(msg, buffers)
        except OSError as exc:
            self._send_failed(exc)

    def _register(self, task: ConnectionTask) -> bool:
        """Give the task a fresh id and count it in flight; False (and the task lost) once closed."""
        with self._lock:
            closed = self.closed
            task.task_id = next(self._ids)  # also when closed: a lease's worker never saw this id
            if not closed:
                if not self.pending:
                    self.owing_since = time.monotonic()
                self.pending[task.task_id] = task
        if closed:  # it closed after placement chose it: the task is lost like its others
            self.listener.on_lost(self, [task], self.send_error or "the connection closed")
        return not closed

    def _send_failed(self, exc: OSError) -> None:
        # leave the closing to the reader thread: the other side may have said why (an ERROR) first
        self.send_error = f"send failed: {exc}"
        try:
            self._wire.sock.shutdown(socket.SHUT_WR)
        except OSError:
            self.fail(self.send_error)

    def cancel(self, task: ConnectionTask) -> bool:
        """Forget the task and ask the peer to stop it; whether it was in flight here."""
        with self._lock:
            known = self.pending.pop(task.task_id, None) is task
        if known and not self.closed:
            send_quietly(self, messages.cancel(task.task_id))
        return known

    def request(self, msg: dict[str, Any], timeout: float) -> dict[str, Any]:
        """Send a STATUS, PING or PEERS and wait for the reply with the same id."""
        waiter: Future[dict[str, Any]] = Future()
        with self._lock:
            msg["id"] = next(self._ids)
            self._waiters[msg["id"]] = waiter
        try:
            self.send(msg)
            return waiter.result(timeout)
        finally:
            with self._lock:
                self._waiters.pop(msg["id"], None)

    def ping(self) -> None:
        """Send a PING unless a send is under way (a big upload); never blocks."""
        if self._send_lock.acquire(blocking=False):
            try:
                self._wire.send(messages.ping())
            finally:
                self._send_lock.release()

    # ---- state ------------------------------------------------------------------------------------

    @property
    def estimated_load(self) -> int:
        """Tasks busy or queued on the peer: ours in flight plus what others had there at its last report."""
        return len(self.pending) + max(0, sum(self.load) - self._load_base)

    @property
    def received(self) -> int:
        """Bytes read from this connection's socket so far (records and all)."""
        return self._wire.received

    @property
    def last_heard(self) -> float:
        """When the other end was last heard (any bytes: a big message takes time)."""
        return self._wire.last_received

    # ---- receiving --------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:  # no local keeps the last message's buffers (maybe mapped segments) while waiting
                self._route(*self._wire.recv())
        except (OSError, ConnectionError, ProtocolError) as exc:
            self.fail(self.send_error or str(exc) or type(exc).__name__)

    def _route(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """Take the peer's load from any message that carries it, then route the message by its type."""
        if isinstance(msg.get("load"), list):
            self.load = tuple(msg["load"][:2])
            self._load_base = len(self.pending)
            self.free = finite(msg.get("free"), 0, MAX_GB)
        route: Route = self.ROUTES.get(msg["t"], PeerConnection._to_task)
        route(self, msg, buffers)

    def _reply(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """PONG, STATUS, LOCAL, PEERS: to the request waiting for it; a PONG nobody asked for says the peer is idle."""
        waiter = self._waiters.get(msg.get("id"))  # type: ignore[arg-type]
        if waiter is not None and not waiter.done():
            waiter.set_result(msg)
        elif msg["t"] == messages.PONG and msg.get("id") is None:
            self._new_advert(msg.get("advert"))
            self.listener.on_idle(self)

    def _bye(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        self.listener.on_leaving(self)

    def _actor_end(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """An actor ended; with an id, it also answers a CLOSE."""
        self.listener.on_actor_end(self, msg)
        self._to_task(msg, buffers)

    def _error(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """A task's ERROR; without an id, why the peer is about to close this connection."""
        if msg.get("id") is None:
            self.refusal = f"{msg.get('code')}: {msg.get('message')}"
            return
        self._to_task(msg, buffers)

    def _accept(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        task = self.pending.get(msg.get("id"))  # type: ignore[arg-type]
        if task is not None:
            task.accepted(queued=msg.get("w") is True, started=msg.get("s") is True)

    def _log(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        task = self.pending.get(msg.get("id"))  # type: ignore[arg-type]
        if task is not None:
            task.on_output(msg.get("stream"), msg.get("data") or b"")

    def _to_task(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """A task's outcome (RESULT, REJECT, ERROR, an ACTOR_END for a CLOSE): to the listener, once."""
        with self._lock:
            task = self.pending.pop(msg.get("id"), None)  # type: ignore[arg-type]
        if task is not None:
            self.listener.on_outcome(self, task, msg, buffers)

    ROUTES: ClassVar[dict[str, Route]] = {
        messages.PONG: _reply, messages.STATUS: _reply, messages.LOCAL: _reply, messages.PEERS: _reply,
        messages.BYE: _bye, messages.ACTOR_END: _actor_end, messages.ERROR: _error, messages.ACCEPT: _accept,
        messages.LOG: _log, messages.RESULT: _to_task, messages.REJECT: _to_task}
    """What each message does, by type; any other type with a task's id ends that task as an outcome does."""

    def _new_advert(self, txt: Any) -> None:
        """Take the advert that the peer sent on this channel, if it is a valid one of the same peer."""
        if txt is None:
            return
        try:
            advert = Advert.from_txt(txt)
        except ValueError:
            return
        if (advert.peer_id, advert.cluster) == (self.advert.peer_id, self.advert.cluster):
            self.advert = advert
            self.listener.on_advert(self, advert)

    def fail(self, reason: str, silent: bool = False) -> None:
        """Close the connection and hand its tasks to the listener as lost."""
        with self._lock:
            if self.closed:
                return
            self.closed = True
            self.silent = silent
            tasks = list(self.pending.values())
            self.pending.clear()
            waiters = list(self._waiters.values())
        try:
            self._wire.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._wire.close()
        for waiter in waiters:
            if not waiter.done():
                waiter.set_exception(PeerLost(reason))
        self.listener.on_lost(self, tasks, reason)


def _connect(addresses: list[tuple[str, int]]) -> tuple[socket.socket, str]:
    errors = []
    for host, port in addresses:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
            continue
        sockets.tune(sock)
        return sock, f"{host}:{port}"
    raise ConnectionError("; ".join(errors) or "no address")


def send_quietly(conn: PeerConnection, msg: messages.Outgoing) -> None:
    """Send a message that needs no answer; a connection that is gone takes it with it."""
    try:
        conn.send(msg)
    except OSError:
        pass
