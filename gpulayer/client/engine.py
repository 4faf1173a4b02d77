"""The submitter's engine: placing tasks, retries and busy back-off, work stealing, `map`'s window.

Connections, discovery and liveness are the pool's (pool.py), the choice among peers placement's
(placement.py), a call and its future tasks.py's. The engine is the listener of each peer's own
connection: it completes, retries or places again the tasks whose outcomes come there.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Any

from .. import discovery, held, lending, remote_exceptions, serialization
from ..checks import check_priority, check_timeout
from ..errors import (ActorDied, ConfigError, GPULayerError, NoMatchingPeer, PeerLost, ProtocolError, RemoteError,
                      TaskRejected, TaskTimeout, WorkerDied)
from ..matching import Requirements, match, missing_software
from ..protocol import framing, messages
from ..task_options import check_keep, check_retries
from ..progress import ProgressBar
from ..resources.model import Advert
from ..security import cluster_id, load_key
from ..taskenv import check_env
from . import inference
from .connection import CONNECT_TIMEOUT, Listener, PeerConnection, send_quietly
from .leases import Leases
from .placement import Placement
from .pool import Pool
from .tasks import HeldResult, SubmittedTask, TaskFuture

log = logging.getLogger("gpulayer.client")

RETRYABLE = frozenset({"peer-lost", "peer-shutdown", "worker-died"})
WINDOW_RECHECK_S = 0.1  # how often a full map window looks whether it may grow
MAX_BUSY_REJECTIONS = 600  # about ten minutes of 1 s back-offs


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds") from None


def _pickle_call(fn: Callable[..., Any], call: tuple[tuple[Any, ...], dict[str, Any]]) -> tuple[bytes, list[Any],
                                                                                              list[TaskFuture]]:
    """The pickled (args, kwargs), their buffers, and the futures met among them."""
    with held.collecting() as met:
        data, buffers = serialization.dumps_call(fn, *call)
    return data, buffers, met


class _Countdown:
    """Calls `then` once `count` ticks (done callbacks of the futures a task waits for) have come."""

    def __init__(self, count: int, then: Callable[[], Any]):
        self._left, self._then, self._lock = count, then, threading.Lock()

    def tick(self, _future: Future[Any]) -> None:
        with self._lock:
            self._left -= 1
            last = self._left == 0
        if last:
            self._then()


class MapWindow:
    """At most `size()` of one map's tasks in flight; the size follows the contention (ADR 0011)."""

    def __init__(self, size: Callable[[], int]):
        self._size = size
        self._cond = threading.Condition()
        self._in_flight = 0

    def acquire(self) -> None:
        with self._cond:
            if self._in_flight >= self._size():
                with lending.lent():  # in a task: its slot is lent while the window is full (ADR 0014)
                    while self._in_flight >= self._size():  # the size may grow without a release: look again soon
                        self._cond.wait(WINDOW_RECHECK_S)
            self._in_flight += 1

    def release(self) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify()


def _task_finished(window: MapWindow, bar: ProgressBar, _future: Future[Any]) -> None:
    window.release()
    bar.advance()


class Client(Listener):
    """A submitter: finds peers of its cluster, picks one per task, and tracks the futures; the listener
    of each peer's own connection."""

    rebuild_handle: Callable[..., Any] | None = None
    """What a pickled actor handle (client/actors.py) names to be rebuilt in another process:
    `gpulayer.runtime.actor_handle`, set when that module loads (it owns the process-wide client the
    rebuilt handle calls through)."""

    def __init__(self, key: bytes | None = None, interfaces: list[str] | None = None, peers: str | None = None,
                 mdns: bool = True, echo_output: bool = True, discovery_timeout: float | None = None,
                 heartbeat: float | None = None, leases: bool | None = None):
        self.key = key or load_key()
        self.cluster = cluster_id(self.key)
        self.submitter_id = secrets.token_hex(6)  # what AUTH names this submitter to its peers
        self.interfaces = discovery.configured_interfaces(interfaces)
        self.echo_output = echo_output
        self.discovery_timeout = discovery_timeout if discovery_timeout is not None else \
            _env_float("GPULAYER_DISCOVERY_TIMEOUT", 3.0)
        self.heartbeat = heartbeat or _env_float("GPULAYER_HEARTBEAT", 1.0)
        self.directory = discovery.Directory(self.cluster, discovery.default_cache_path())
        self.directory.load_cache()
        self.directory.on_new = self._peer_appeared  # set after the cache: no task waits yet
        self.pool = Pool(self.key, self.submitter_id, self.directory, self, self.heartbeat,
                         discovery.static_peers(peers))
        self.static_errors = self.pool.static_errors
        self.placement = Placement(self.directory, self.static_errors, self._live_load)
        self._lock = threading.Lock()  # guards start-up
        self._mdns = mdns
        self._helpers = ThreadPoolExecutor(16, thread_name_prefix="gpulayer-retry")
        self.actors: dict[str, Any] = {}  # the live actors this submitter created: id -> ActorHandle
        self.leases = Leases(self, leases)  # workers that peers lent to this submitter (ADR 0013)
        self._releases: deque[tuple[str, str]] = deque()  # (peer id, result id) of dropped held futures
        self._closed = threading.Event()
        self._started = False

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    def start(self) -> None:
        """Start the heartbeat and discovery: mDNS and the static peers' probes, soon after when cached
        peers can be tried first (client/pool.py); once."""
        with self._lock:
            if self._started:
                return
            self._started = True
        self.pool.start(self._mdns, self.interfaces, self._on_heartbeat)

    def discover(self) -> None:
        """Start, and discovery now: for what waits on the peers that mDNS and the static ones bring."""
        self.start()
        self.pool.discover()

    def _on_heartbeat(self) -> None:
        """The engine's part of each heartbeat, before the pool's liveness round: the RELEASEs of dropped
        held futures, and work offered to peers found while none of our tasks waited (a first burst that
        went out before the browse found them all: they get no PING from us)."""
        self._send_releases()
        self._offer_to([r for r in self.directory.records() if r.up and self.pool.pooled(r.advert.peer_id) is None])

    def wait_for_match(self, req: Requirements, excluded: Collection[str] = ()) -> None:
        """Wait, up to the discovery timeout, until some peer is a candidate for `req`."""
        self.discover()
        if self.static_errors and not self.placement.candidates(req, excluded):
            for address in self.pool.static:
                self.pool.probe_static(address)
        self.placement.wait_for_match(req, excluded, self.discovery_timeout)

    def total_slots(self, req: Requirements) -> int:
        """Slots of all the matching peers that are up."""
        return self.placement.total_slots(req)

    def _live_load(self, peer_id: str) -> tuple[float, float, float | None] | None:
        conn = self.pool.own.get(peer_id)
        if conn is None:
            return None
        leased = self.leases.in_flight(peer_id)
        load = self.placement.contention.load(peer_id, len(conn.pending) + leased, conn.estimated_load + leased,
                                              time.monotonic() - conn.last_heard)
        return load, conn.latency, conn.free

    # ---- placing tasks ----------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None, *,
               req: Requirements, timeout: float | None = None, retries: int = 0,
               env: dict[str, str] | None = None, fn_bytes: bytes | None = None, keep: bool = False,
               priority: int = 0) -> TaskFuture:
        """Send one call to a matching peer; returns its future at once when a peer took it.

        Futures among the arguments are waited for first (the task is placed when they are done,
        and their failure is its own); `keep` holds the result on the peer (docs/data.md); a peer
        starts its waiting work highest `priority` first.
        """
        timeout, retries, env = check_timeout(timeout), check_retries(retries), check_env(env)
        call = (tuple(args), kwargs or {})
        data, buffers, deps = _pickle_call(fn, call)
        task = SubmittedTask(fn_bytes or serialization.dumps_function(fn), None, None, req, timeout, retries,
                             getattr(fn, "__qualname__", type(fn).__name__), self.echo_output, env,
                             keep=held.new_result_id() if check_keep(keep) else None, deps=deps,
                             priority=check_priority(priority))
        pending = [f for f in deps if not f.done()]
        if not pending:
            self._prepare(task, fn, data, buffers, deps)
            return task.future
        waiting = _Countdown(len(pending), lambda: self._helpers.submit(self._submit_later, task, fn, call))
        for future in pending:
            future.add_done_callback(waiting.tick)
        return task.future

    def submit_gang(self, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any], *,
                    req: Requirements, nodes: int, timeout: float | None = None, retries: int = 0,
                    env: dict[str, str] | None = None) -> Future[list[Any]]:
        """fn(*args, **kwargs) as a gang of `nodes` ranks on distinct peers (client/gangs.py, ADR 0018);
        the future's result is the ranks' results in rank order, and cancelling it stops every rank."""
        from .gangs import submit_gang

        return submit_gang(self, fn, args, kwargs, req=req, nodes=nodes, timeout=check_timeout(timeout),
                           retries=check_retries(retries), env=check_env(env))

    def _prepare(self, task: SubmittedTask, fn: Callable[..., Any], data: bytes, buffers: list[Any],
                 deps: list[TaskFuture]) -> None:
        """Place a task whose argument futures are done: it fails as the first of them that failed."""
        failed = next((f for f in deps if f.cancelled() or f.exception() is not None), None)
        if failed is not None:
            task.complete(exc=CancelledError("a future among its arguments was cancelled") if failed.cancelled()
                          else failed.exception())
            return
        assert task.fn is not None
        task.req = inference.with_inferred(task.req, fn, task.fn, data)  # after pickling: it reads the pickles
        framing.check_size("the task's function and arguments", [len(data) + len(task.fn), *(b.nbytes for b in buffers)])
        task.args, task.buffers, task.deps = data, buffers, deps
        self._place(task)

    def _submit_later(self, task: SubmittedTask, fn: Callable[..., Any],
                      call: tuple[tuple[Any, ...], dict[str, Any]]) -> None:
        """Pickle the arguments again, now that their futures are done, and place the task."""
        if task.done:  # cancelled meanwhile
            return
        try:
            self._prepare(task, fn, *_pickle_call(fn, call))
        except Exception as exc:  # NoMatchingPeer, too large, unpicklable: the future says so
            task.complete(exc=exc)

    def release_later(self, peer_id: str, result_id: str) -> None:
        """A held future was dropped: the heartbeat sends its RELEASE (safe from the garbage collector)."""
        self._releases.append((peer_id, result_id))

    def _send_releases(self) -> None:
        while self._releases:
            peer_id, result_id = self._releases.popleft()
            conn = self.pool.pooled(peer_id)
            if conn is not None:
                send_quietly(conn, messages.release(result_id))

    def received_bytes(self) -> int:
        """Bytes this submitter has read from its peer connections so far (on the socket: records and all)."""
        return self.pool.received_bytes()

    def map(self, fn: Callable[..., Any], calls: list[tuple[Any, ...]], *, req: Requirements, timeout: float | None = None,
            retries: int = 0, env: dict[str, str] | None = None, progress: bool | None = None,
            priority: int = 0) -> list[Any]:
        """fn(*args) for the args of every call, spread over all matching peers; results in input order.

        At most two tasks per slot of the matching peers are in flight at once, so that faster
        peers take more, shared among the submitters that the peers report (ADR 0011: fair
        shares, and short queues that let no peer idle while work waits). The first failure
        cancels the rest and is raised.
        """
        fn_bytes = serialization.dumps_function(fn)
        bar = ProgressBar(len(calls), label=getattr(fn, '__name__', 'map'), enabled=progress)
        futures: list[TaskFuture] = []
        window: MapWindow | None = None
        try:
            for args in calls:
                if window is not None:
                    window.acquire()
                future = self.submit(fn, args, req=req, timeout=timeout, retries=retries, env=env,
                                     fn_bytes=fn_bytes, priority=priority)
                if window is None:
                    slots = self.total_slots(req)
                    window = MapWindow(lambda: self.placement.contention.window(slots))
                    window.acquire()
                future.add_done_callback(functools.partial(_task_finished, window, bar))
                futures.append(future)
            return [f.result() for f in futures]
        except BaseException:
            for f in futures:
                f.cancel()
            raise
        finally:
            bar.close()

    def _place(self, task: SubmittedTask) -> None:
        """Give the task to the best matching peer; raise NoMatchingPeer when there is none.

        Discovery, the heartbeat and static probing run whatever the source of the peers (mDNS,
        the cache, GPULAYER_PEERS). When every known candidate fails (a stale cache, say), it
        waits for discovery to find another once before giving up.
        """
        self.start()
        failures: dict[str, list[str]] = {}
        for attempt in range(2):
            holders = [where.peer_id for where in task.held_args()[:1]]  # the largest argument's, if any
            ranked = self.placement.ranked(task.req, task.excluded, holders)
            asking = not ranked  # then peers that may have installed what it asks since: they look again
            if asking:
                ranked = self.placement.to_ask(task.req, task.excluded)
            if not ranked and (attempt == 0 or failures):
                self.wait_for_match(task.req, task.excluded)
                ranked = self.placement.ranked(task.req, task.excluded, holders)
                asking = not ranked
            for record in ranked:
                conn = self._usable_connection(task.req, record, failures, asking)
                if conn is not None:
                    if not asking:  # a lease runs what its peer matched: an asked peer decides first
                        conn = self.leases.connection_for(task, conn) or conn
                    task.conn = conn
                    conn.submit(task)
                    return
            if not failures:
                break
        raise NoMatchingPeer(task.req, {**self.placement.reasons(task.req, task.excluded), **failures},
                             self.directory.foreign_note())

    place = _place  # for actors (client/actors.py), placed like tasks

    def _usable_connection(self, req: Requirements, record: discovery.PeerRecord,
                           failures: dict[str, list[str]], asking: bool = False) -> PeerConnection | None:
        """The connection to a candidate if it is up and its verified advert still fits (`asking`: or
        lacks only software, which the peer looks for again); else note why not."""
        try:
            conn = self.pool.connection(record)
        except (OSError, GPULayerError) as exc:
            failures[f"{record.advert.name} ({record.address})"] = [f"down: {exc}"]
            return None
        why = match(req, conn.advert)
        if why and not (asking and missing_software(req, conn.advert)):  # the cached, static or mDNS advert was stale
            failures[f"{conn.name} ({conn.address})"] = list(why)
            return None
        return conn

    def _place_again(self, task: SubmittedTask, cause: GPULayerError, delay: float = 0.0) -> None:
        """Place a task that a peer rejected or lost, after `delay`; fail it with `cause` if none fits."""
        if delay and self._closed.wait(delay):
            task.complete(exc=cause)
            return
        if task.done:  # cancelled meanwhile
            return
        try:
            self._place(task)
        except NoMatchingPeer as exc:
            task.complete(exc=cause if isinstance(cause, PeerLost | WorkerDied) else exc)

    def run_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Run `fn(*args)` on a helper thread."""
        self._helpers.submit(fn, *args)

    def place_again_soon(self, task: SubmittedTask, cause: GPULayerError) -> None:
        """Place the task again from a helper thread (its last connection ended before it started)."""
        self._helpers.submit(self._place_again, task, cause)

    def connection_to(self, peer_id: str, addresses: list[tuple[str, int]]) -> PeerConnection:
        """The connection to one known peer (an actor's, a held result's), opened at `addresses` when
        there is none; the heartbeat then watches it."""
        self.start()
        return self.pool.connection_to(peer_id, addresses)

    # ---- outcomes (the Listener of each peer's own connection) ------------------------------------

    def on_outcome(self, conn: PeerConnection, task: SubmittedTask, msg: dict[str, Any], buffers: list[Any]) -> None:
        self.placement.contention.heard(conn.peer_id, msg)
        self.settle(conn, task, msg, buffers)
        if msg["t"] != messages.REJECT:
            self.on_idle(conn)

    def settle(self, conn: PeerConnection, task: SubmittedTask, msg: dict[str, Any], buffers: list[Any]) -> None:
        """Complete a task with its outcome (RESULT, ERROR, REJECT), or place it again where that says so."""
        kind = msg["t"]
        if kind == messages.ACTOR_END:  # the answer to a CLOSE
            task.complete(msg.get("served"))
        elif kind == messages.RESULT and task.keep is not None and msg.get("held") == task.keep:
            size = msg.get("size")
            task.complete(HeldResult(self, conn, task.keep, size if isinstance(size, int) else 0, task.future))
        elif kind == messages.RESULT:
            try:
                result = task.result_from(msg, buffers)
            except Exception as exc:
                task.complete(exc=RemoteError(type(exc).__name__, f"the result could not be unpickled here: {exc}", ""))
            else:
                task.complete(result)
        elif kind == messages.REJECT:
            self._on_reject(task, conn, msg.get("code", "?"), msg.get("message", ""))
        else:
            self._on_error(task, msg)

    def on_idle(self, conn: PeerConnection) -> None:
        """Work stealing (ADR 0011): the peer of `conn` has a free slot and an empty queue by its last
        report (an outcome, a PONG, or its first PING when it appeared: `_peer_appeared`); take back
        as many of our tasks waiting in other peers' queues as it has free slots, which it can run:
        each the last in the queue where it would end latest, if it would end sooner here (by each
        peer's typical run time, so that a slow peer going idle does not take work that a fast one
        is about to start). Its REJECT "withdrawn" places it again (here, most likely); a task that
        started meanwhile runs on, so that each task runs once.
        Called on the connection's reader thread: the search is in memory, and the WITHDRAW is sent
        from a helper thread (a big upload may hold the other connection's socket)."""
        if len(self.pool.own) < 2 or conn.closed or conn.load[1]:
            return
        coming = sum(t.withdrawing == conn.peer_id for t in self._in_flight())  # taken back for it already
        taken: dict[str, int] = {}  # peer id -> tasks taken from its queue in this round
        for _ in range(conn.advert.slots - conn.estimated_load - coming):
            found = self._to_withdraw(conn, taken)
            if found is None:
                return
            task, other = found
            task.withdrawing = conn.peer_id
            taken[other.peer_id] = taken.get(other.peer_id, 0) + 1
            self._helpers.submit(send_quietly, other, messages.withdraw(task.task_id))

    def _to_withdraw(self, conn: PeerConnection, taken: dict[str, int]) -> tuple[SubmittedTask, PeerConnection] | None:
        """The task to take back for the free peer of `conn` (`on_idle`), and the connection it waits on."""
        typical = self.placement.contention.typical
        best: tuple[float, SubmittedTask, PeerConnection] | None = None
        for other in list(self.pool.own.values()):
            if other is conn or other.closed:
                continue
            waiting = [t for t in self._waiting(other) if conn.peer_id not in t.excluded and not match(t.req, conn.advert)]
            if waiting:
                slots = max(other.advert.slots, 1)
                queued = max(1, other.estimated_load - slots - taken.get(other.peer_id, 0))  # ours at the back
                ends = typical(other.peer_id) * (queued / slots + 1)
                if ends > typical(conn.peer_id) and (best is None or ends > best[0]):
                    best = (ends, max(waiting, key=lambda t: t.task_id), other)  # the last in its queue
        return None if best is None else best[1:]

    def _in_flight(self) -> list[SubmittedTask]:
        """Our tasks sent to peers and not answered yet."""
        return [t for conn in list(self.pool.own.values()) for t in list(conn.pending.values())
                if isinstance(t, SubmittedTask)]

    @staticmethod
    def _waiting(conn: PeerConnection) -> list[SubmittedTask]:
        """Our tasks waiting in the queue of `conn`'s peer that no WITHDRAW has taken back yet."""
        return [t for t in list(conn.pending.values()) if isinstance(t, SubmittedTask) and t.queued and not t.withdrawing]

    def _peer_appeared(self, record: discovery.PeerRecord) -> None:
        """A peer that the directory did not know was found (ADR 0011): offer it work (`_offer_to`).
        Called on the thread that found it."""
        self._offer_to([record])

    def _offer_to(self, records: list[discovery.PeerRecord]) -> None:
        """Connect (from a helper thread) to each of the peers that could run one of our tasks waiting in
        other peers' queues, and let it take them as a peer that went idle would (ADR 0011)."""
        waiting = [t for conn in list(self.pool.own.values()) for t in self._waiting(conn)]
        for record in records if waiting and not self._closed.is_set() else ():
            if any(not match(t.req, record.advert) for t in waiting):
                self._helpers.submit(self._offer_work, record)

    def _offer_work(self, record: discovery.PeerRecord) -> None:
        """Connect to a peer that appeared, ask its load (a PING), then take work to it if it is idle."""
        try:
            conn = self.pool.connection(record)
            conn.request(messages.ping(), CONNECT_TIMEOUT)
        except (OSError, GPULayerError, FutureTimeout) as exc:
            log.debug("no work taken to peer %s that appeared: %s", record.advert.name, exc)
            return
        self.on_idle(conn)

    def on_advert(self, conn: PeerConnection, advert: Advert) -> None:
        """The peer advertises something else now (a new probe of its job interpreter found it): its
        verified record follows, and what it refused may run there now."""
        record = self.directory.get(conn.peer_id)
        source = record.source if record is not None and record.verified else "mdns"
        self.directory.upsert(discovery.PeerRecord(advert, conn.addresses, source, verified=True))
        self.placement.forget_refusals(conn.peer_id)

    def on_actor_end(self, conn: PeerConnection, msg: dict[str, Any]) -> None:
        handle = self.actors.get(msg.get("actor"))  # type: ignore[arg-type]
        if handle is not None:
            handle.died(messages.printable(msg.get("message")))

    def on_leaving(self, conn: PeerConnection) -> None:
        self.pool.forget(conn.peer_id, "the peer is shutting down")

    def on_lost(self, conn: PeerConnection, tasks: list[SubmittedTask], reason: str) -> None:
        self.pool.lost(conn, reason)
        for task in tasks:
            if conn.refusal:  # the peer refused what we sent: retrying elsewhere would fail the same way
                task.complete(exc=ProtocolError(f"peer {conn.name} closed the connection: {conn.refusal}"))
            else:
                self.retry_or_fail(task, PeerLost(f"lost peer {conn.name} ({conn.address}): {reason}"))

    def _on_reject(self, task: SubmittedTask, conn: PeerConnection, code: str, message: str) -> None:
        cause = TaskRejected(code, f"{conn.name}: {message}")
        if code == "withdrawn" and task.withdrawing:  # taken back from its queue (`on_idle`): place it again
            task.queued, task.withdrawing = False, ""
            self._helpers.submit(self._place_again, task, cause)
            return
        if code == "busy":  # back off, then choose again among all fitting peers
            task.busy_delay = min(task.busy_delay * 2 or 0.02, 1.0)
            task.busy_rejections += 1
            if task.busy_rejections <= MAX_BUSY_REJECTIONS:
                self._helpers.submit(self._place_again, task, cause, task.busy_delay)
                return
        elif code in ("no-match", "too-large"):  # its advert was stale, only the peer knew, or no memory: try others
            task.excluded[conn.peer_id] = message
            if code == "no-match":  # it will refuse these requirements again; memory may be free for the next task
                self.placement.refused(conn.peer_id, task.req, message)
            self._helpers.submit(self._place_again, task, cause)
            return
        task.complete(exc=cause)

    def _on_error(self, task: SubmittedTask, msg: dict[str, Any]) -> None:
        code, message = msg.get("code", "?"), msg.get("message", "")
        if code in RETRYABLE:
            self.retry_or_fail(task, (WorkerDied if code == "worker-died" else PeerLost)(message))
        elif code == "timeout":
            task.complete(exc=TaskTimeout(message))
        elif code == "cancelled":
            task.complete(exc=CancelledError(message))
        elif code == "exception":
            task.complete(exc=remote_exceptions.rebuild(msg))
        elif code == "held-lost":  # retrying elsewhere cannot bring it back
            task.complete(exc=PeerLost(messages.printable(message, 500)))
        elif code in ("actor-died", "no-actor"):
            task.complete(exc=ActorDied(messages.printable(message, 500)))
        else:
            task.complete(exc=TaskRejected(code, message))

    def retry_or_fail(self, task: SubmittedTask, exc: GPULayerError) -> None:
        if task.done or self._closed.is_set() or task.retries <= 0 or task.conn is None:
            task.complete(exc=exc)
            return
        task.retries -= 1
        task.excluded[task.conn.peer_id] = str(exc)
        log.info("retrying task %s elsewhere after %s", task.name, exc)
        self._helpers.submit(self._place_again, task, exc)

    # ---- inspection and shutdown ------------------------------------------------------------------

    def peers(self, wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]:
        """The known peers of this cluster with their state; `probe` asks each for its load."""
        self.discover()
        # listen for mDNS answers; 1.5 s covers the browser's second query: a peer that announced
        # itself under a second ago stays silent to the first one (a record goes out once a second)
        self._closed.wait(min(self.discovery_timeout, 1.5) if wait is None else wait)
        return self.pool.peers(probe)

    def status(self, record: discovery.PeerRecord) -> dict[str, Any]:
        """The peer's STATUS reply, over its authenticated connection (opened if need be); untrusted."""
        return self.pool.status(record)

    def create_actor(self, spec: Any) -> TaskFuture:
        """Place an actor (client/actors.py ActorSpec) on a matching peer; the future's result is its handle."""
        from .actors import create

        return create(self, spec)

    def live_actors(self) -> list[dict[str, Any]]:
        """This submitter's live actors, as their peers report them."""
        from .actors import live_actors

        return live_actors(self)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        for handle in list(self.actors.values()):
            handle.close_soon()  # the peers free their slots now, not after the grace time
        if self._started:
            self.directory.save_cache()
        self.pool.close()
        self._helpers.shutdown(wait=False, cancel_futures=True)
