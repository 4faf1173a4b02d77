"""One authenticated connection to a peer, shared by many tasks and multiplexed by task id.

A reader thread routes each message: a task's LOG to that task, its outcome (RESULT, REJECT,
ERROR) to the listener, replies to STATUS and PING to the waiting request. The connection
knows nothing of retries or placement; it reports what happened through `ConnectionListener`.
"""

from __future__ import annotations

import itertools
import socket
import threading
import time
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from collections.abc import Callable
from typing import Any, Protocol

from ..errors import GPULayerError, PeerLost, ProtocolError
from ..protocol import framing, handshake, messages
from ..resources.model import Advert
from ..resources.utilisation import MAX_GB, finite
from ..transport import blocking, shm, sockets

CONNECT_TIMEOUT = 2.0
OUTBOX_MAX = 1 << 18  # bytes of SUBMITs that a lease keeps back for one write at most


class DirectRefused(GPULayerError):
    """The peer did not hand the connection to a worker (an actor's, or one to lease): what would go
    on it goes through the peer."""


class ConnectionTask(Protocol):
    """What a connection needs of a task it carries."""

    task_id: int
    queued: bool  # the peer queued it and said it may be withdrawn (an ACCEPT with "w")

    def message(self) -> tuple[messages.Outgoing, list[Any]]: ...

    def on_output(self, stream: str, data: bytes) -> None: ...


class ConnectionListener(Protocol):
    """Where a connection reports outcomes; called on its reader thread."""

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


class PeerConnection:
    """One authenticated connection to a peer; safe to use from any thread."""

    def __init__(self, listener: ConnectionListener, addresses: list[tuple[str, int]], key: bytes, client_id: str,
                 hand_over: messages.Message | None = None):
        """`hand_over`, a DIRECT or a LEASE request, asks the peer to give the connection to a worker."""
        self.listener = listener
        self.actor_id: str | None = None  # set when the connection goes to that actor's worker (ADR 0012)
        self.lease_id: str | None = None  # set when it goes to a worker lent to this submitter (ADR 0013)
        self.lease_ended = ""  # why, once the leased worker said LEASE_END
        self.requirements: Any = None  # a lease's: what it was asked for with (client/leases.py `_lease_slot_takes`)
        self.on_cancel: Callable[[int], None] | None = None  # a lease's: also asks its peer to stop a running task
        self._outbox_lock = threading.Lock()  # a lease's: guards the outbox and _at_worker
        self._outbox: list[Any] = []  # a lease's SUBMITs kept back while its worker is busy (`_submit_leased`)
        self._outbox_tasks = 0
        self._outbox_bytes = 0
        self._at_worker = 0  # a lease's SUBMITs written and not answered yet
        self._newest = 0  # a lease's: the id of its newest task (in the outbox, or written)
        self.sent_up_to = 0  # a lease's: the id of the newest task written to its worker (`maybe_started`)
        self._busy_since = 0.0  # a lease's: when its worker last got work while it had none
        self.addresses = addresses  # where it was opened (an actor's handle passes them on)
        self.pending: dict[int, Any] = {}
        self.closed = False
        self.silent = False  # lost because it stopped answering (not reset or closed)
        self.refusal = ""  # why the peer closed the connection, when it said so
        self.send_error = ""
        self.load: tuple[int, ...] = (0, 0)
        self._load_base = 0
        self.free: float | None = None  # GB one task may take now on the peer's best device, at its last report
        self._ids = itertools.count(1)
        self._lock = threading.Lock()  # guards pending, closed and the waiters
        self._send_lock = threading.Lock()
        self._waiters: dict[int, Future[dict[str, Any]]] = {}
        sock, self.address = _connect(addresses)
        started = time.perf_counter()
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            self._wire = blocking.BlockingConnection(sock)
            hello = handshake.client_handshake(self._wire, key, client_id)
            self.advert = Advert.from_txt(hello.get("advert") or {})
            if hand_over is not None:
                self._ask_hand_over(hand_over)
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

    def _ask_hand_over(self, request: messages.Message) -> None:
        """Ask the peer to hand this connection to a worker; DirectRefused when it does not.

        The peer answers, then the worker continues the same channel (its keys and counters), so
        nothing is sent before the answer has come (ADR 0012)."""
        request = {**request, "id": next(self._ids)}
        self._wire.send(request)
        reply, _ = self._wire.recv(time.monotonic() + CONNECT_TIMEOUT)
        if reply["t"] != request["t"] or reply.get("id") != request["id"]:
            raise DirectRefused(f"{messages.printable(reply.get('code', reply['t']), 40)}: "
                                f"{messages.printable(reply.get('message'))}")
        if request["t"] == messages.DIRECT:
            self.actor_id = request["actor"]
        else:
            self.lease_id = messages.printable(reply.get("lease"), 64)

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
        if self.lease_id is not None:
            self._submit_leased(task)
            return
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

    def _submit_leased(self, task: ConnectionTask) -> None:
        """A SUBMIT on a lease: written at once when its worker has nothing to do, else kept back and
        written with the others that come meanwhile when the next answer arrives (`_answered_on_lease`):
        the worker could not start them sooner, and a burst of submits costs a few writes, not one each.
        Ids are given in the order the SUBMITs are written (the worker refuses an id not above the last)."""
        with self._outbox_lock:
            if not self._register(task):
                return
            self._newest = task.task_id
            msg, buffers = task.message()
            parts = framing.encode(msg, buffers)
            if self._at_worker and self._outbox_bytes < OUTBOX_MAX:
                self._outbox += parts
                self._outbox_tasks += 1
                self._outbox_bytes += sum(memoryview(p).nbytes for p in parts)
                return
            batch = self._take_outbox(parts)
        try:
            self._wire.send_encoded(batch)
        except OSError as exc:
            self._send_failed(exc)
        finally:
            self._send_lock.release()

    def _take_outbox(self, parts: list[Any] = ()) -> list[Any]:  # type: ignore[assignment]
        """The SUBMITs kept back, and `parts` (one more) after them, counted as at the worker; with the
        outbox lock held. Takes the send lock (the caller writes the batch, then releases it), so that
        batches go out in the order they were taken."""
        batch, self._outbox = [*self._outbox, *parts], []
        self.sent_up_to = self._newest  # before the write: a write under way counts as done (`maybe_started`)
        if not self._at_worker:
            self._busy_since = time.monotonic()
        self._at_worker += self._outbox_tasks + (1 if parts else 0)
        self._outbox_tasks = self._outbox_bytes = 0
        self._send_lock.acquire()
        return batch

    def maybe_started(self, task: ConnectionTask) -> bool:
        """Whether a leased worker may have started a task of this lease that got no answer: not after
        LEASE_END (the worker starts nothing after it), nor when the task was still kept back here. Asked
        once the connection closed: no write can begin any more."""
        return not self.lease_ended and task.task_id <= self.sent_up_to

    def _answered_on_lease(self) -> None:
        """An outcome came from the leased worker: once no other waits to be read, what was kept back goes."""
        with self._outbox_lock:
            self._at_worker = max(0, self._at_worker - 1)
            if not self._outbox or (self._at_worker and self._wire.reader.messages):
                return
            batch = self._take_outbox()
        try:
            self._wire.send_encoded(batch)
        finally:
            self._send_lock.release()

    def cancel(self, task: ConnectionTask) -> None:
        """Forget the task and ask the peer to stop it."""
        with self._lock:
            known = self.pending.pop(task.task_id, None) is task
        if known and not self.closed:
            try:
                self.send(messages.cancel(task.task_id))
            except OSError:
                pass
            if self.on_cancel is not None:
                self.on_cancel(task.task_id)

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
        return self._wire.last_received

    def silent_for(self) -> float:
        """Seconds since the other side was last heard, or since it was last given work when idle."""
        return time.monotonic() - max(self._wire.last_received, self._busy_since)

    # ---- receiving --------------------------------------------------------------------------------

    def _read_loop(self) -> None:
        try:
            while True:  # no local keeps the last message's buffers (maybe mapped segments) while waiting
                self._route(*self._wire.recv())
        except (OSError, ConnectionError, ProtocolError) as exc:
            self.fail(self.send_error or str(exc) or type(exc).__name__)

    def _route(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        kind = msg["t"]
        if isinstance(msg.get("load"), list):
            self.load = tuple(msg["load"][:2])
            self._load_base = len(self.pending)
            self.free = finite(msg.get("free"), 0, MAX_GB)
        if kind in (messages.PONG, messages.STATUS, messages.LOCAL, messages.PEERS):
            waiter = self._waiters.get(msg.get("id"))  # type: ignore[arg-type]
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            elif kind == messages.PONG and msg.get("id") is None:
                self._new_advert(msg.get("advert"))
                self.listener.on_idle(self)
            return
        if kind == messages.BYE:
            self.listener.on_leaving(self)
            return
        if kind == messages.LEASE_END and self.lease_id is not None:  # no task starts on it any more
            self.lease_ended = messages.printable(msg.get("reason"), 500) or "?"
            self.fail(f"the lease ended: {self.lease_ended}")
            return
        if kind == messages.ACTOR_END:
            self.listener.on_actor_end(self, msg)
        if kind == messages.ERROR and msg.get("id") is None:  # the peer is about to close this connection
            self.refusal = f"{msg.get('code')}: {msg.get('message')}"
            return
        if self.lease_id is not None and kind in (messages.RESULT, messages.ERROR):
            self._answered_on_lease()
        task = self.pending.get(msg.get("id"))  # type: ignore[arg-type]
        if task is None:
            return
        if kind == messages.ACCEPT:
            task.queued = msg.get("w") is True  # it waits in the peer's queue, and may be withdrawn
            return
        if kind == messages.LOG:
            task.on_output(msg.get("stream"), msg.get("data") or b"")
            return

        with self._lock:
            if self.pending.get(msg["id"]) is not task:
                return
            del self.pending[msg["id"]]
        self.listener.on_outcome(self, task, msg, buffers)

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
