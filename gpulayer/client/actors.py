"""The submitter's side of actors: creating one on a matching peer, its handle, the calls on it.

An actor is placed like a task (an ACTOR message through the engine's placement, busy back-off and
retries); its peer answers with the actor's id once the constructor ran. The handle then sends each
method call (CALL) straight to that peer, on the pooled connection, and the reply resolves the
call's future as a task's does. A handle pickles as a reference (actor id, peer id and addresses):
a task or another actor that receives one calls the actor directly, with its own cluster key.
"""

from __future__ import annotations

import logging
import os
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import serialization
from ..checks import check_timeout
from ..errors import ActorDied, GPULayerError, PeerLost, ProtocolError
from ..matching import Requirements
from ..protocol import messages
from ..transport import shm
from . import inference
from .connection import CONNECT_TIMEOUT, Listener, PeerConnection
from .tasks import SubmittedTask, TaskFuture

if TYPE_CHECKING:
    from .engine import Client

log = logging.getLogger("gpulayer.client")

CLOSE_TIMEOUT = 10.0  # seconds close() waits for the peer's word that the actor ended
DIRECT_ENV = "GPULAYER_DIRECT_CALLS"
REASON_WAIT = 1.0  # seconds calls lost with a direct connection wait for the peer's word on why


def direct_calls() -> bool:
    """Whether calls go straight to the actor's worker when they can (GPULAYER_DIRECT_CALLS, default 1)."""
    return os.environ.get(DIRECT_ENV, "1") != "0"


@dataclass(frozen=True)
class ActorSpec:
    """What creates an actor (again, for restarts): its class, constructor arguments and options."""

    cls: type
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    req: Requirements
    timeout: float | None = None  # of the constructor
    retries: int = 0  # of placing it, as for a task
    env: dict[str, str] = field(default_factory=dict)
    concurrency: int = 1
    restarts: int = 0

    @property
    def name(self) -> str:
        return getattr(self.cls, "__qualname__", type(self.cls).__name__)


def create(client: Client, spec: ActorSpec, handle: ActorHandle | None = None,
           taken: threading.Event | None = None) -> TaskFuture:
    """Place the actor on a matching peer; the future's result is its handle (`handle`, re-created).
    `taken` is set when its peer says that it took a slot and its worker starts (a peer of this build)."""
    cls_bytes = serialization.dumps(spec.cls)[0]
    data, buffers = serialization.dumps_call(spec.cls, tuple(spec.args), spec.kwargs)
    req = inference.with_inferred(spec.req, spec.cls, cls_bytes, data)
    task = ActorCreation(cls_bytes, data, buffers, req, spec.timeout, spec.retries, spec.name,
                         client.echo_output, spec.env, client=client, spec=spec, handle=handle, taken=taken)
    client.place(task)
    return task.future


@dataclass(eq=False)
class ActorCreation(SubmittedTask):
    """The ACTOR message on its way, placed and retried like a task; it resolves to the handle."""

    client: Client | None = None
    spec: ActorSpec | None = None
    handle: ActorHandle | None = None
    taken: threading.Event | None = None

    def accepted(self, queued: bool, started: bool) -> None:
        super().accepted(queued, started)
        if started and self.taken is not None:
            self.taken.set()

    def message(self) -> tuple[messages.Outgoing, list[Any]]:
        assert self.fn is not None and self.args is not None and self.spec is not None
        return messages.actor(self.task_id, self.fn, self.args, self.req.to_wire(), self.timeout, self.name,
                          self.spec.concurrency, self.env), self.buffers or []

    def result_from(self, msg: dict[str, Any], buffers: list[Any]) -> Any:
        problem = messages.check_actor_id(msg.get("actor"))
        if problem is not None:
            raise ProtocolError(f"the peer's answer to ACTOR has no actor id: {problem}")
        assert self.client is not None and self.spec is not None and self.conn is not None
        where = (msg["actor"], self.conn.peer_id, self.conn.name, self.conn.addresses,
                 msg.get("slot"))
        if self.handle is None:
            return ActorHandle(self.client, *where, self.spec.name, self.req, self.spec)
        self.handle.moved(*where)
        return self.handle


@dataclass(eq=False)
class ActorCall(SubmittedTask):
    """One method call on its way to the actor."""

    handle: ActorHandle | None = None

    @property
    def actor(self) -> str | None:
        return self.handle.actor_id if self.handle is not None else None

    def message(self) -> tuple[messages.Outgoing, list[Any]]:
        assert self.args is not None and self.handle is not None
        return messages.call(self.task_id, self.handle.actor_id, self.name, self.args, self.timeout), self.buffers or []

    def complete(self, result: Any = None, exc: BaseException | None = None) -> None:
        assert self.handle is not None
        if isinstance(exc, ActorDied):  # the peer said so: later calls know without asking
            self.handle.died(str(exc))
        elif isinstance(exc, PeerLost):  # the peer may be gone: the next call finds out
            exc = ActorDied(f"lost the connection to its peer {self.peer_name} during the call: {exc}")
        super().complete(result, exc)


@dataclass(eq=False)
class CloseRequest(SubmittedTask):
    """A CLOSE on its way; the peer's ACTOR_END resolves it with the number of calls served."""

    actor_id: str = ""

    def message(self) -> tuple[messages.Outgoing, list[Any]]:
        return messages.close(self.task_id, self.actor_id), []


class DirectConnection(PeerConnection):
    """A connection that the actor's peer handed to the actor's worker (ADR 0012). The worker may hold its
    GIL through a long method, so it does not say it is alive while calls run: the pool watches a
    direct connection through its peer's own (pool.py)."""

    beats = False

    def __init__(self, listener: DirectListener, addresses: list[tuple[str, int]], actor_id: str):
        self.actor_id = actor_id
        client = listener.client
        super().__init__(listener, addresses, client.key, client.submitter_id, messages.direct(0, actor_id))


class DirectListener(Listener):
    """Where a direct connection reports: outcomes as any connection's; when it is lost, its calls end
    with ActorDied, with the reason the peer or the worker gave when it comes soon enough."""

    def __init__(self, client: Client):
        self.client = client

    def on_outcome(self, conn: PeerConnection, task: Any, msg: dict[str, Any], buffers: list[Any]) -> None:
        self.client.settle(conn, task, msg, buffers)

    def on_lost(self, conn: PeerConnection, tasks: list[Any], reason: str) -> None:
        assert isinstance(conn, DirectConnection)
        directs = self.client.pool.directs
        if directs.get(conn.actor_id) is conn:
            del directs[conn.actor_id]
        said = conn.refusal.partition(": ")[2] if conn.refusal.startswith("actor-died") else ""
        creator = self.client.actors.get(conn.actor_id)
        if said and creator is not None:
            creator.died(said)
        if not tasks:
            return
        why = said or tasks[0].handle.death_reason(0 if conn.silent else REASON_WAIT)
        for task in tasks:
            task.complete(exc=ActorDied(why) if why else PeerLost(
                f"its direct connection to the actor's worker closed (the worker died, or the actor ended): {reason}"))


class ActorHandle:
    """A live actor: `handle.method(...)` runs the method there and returns its result, and
    `handle.method.submit(...)` returns a future. `close()` (or leaving a `with` block) ends it.

    The handle's own attributes (`close`, `alive`, `actor_id`, `peer`) hide methods of the same
    names. It pickles as a reference: whoever unpickles it calls the same actor.
    """

    def __init__(self, client: Client, actor_id: str, peer_id: str, peer_name: str,
                 addresses: list[tuple[str, int]], slot: int | None, class_name: str, req: Requirements,
                 spec: ActorSpec | None = None):
        self._client = client
        self._spec = spec  # only the creator's handle has it: it closes and re-creates the actor
        self._restarts_left = spec.restarts if spec is not None else 0
        self._lock = threading.RLock()
        self._dead: str | None = None
        self._ended = threading.Event()  # set with _dead
        self._direct_off = False  # calls go through the peer (no direct connection to be had)
        self._in_flight = {True: 0, False: 0}  # calls on their way, direct (True) and through the peer
        self.class_name = class_name
        self.req = req
        self.moved(actor_id, peer_id, peer_name, addresses, slot)

    def moved(self, actor_id: str, peer_id: str, peer_name: str, addresses: list[tuple[str, int]],
              slot: int | None) -> None:
        """The actor lives here now (created, or re-created after a death)."""
        self.actor_id, self.peer_id, self.peer, self.addresses, self.slot = \
            actor_id, peer_id, peer_name, addresses, slot
        self._dead = None
        self._ended = threading.Event()
        self._direct_off = not direct_calls()
        if self._spec is not None:
            self._client.actors[actor_id] = self

    # ---- calls ------------------------------------------------------------------------------------

    def __getattr__(self, name: str) -> ActorMethod:
        if name.startswith("_"):
            raise AttributeError(name)
        return ActorMethod(self, name)

    def call(self, method: str, args: tuple[Any, ...], kwargs: dict[str, Any], timeout: float | None) -> TaskFuture:
        """Send one method call; its future resolves with the method's result (or raises its exception)."""
        data, buffers = serialization.dumps((args, kwargs))
        conn = self._connection()
        task = ActorCall(None, data, buffers, self.req, timeout, 0, method, self._client.echo_output,
                         handle=self)
        with self._lock:
            task.conn = self._direct_for(len(data) + sum(memoryview(b).nbytes for b in buffers)) or conn
            direct = task.conn is not conn
            self._in_flight[direct] += 1
        task.future.add_done_callback(lambda _: self._landed(direct))
        task.conn.submit(task)
        return task.future

    def _direct_for(self, size: int) -> PeerConnection | None:
        """The direct connection to the actor's worker for a call of `size` bytes, or None to call
        through the peer.

        Big arguments go through the peer, which bounds what it receives by its free memory and
        passes it on in shared memory (on one host); a call never takes another way than this
        handle's calls still in flight, which it must not overtake."""
        if self._in_flight[False] or self._direct_off:
            return None
        if size >= shm.SHM_MIN and not self._in_flight[True]:
            return None
        directs = self._client.pool.directs
        conn = directs.get(self.actor_id)
        if conn is not None and not conn.closed:
            return conn
        if self._in_flight[True]:  # its direct connection just closed: the calls on it say why
            return None
        try:
            conn = DirectConnection(DirectListener(self._client), self.addresses, self.actor_id)
        except (OSError, GPULayerError) as exc:  # DirectRefused, an older peer, no route: through the peer
            log.debug("calls on actor %s go through its peer: %s", self.actor_id[:8], exc)
            self._direct_off = True
            return None
        directs[self.actor_id] = conn
        return conn

    def _landed(self, direct: bool) -> None:
        with self._lock:
            self._in_flight[direct] -= 1

    def death_reason(self, wait: float) -> str:
        """Why the actor ended, once this handle knows; waits up to `wait` seconds for the peer's word."""
        self._ended.wait(wait)
        return self._dead or ""

    def _connection(self) -> Any:
        """The connection to the actor's peer; re-creates a dead actor when restarts are left."""
        with self._lock:
            for _ in range(2):
                if self._dead is not None:
                    self._restart()
                try:
                    return self._client.connection_to(self.peer_id, self.addresses)
                except (OSError, GPULayerError) as exc:
                    self.died(f"its peer {self.peer} ({_address(self.addresses)}) is unreachable: {exc}")
            raise ActorDied(f"actor {self.class_name} {self.actor_id[:8]}: {self._dead}")

    def _restart(self) -> None:
        """Re-create the actor on a matching peer with its constructor arguments, or raise ActorDied."""
        reason = self._dead
        if self._spec is None or self._restarts_left <= 0:
            raise ActorDied(f"actor {self.class_name} {self.actor_id[:8]}: {reason}")
        self._restarts_left -= 1
        create(self._client, self._spec, self).result()
        note = (f"actor {self.class_name} ended ({reason}); re-created on peer {self.peer}, slot {self.slot} "
                f"({self._restarts_left} restart(s) left)")
        log.warning("%s", note)
        warnings.warn(note, RuntimeWarning, stacklevel=5)

    def died(self, reason: str) -> None:
        """The actor is gone: later calls raise ActorDied (or re-create it)."""
        with self._lock:
            if self._dead is None:
                self._dead = reason
            self._ended.set()
            self._client.actors.pop(self.actor_id, None)
            direct = self._client.pool.directs.pop(self.actor_id, None)
        if direct is not None:
            direct.fail(f"the actor ended: {reason}")

    @property
    def alive(self) -> bool:
        """False once this handle knows the actor ended."""
        return self._dead is None

    # ---- closing ----------------------------------------------------------------------------------

    def close(self) -> None:
        """End the actor and free its slot on the peer; only its creator may (a copy gets TaskRejected)."""
        with self._lock:
            if self._dead is not None:
                return
            try:
                conn = self._client.connection_to(self.peer_id, self.addresses)
            except (OSError, GPULayerError) as exc:
                self.died(f"closed, its peer unreachable: {exc}")
                return
            future = self._send_close(conn)
        try:
            future.result(CLOSE_TIMEOUT)
        except ActorDied:
            pass  # it had ended anyway
        self.died("the actor was closed")

    def _send_close(self, conn: Any) -> TaskFuture:
        task = CloseRequest(None, None, None, self.req, None, 0, "close", False, actor_id=self.actor_id)
        task.conn = conn
        conn.submit(task)
        return task.future

    def close_soon(self) -> None:
        """Send the CLOSE without waiting (the submitter is closing)."""
        conn = self._client.pool.pooled(self.peer_id)
        if self._dead is None and conn is not None:
            self._send_close(conn)

    def __enter__(self) -> ActorHandle:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def __reduce__(self) -> tuple[Callable[..., ActorHandle], tuple[Any, ...]]:
        rebuild = type(self._client).rebuild_handle  # from the class: an instance would bind it to the client
        assert rebuild is not None, "gpulayer.runtime sets it when it loads (before any handle exists)"
        return rebuild, (self.actor_id, self.peer_id, self.peer, self.addresses, self.slot, self.class_name, self.req)

    def __repr__(self) -> str:
        state = "" if self._dead is None else f", ended: {self._dead}"
        return f"<actor {self.class_name} {self.actor_id[:8]} on {self.peer}, slot {self.slot}{state}>"


class ActorMethod:
    """`handle.name`: call it to run the method remotely; `.submit()` for a future, `.options(timeout=)`."""

    def __init__(self, handle: ActorHandle, name: str, timeout: float | None = None):
        self._handle = handle
        self._name = name
        self._timeout = timeout

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.submit(*args, **kwargs).result()

    def submit(self, *args: Any, **kwargs: Any) -> TaskFuture:
        return self._handle.call(self._name, args, kwargs, self._timeout)

    def options(self, *, timeout: float | None = None) -> ActorMethod:
        """This method with a timeout per call: past it the call raises TaskTimeout, and the actor is
        stopped (a running method cannot be interrupted otherwise)."""
        return ActorMethod(self._handle, self._name, check_timeout(timeout))


def live_actors(client: Client) -> list[dict[str, Any]]:
    """This submitter's live actors, as their peers report them (one STATUS per peer)."""
    by_peer: dict[str, list[ActorHandle]] = {}
    for handle in list(client.actors.values()):
        by_peer.setdefault(handle.peer_id, []).append(handle)
    rows = []
    for handles in by_peer.values():
        try:
            conn = client.connection_to(handles[0].peer_id, handles[0].addresses)
            status = conn.request(messages.status_request(), CONNECT_TIMEOUT)
        except (OSError, GPULayerError) as exc:
            for handle in handles:
                handle.died(f"its peer is unreachable: {exc}")
            continue
        reported = {row.get("actor"): row for row in status.get("actors") or [] if isinstance(row, dict)}
        for handle in handles:
            row = reported.get(handle.actor_id[:8])
            if row is None:
                handle.died("its peer no longer lists it")
                continue
            rows.append({"actor": handle.actor_id, "class": handle.class_name, "peer": handle.peer,
                         "address": _address(handle.addresses), "slot": row.get("slot"),
                         "calls": row.get("served"), "pending": row.get("pending")})
    return rows


def _address(addresses: list[tuple[str, int]]) -> str:
    return ", ".join(f"{host}:{port}" for host, port in addresses)
