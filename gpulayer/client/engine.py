"""The submitter's engine: the connection pool, futures, retries, the heartbeat and `map`'s window.

Each peer gets one authenticated TCP connection (see connection.py). A heartbeat thread
pings every connection; one that stays silent while it has tasks is declared lost, so that
a peer behind a cut link fails its futures with PeerLost within seconds (a killed peer fails
them at once, when its socket resets).
"""

from __future__ import annotations

import codecs
import functools
import logging
import os
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from .. import discovery, remote_exceptions, serialization, wire
from ..errors import (ActorDied, AuthError, ConfigError, GPULayerError, NoMatchingPeer, PeerLost, ProtocolError, RemoteError,
                      TaskRejected, TaskTimeout, WorkerDied)
from ..matching import Requirements, match
from ..options import check_retries, check_timeout
from ..progress import MapProgressBar
from ..resources.utilisation import clean_sample
from ..security import cluster_id, load_key
from . import inference
from .connection import CONNECT_TIMEOUT, PeerConnection
from .placement import Placement

log = logging.getLogger("gpulayer.client")

DOWN_BACKOFF = 5.0  # seconds a peer that failed is skipped before it is tried again
OUTPUT_KEEP = 1 << 20  # bytes of a task's stdout/stderr kept on its future
RETRYABLE = frozenset({"peer-lost", "peer-shutdown", "worker-died"})
MAX_BUSY_REJECTIONS = 600  # about ten minutes of 1 s back-offs


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds") from None


class TaskFuture(Future[Any]):
    """A task's future. `cancel()` also stops the task on its peer; `stdout`/`stderr` hold its output."""

    def __init__(self, task: SubmittedTask):
        super().__init__()
        self._task = task
        self.stdout = ""
        self.stderr = ""

    @property
    def peer(self) -> str | None:
        """The name of the peer that ran (or runs) the task."""
        return self._task.peer_name

    def cancel(self) -> bool:
        if not super().cancel():
            return False
        self._task.abandon()
        return True


@dataclass(eq=False)
class SubmittedTask:
    """One call on its way: where it is placed now, what failed before, how to resolve its future."""

    fn: bytes | None
    args: bytes | None
    buffers: list[Any] | None
    req: Requirements
    timeout: float | None
    retries: int
    name: str
    echo_output: bool
    env: dict[str, str] = field(default_factory=dict)
    future: TaskFuture = field(init=False)
    conn: PeerConnection | None = None
    task_id: int = 0
    excluded: set[str] = field(default_factory=set)
    busy_delay: float = 0.0
    busy_rejections: int = 0
    decoders: dict[str, codecs.IncrementalDecoder] = field(default_factory=dict)
    done: bool = False
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.future = TaskFuture(self)

    @property
    def peer_name(self) -> str | None:
        return self.conn.name if self.conn is not None else None

    def message(self) -> tuple[wire.Outgoing, list[Any]]:
        assert self.fn is not None and self.args is not None
        return wire.submit(self.task_id, self.fn, self.args, self.req.to_wire(), self.timeout, self.name,
                           self.env), \
            self.buffers or []

    def result_from(self, msg: dict[str, Any], buffers: list[Any]) -> Any:
        """The result that a RESULT carries: the task's return value."""
        return serialization.loads(msg["data"], buffers)

    def complete(self, result: Any = None, exc: BaseException | None = None) -> None:
        """Resolve the future exactly once; later outcomes are dropped."""
        with self._lock:
            if self.done:
                return
            self.done = True
        self.fn = self.args = self.buffers = None
        if not self.future.set_running_or_notify_cancel():
            return
        if exc is not None:
            self.future.set_exception(exc)
        else:
            self.future.set_result(result)

    def abandon(self) -> None:
        """The future was cancelled: tell the peer and forget the task."""
        with self._lock:
            self.done = True
        if self.conn is not None:
            self.conn.cancel(self)

    def on_output(self, stream: str, data: bytes) -> None:
        decoder = self.decoders.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        text = decoder.decode(data)  # a character split across two LOG frames stays whole
        attr = "stdout" if stream == "out" else "stderr"
        setattr(self.future, attr, (getattr(self.future, attr) + text)[-OUTPUT_KEEP:])
        if self.echo_output:
            out = sys.stdout if stream == "out" else sys.stderr
            out.write(text)
            out.flush()


def _task_finished(window: threading.BoundedSemaphore, bar: MapProgressBar, _future: Future[Any]) -> None:
    window.release()
    bar.advance()


class Client:
    """A submitter: finds peers of its cluster, picks one per task, and tracks the futures."""

    def __init__(self, key: bytes | None = None, interfaces: list[str] | None = None, peers: str | None = None,
                 mdns: bool = True, echo_output: bool = True, discovery_timeout: float | None = None,
                 heartbeat: float | None = None):
        self.key = key or load_key()
        self.cluster = cluster_id(self.key)
        self.client_id = uuid.uuid4().hex[:12]
        self.interfaces = discovery.configured_interfaces(interfaces)
        self.echo_output = echo_output
        self.discovery_timeout = discovery_timeout if discovery_timeout is not None else \
            _env_float("GPULAYER_DISCOVERY_TIMEOUT", 3.0)
        self.heartbeat = heartbeat or _env_float("GPULAYER_HEARTBEAT", 1.0)
        self.directory = discovery.Directory(self.cluster, discovery.default_cache_path())
        self.directory.load_cache()
        self.static = discovery.static_peers(peers)
        self.static_errors: dict[str, str] = {}
        self.placement = Placement(self.directory, self.static_errors, self._live_load)
        self._lock = threading.Lock()  # guards the pool and start-up
        self._connections: dict[str, PeerConnection] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._browser: discovery.Browser | None = None
        self._mdns = mdns
        self._helpers = ThreadPoolExecutor(16, thread_name_prefix="gpulayer-retry")
        self.actors: dict[str, Any] = {}  # the live actors this submitter created: id -> ActorHandle
        self._closed = threading.Event()
        self._started = False

    @property
    def closed(self) -> bool:
        return self._closed.is_set()

    # ---- discovery ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start browsing and probing static peers (once)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        if self._mdns:
            self._browser = discovery.Browser(self.directory, self.interfaces, self._on_goodbye)
            threading.Thread(target=self._browser.query_now, name="gpulayer-query", daemon=True).start()
        for address in self.static:
            self._helpers.submit(self._probe_static, address)
        threading.Thread(target=self._heartbeat_loop, name="gpulayer-heartbeat", daemon=True).start()

    def _probe_static(self, address: tuple[str, int]) -> None:
        label = "%s:%d" % address
        try:
            self._open([address], "static")
            self.static_errors.pop(label, None)
        except (OSError, GPULayerError) as exc:
            self.static_errors[label] = str(exc)

    def _wait_for_match(self, req: Requirements, excluded: set[str]) -> None:
        self.start()
        if self.static_errors and not self.placement.candidates(req, excluded):
            for address in self.static:
                self._probe_static(address)
        self.placement.wait_for_match(req, excluded, self.discovery_timeout)

    def total_slots(self, req: Requirements) -> int:
        """Slots of all the matching peers that are up."""
        return self.placement.total_slots(req)

    def _live_load(self, peer_id: str) -> tuple[int, float, float | None] | None:
        conn = self._connections.get(peer_id)
        return None if conn is None else (conn.estimated_load, conn.latency, conn.free)

    # ---- placing tasks ----------------------------------------------------------------------------

    def submit(self, fn: Callable[..., Any], args: Iterable[Any] = (), kwargs: dict[str, Any] | None = None, *,
               req: Requirements, timeout: float | None = None, retries: int = 0,
               env: dict[str, str] | None = None, fn_bytes: bytes | None = None) -> TaskFuture:
        """Send one call to a matching peer; returns its future at once when a peer took it."""
        timeout, retries, env = check_timeout(timeout), check_retries(retries), wire.check_env(env)
        data, buffers = serialization.dumps((tuple(args), kwargs or {}))
        fn_bytes = fn_bytes or serialization.dumps(fn)[0]
        req = inference.with_inferred(req, fn, fn_bytes, data)  # after pickling: it reads the pickles
        size = len(data) + len(fn_bytes) + sum(b.nbytes for b in buffers)
        if size > wire.max_message_bytes():
            raise ValueError(f"the task's function and arguments take {size / 2**20:.0f} MiB, over the "
                             f"{wire.max_message_bytes() >> 20} MiB message limit (GPULAYER_MAX_MESSAGE_MB)")
        task = SubmittedTask(fn_bytes, data, buffers, req, timeout, retries,
                             getattr(fn, "__qualname__", type(fn).__name__), self.echo_output, env)
        self._place(task)
        return task.future

    def map(self, fn: Callable[[Any], Any], items: list[Any], *, req: Requirements, timeout: float | None = None,
            retries: int = 0, env: dict[str, str] | None = None, progress: bool | None = None) -> list[Any]:
        """fn(item) for every item, spread over all matching peers; results in input order.

        At most two tasks per slot of the matching peers are in flight at once, so that faster
        peers take more. The first failure cancels the rest and is raised.
        """
        fn_bytes = serialization.dumps(fn)[0]
        bar = MapProgressBar(len(items), label=f"{getattr(fn, '__name__', 'map')} ", enabled=progress)
        futures: list[TaskFuture] = []
        window: threading.BoundedSemaphore | None = None
        try:
            for item in items:
                if window is not None:
                    window.acquire()
                future = self.submit(fn, (item,), req=req, timeout=timeout, retries=retries, env=env,
                                     fn_bytes=fn_bytes)
                if window is None:
                    window = threading.BoundedSemaphore(max(4, 2 * self.total_slots(req)))
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
            ranked = self.placement.ranked(task.req, task.excluded)
            if not ranked and (attempt == 0 or failures):
                self._wait_for_match(task.req, task.excluded)
                ranked = self.placement.ranked(task.req, task.excluded)
            for record in ranked:
                conn = self._usable_connection(task.req, record, failures)
                if conn is not None:
                    task.conn = conn
                    conn.submit(task)
                    return
            if not failures:
                break
        raise NoMatchingPeer(task.req, {**self.placement.reasons(task.req, task.excluded), **failures})

    place = _place  # for actors (client/actors.py), placed like tasks

    def _usable_connection(self, req: Requirements, record: discovery.PeerRecord,
                           failures: dict[str, list[str]]) -> PeerConnection | None:
        """The connection to a candidate if it is up and its verified advert still fits; else note why not."""
        try:
            conn = self._connection(record)
        except (OSError, GPULayerError) as exc:
            failures[f"{record.advert.name} ({record.address})"] = [f"down: {exc}"]
            return None
        why = match(req, conn.advert)
        if why:  # the cached, static or mDNS advert was stale
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

    def _connection(self, record: discovery.PeerRecord) -> PeerConnection:
        peer_id = record.advert.peer_id
        conn = self._connections.get(peer_id)
        if conn is not None and not conn.closed:
            return conn
        with self._lock:
            gate = self._connecting.setdefault(peer_id, threading.Lock())
        with gate:
            conn = self._connections.get(peer_id)
            if conn is not None and not conn.closed:
                return conn
            try:
                conn = self._open(record.addresses, record.source)
            except (OSError, GPULayerError) as exc:
                if isinstance(exc, AuthError) or record.source == "cache":
                    self.directory.remove(peer_id)
                self.mark_down(peer_id, str(exc))
                raise
            if conn.peer_id != peer_id:  # a cached address now holds another peer
                self.directory.remove(peer_id)
            return conn

    def pooled(self, peer_id: str) -> PeerConnection | None:
        """The open connection to a peer, if there is one."""
        conn = self._connections.get(peer_id)
        return None if conn is None or conn.closed else conn

    def connection_to(self, peer_id: str, addresses: list[tuple[str, int]]) -> PeerConnection:
        """The connection to one known peer (an actor's), opened at `addresses` when there is none.

        Raises ConnectionError when another peer answers there (the actor's peer is gone).
        """
        conn = self.pooled(peer_id)
        if conn is not None:
            return conn
        self.start()  # the heartbeat keeps the connection alive while calls run
        conn = self._open(addresses, "mdns")
        if conn.peer_id != peer_id:
            raise ConnectionError(f"peer {conn.name} ({conn.peer_id}) answers at {conn.address} now")
        return conn

    def _open(self, addresses: list[tuple[str, int]], source: str) -> PeerConnection:
        """Connect and authenticate; the peer's HELLO refreshes (or creates) its directory record."""
        conn = PeerConnection(self, addresses, self.key, self.client_id)
        fresh = discovery.PeerRecord(conn.advert, addresses, "static" if source == "static" else "mdns", verified=True)
        if not self.directory.upsert(fresh):
            conn.fail("the peer belongs to another cluster")
            raise AuthError(f"{conn.address} belongs to another cluster")
        with self._lock:  # the first live connection to a peer wins: tasks may be running on it
            old = self._connections.get(conn.peer_id)
            if old is None or old.closed:
                self._connections[conn.peer_id] = conn
                return conn
        conn.fail("a connection to this peer is already open")  # it holds no task yet
        return old

    def mark_down(self, peer_id: str, reason: str) -> None:
        record = self.directory.get(peer_id)
        if record is not None:
            record.down_until = time.monotonic() + DOWN_BACKOFF
            record.error = reason

    # ---- outcomes (the ConnectionListener of every connection) ------------------------------------

    def on_outcome(self, conn: PeerConnection, task: SubmittedTask, msg: dict[str, Any], buffers: list[Any]) -> None:
        kind = msg["t"]
        if kind == wire.ACTOR_END:  # the answer to a CLOSE
            task.complete(msg.get("served"))
        elif kind == wire.RESULT:
            try:
                result = task.result_from(msg, buffers)
            except Exception as exc:
                task.complete(exc=RemoteError(type(exc).__name__, f"the result could not be unpickled here: {exc}", ""))
            else:
                task.complete(result)
        elif kind == wire.REJECT:
            self._on_reject(task, conn, msg.get("code", "?"), msg.get("message", ""))
        else:
            self._on_error(task, msg)

    def on_actor_end(self, conn: PeerConnection, msg: dict[str, Any]) -> None:
        handle = self.actors.get(msg.get("actor"))  # type: ignore[arg-type]
        if handle is not None:
            handle.died(wire.printable(msg.get("message")))

    def on_leaving(self, conn: PeerConnection) -> None:
        self._forget(conn.peer_id, "the peer is shutting down")

    def _forget(self, peer_id: str, reason: str) -> None:
        """The peer is gone: drop its record, or mark a static one down."""
        record = self.directory.get(peer_id)
        if record is not None and record.source == "static":
            self.mark_down(peer_id, reason)
        else:
            self.directory.remove(peer_id)

    def _on_goodbye(self, record: discovery.PeerRecord) -> None:
        """An mDNS goodbye for a verified or static peer is a hint: ask the peer itself."""
        if not self._closed.is_set():
            self._helpers.submit(self._check_leaving, record)

    def _check_leaving(self, record: discovery.PeerRecord) -> None:
        try:
            status = self._connection(record).request(wire.status_request(), CONNECT_TIMEOUT)
        except (OSError, GPULayerError) as exc:
            self._forget(record.advert.peer_id, f"gone after its goodbye: {exc}")
            return
        if status.get("draining"):
            self._forget(record.advert.peer_id, "the peer is shutting down")

    def on_lost(self, conn: PeerConnection, tasks: list[SubmittedTask], reason: str) -> None:
        with self._lock:
            if self._connections.get(conn.peer_id) is conn:
                del self._connections[conn.peer_id]
        if conn.silent and not self._closed.is_set():
            # cut off or frozen: skip it for a while. A reset or a close means its host answered;
            # if the peer is dead, the next connect is refused at once.
            self.mark_down(conn.peer_id, reason)
        for task in tasks:
            if conn.refusal:  # the peer refused what we sent: retrying elsewhere would fail the same way
                task.complete(exc=ProtocolError(f"peer {conn.name} closed the connection: {conn.refusal}"))
            else:
                self._retry_or_fail(task, PeerLost(f"lost peer {conn.name} ({conn.address}): {reason}"))

    def _on_reject(self, task: SubmittedTask, conn: PeerConnection, code: str, message: str) -> None:
        cause = TaskRejected(code, f"{conn.name}: {message}")
        if code == "busy":  # back off, then choose again among all fitting peers
            task.busy_delay = min(task.busy_delay * 2 or 0.02, 1.0)
            task.busy_rejections += 1
            if task.busy_rejections <= MAX_BUSY_REJECTIONS:
                self._helpers.submit(self._place_again, task, cause, task.busy_delay)
                return
        elif code == "no-match":  # its advert was stale, or only the peer knew: try the others
            task.excluded.add(conn.peer_id)
            self.placement.refused(conn.peer_id, task.req, message)
            self._helpers.submit(self._place_again, task, cause)
            return
        task.complete(exc=cause)

    def _on_error(self, task: SubmittedTask, msg: dict[str, Any]) -> None:
        code, message = msg.get("code", "?"), msg.get("message", "")
        if code in RETRYABLE:
            self._retry_or_fail(task, (WorkerDied if code == "worker-died" else PeerLost)(message))
        elif code == "timeout":
            task.complete(exc=TaskTimeout(message))
        elif code == "cancelled":
            task.complete(exc=CancelledError(message))
        elif code == "exception":
            task.complete(exc=remote_exceptions.rebuild(msg))
        elif code in ("actor-died", "no-actor"):
            task.complete(exc=ActorDied(wire.printable(message, 500)))
        else:
            task.complete(exc=TaskRejected(code, message))

    def _retry_or_fail(self, task: SubmittedTask, exc: GPULayerError) -> None:
        if task.done or self._closed.is_set() or task.retries <= 0 or task.conn is None:
            task.complete(exc=exc)
            return
        task.retries -= 1
        task.excluded.add(task.conn.peer_id)
        log.info("retrying task %s elsewhere after %s", task.name, exc)
        self._helpers.submit(self._place_again, task, exc)

    def _heartbeat_loop(self) -> None:
        while not self._closed.wait(self.heartbeat):
            now = time.monotonic()
            for conn in list(self._connections.values()):
                if conn.pending and now - conn.last_heard > 3 * self.heartbeat:
                    conn.fail(f"no answer for {now - conn.last_heard:.1f} s", silent=True)
                    continue
                try:
                    conn.ping()
                except OSError as exc:
                    conn.fail(f"ping failed: {exc}")

    # ---- inspection and shutdown ------------------------------------------------------------------

    def peers(self, wait: float | None = None, probe: bool = True) -> list[dict[str, Any]]:
        """The known peers of this cluster with their state; `probe` asks each for its load."""
        self.start()
        # listen for mDNS answers; 1.5 s covers the browser's second query: a peer that announced
        # itself under a second ago stays silent to the first one (a record goes out once a second)
        self._closed.wait(min(self.discovery_timeout, 1.5) if wait is None else wait)
        rows = list(self._helpers.map(lambda record: self._describe(record, probe), self.directory.records()))
        rows += [{"name": label, "address": label, "state": "down", "error": err, "source": "static"}
                 for label, err in self.static_errors.items()]
        return sorted(rows, key=lambda r: r["name"])

    def status(self, record: discovery.PeerRecord) -> dict[str, Any]:
        """The peer's STATUS reply, over its authenticated connection (opened if need be); untrusted."""
        return self._connection(record).request(wire.status_request(), CONNECT_TIMEOUT)

    def _describe(self, record: discovery.PeerRecord, probe: bool) -> dict[str, Any]:
        a = record.advert
        row = {"name": a.name, "peer_id": a.peer_id, "address": record.address, "accelerator": a.accelerator,
               "device": a.device_name, "memory_kind": a.memory_kind, "device_memory_gb": list(a.device_memory_gb),
               "ram_gb": a.ram_gb, "frameworks": dict(a.frameworks), "capabilities": sorted(a.capabilities),
               "slots": a.slots, "busy": None, "queued": None, "util": None, "source": record.source,
               "state": "up" if record.up else "down", "error": record.error}
        if probe:
            try:
                status = self.status(record)
                row["busy"], row["queued"] = status["load"][:2]
                row["actors"] = len(status.get("actors") or [])  # slots that actors hold
                row["util"] = clean_sample(status.get("util"))
                row["state"], row["error"] = "up", ""
            except (OSError, GPULayerError) as exc:
                self.mark_down(a.peer_id, str(exc))
                row["state"], row["error"] = "down", str(exc)
        return row

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
        for conn in list(self._connections.values()):
            conn.fail("the client closed")
        if self._browser is not None:
            self._browser.close()
        self._helpers.shutdown(wait=False, cancel_futures=True)
