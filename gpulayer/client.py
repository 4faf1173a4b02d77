"""The submitter's engine: discovery, peer choice, pooled connections, futures, retries, logs.

Each peer gets one authenticated TCP connection, multiplexed by task id, with a reader
thread. A heartbeat thread pings every connection; one that stays silent while it has tasks
is declared lost, so that a peer behind a cut link fails its futures with PeerLost within
seconds (a killed peer fails them at once, when its socket resets).
"""

from __future__ import annotations

import codecs
import itertools
import linecache
import logging
import os
import re
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from dataclasses import dataclass, field

from . import discovery, serialization, wire
from .errors import (AuthError, ConfigError, GPULayerError, NoMatchingPeer, PeerLost, ProtocolError, RemoteError,
                     RemoteTraceback, TaskRejected, TaskTimeout, WorkerDied)
from .matching import Requirements, match, rank_key
from .resources.model import Advert
from .security import cluster_id, load_key

log = logging.getLogger("gpulayer.client")

CONNECT_TIMEOUT = 2.0
DOWN_BACKOFF = 5.0  # seconds a peer that failed is skipped before it is tried again
OUTPUT_KEEP = 1 << 20  # bytes of a task's stdout/stderr kept on its future
RETRYABLE = frozenset({"peer-lost", "peer-shutdown", "worker-died"})
MAX_BUSY_REJECTIONS = 600  # about ten minutes of 1 s back-offs


def _env_float(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        raise ConfigError(f"{name} must be a number of seconds") from None


class TaskFuture(Future):
    """A task's future. `cancel()` also stops the task on its peer; `stdout`/`stderr` hold its output."""

    def __init__(self, task: _Task):
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
class _Task:
    client: Client
    fn: bytes
    args: bytes
    buffers: list
    req: Requirements
    timeout: float | None
    retries: int
    name: str
    future: TaskFuture = None
    conn: PeerConnection | None = None
    task_id: int = 0
    peer_name: str | None = None
    excluded: set = field(default_factory=set)
    busy_delay: float = 0.0
    busy_rejections: int = 0
    decoders: dict = field(default_factory=dict)
    done: bool = False

    def message(self) -> tuple[dict, list]:
        msg = {"t": wire.SUBMIT, "id": self.task_id, "fn": self.fn, "args": self.args, "req": self.req.to_wire(),
               "timeout": self.timeout, "name": self.name}
        return msg, self.buffers

    def complete(self, result=None, exc: BaseException | None = None) -> None:
        """Resolve the future exactly once; later outcomes are dropped."""
        with self.client._lock:
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
        with self.client._lock:
            self.done = True
            conn = self.conn
        if conn is not None:
            conn.cancel(self)

    def on_output(self, stream: str, data: bytes) -> None:
        decoder = self.decoders.setdefault(stream, codecs.getincrementaldecoder("utf-8")("replace"))
        text = decoder.decode(data)  # a character split across two LOG frames stays whole
        attr = "stdout" if stream == "out" else "stderr"
        setattr(self.future, attr, (getattr(self.future, attr) + text)[-OUTPUT_KEEP:])
        if self.client.echo_output:
            out = sys.stdout if stream == "out" else sys.stderr
            out.write(text)
            out.flush()


class PeerConnection:
    """One authenticated connection to a peer, shared by many tasks."""

    def __init__(self, client: Client, addresses: list[tuple[str, int]]):
        self.client = client
        self.pending: dict[int, _Task] = {}
        self.closed = False
        self.refusal = ""  # why the peer closed the connection, when it said so
        self.send_error = ""
        self.load = (0, 0)
        self._load_base = 0
        self._ids = itertools.count(1)
        self._send_lock = threading.Lock()
        self._waiters: dict[int, Future] = {}
        sock, self.address = _connect(addresses)
        started = time.perf_counter()
        try:
            sock.settimeout(CONNECT_TIMEOUT)
            self._wire = wire.BlockingConnection(sock)
            hello = wire.client_handshake(self._wire, client.key, client.client_id)
            self.advert = Advert.from_txt(hello.get("advert") or {})
        except BaseException:
            sock.close()
            raise
        self.latency = time.perf_counter() - started
        self.peer_id = self.advert.peer_id
        self.name = self.advert.name
        sock.settimeout(None)
        self._wire.reader.allow(wire.max_message_bytes())
        self.silent = False  # lost because it stopped answering (not reset or closed)
        threading.Thread(target=self._read_loop, name=f"gpulayer-{self.name}", daemon=True).start()

    def send(self, msg: dict, buffers=()) -> None:
        with self._send_lock:
            self._wire.send(msg, buffers)

    def submit(self, task: _Task) -> None:
        with self.client._lock:
            task.task_id = next(self._ids)
            task.conn = self
            task.peer_name = self.name
            self.pending[task.task_id] = task
        msg, buffers = task.message()
        try:
            self.send(msg, buffers)
        except OSError as exc:
            # leave the closing to the reader thread: the peer may have said why (an ERROR) first
            self.send_error = f"send failed: {exc}"
            try:
                self._wire.sock.shutdown(socket.SHUT_WR)
            except OSError:
                self.fail(self.send_error)

    def cancel(self, task: _Task) -> None:
        with self.client._lock:
            known = self.pending.pop(task.task_id, None) is task
        if known and not self.closed:
            try:
                self.send({"t": wire.CANCEL, "id": task.task_id})
            except OSError:
                pass

    def request(self, msg: dict, timeout: float) -> dict:
        """Send a STATUS or PING and wait for the reply with the same id."""
        with self.client._lock:
            msg["id"] = next(self._ids)
            waiter = self._waiters[msg["id"]] = Future()
        try:
            self.send(msg)
            return waiter.result(timeout)
        finally:
            self._waiters.pop(msg["id"], None)

    @property
    def estimated_load(self) -> int:
        """Tasks busy or queued on the peer: ours in flight plus what others had there at its last report."""
        return len(self.pending) + max(0, sum(self.load) - self._load_base)

    def _read_loop(self) -> None:
        try:
            while True:
                msg, buffers = self._wire.recv()
                self._dispatch(msg, buffers)
        except (OSError, ConnectionError, ProtocolError) as exc:
            self.fail(self.send_error or str(exc) or type(exc).__name__)

    def _dispatch(self, msg: dict, buffers: list) -> None:
        kind = msg["t"]
        if "load" in msg and isinstance(msg["load"], list):
            self.load = tuple(msg["load"][:2])
            self._load_base = len(self.pending)
        if kind in (wire.PONG, wire.STATUS):
            waiter = self._waiters.get(msg.get("id"))
            if waiter is not None and not waiter.done():
                waiter.set_result(msg)
            return
        if kind == wire.BYE:
            self.client.mark_down(self.peer_id, "the peer is shutting down")
            return
        if kind == wire.ERROR and msg.get("id") is None:  # the peer is about to close this connection
            self.refusal = f"{msg.get('code')}: {msg.get('message')}"
            return
        task = self.pending.get(msg.get("id"))
        if task is None or kind == wire.ACCEPT:
            return
        if kind == wire.LOG:
            task.on_output(msg.get("stream"), msg.get("data") or b"")
            return
        with self.client._lock:
            if self.pending.get(msg["id"]) is not task:
                return
            del self.pending[msg["id"]]
        if kind == wire.RESULT:
            try:
                result = serialization.loads(msg["data"], buffers)
            except Exception as exc:
                task.complete(exc=RemoteError(type(exc).__name__, f"the result could not be unpickled here: {exc}", ""))
            else:
                task.complete(result)
        elif kind == wire.REJECT:
            self.client.on_reject(task, self, msg.get("code", "?"), msg.get("message", ""))
        else:
            self.client.on_error(task, msg)

    @property
    def last_heard(self) -> float:
        return self._wire.last_received

    def ping(self) -> None:
        """Send a PING unless a send is under way (a big upload); never blocks."""
        if self._send_lock.acquire(blocking=False):
            try:
                self._wire.send({"t": wire.PING})
            finally:
                self._send_lock.release()

    def fail(self, reason: str, silent: bool = False) -> None:
        """Close the connection and hand its tasks back to the client as lost."""
        with self.client._lock:
            if self.closed:
                return
            self.closed = True
            self.silent = silent
            tasks = list(self.pending.values())
            self.pending.clear()
        try:
            self._wire.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self._wire.close()
        for waiter in self._waiters.values():
            if not waiter.done():
                waiter.set_exception(PeerLost(reason))
        self.client.on_connection_lost(self, tasks, reason)


def _connect(addresses: list[tuple[str, int]]) -> tuple[socket.socket, str]:
    errors = []
    for host, port in addresses:
        try:
            sock = socket.create_connection((host, port), timeout=CONNECT_TIMEOUT)
        except OSError as exc:
            errors.append(f"{host}:{port}: {exc.strerror or exc}")
            continue
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        return sock, f"{host}:{port}"
    raise ConnectionError("; ".join(errors) or "no address")


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
        self._lock = threading.RLock()
        self._connections: dict[str, PeerConnection] = {}
        self._connecting: dict[str, threading.Lock] = {}
        self._browser = None
        self._mdns = mdns
        self._helpers = ThreadPoolExecutor(16, thread_name_prefix="gpulayer-retry")
        self._closed = threading.Event()
        self._started = False

    # ---- discovery ------------------------------------------------------------------------------

    def start(self) -> None:
        """Start browsing and probing static peers (once)."""
        with self._lock:
            if self._started:
                return
            self._started = True
        if self._mdns:
            self._browser = discovery.Browser(self.directory, self.interfaces)
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

    def _candidates(self, req: Requirements, excluded=()) -> list[discovery.PeerRecord]:
        """The matching peers that are up."""
        return [r for r in self.directory.records()
                if r.up and r.advert.peer_id not in excluded and not match(req, r.advert)]

    def _reasons(self, req: Requirements, excluded=()) -> dict[str, list[str]]:
        """Why each known peer is not a candidate, for NoMatchingPeer."""
        reasons = {}
        for record in self.directory.records():
            why = list(match(req, record.advert))
            if not why and record.advert.peer_id in excluded:
                why = ["already failed this task"]
            elif not why and not record.up:
                why = [f"down: {record.error}"]
            reasons[f"{record.advert.name} ({record.address})"] = why
        for label, error in self.static_errors.items():
            reasons[label] = [f"static peer unreachable: {error}"]
        return reasons

    def total_slots(self, req: Requirements) -> int:
        """Slots of all the matching peers that are up."""
        return sum(r.advert.slots for r in self._candidates(req))

    def _wait_for_match(self, req: Requirements, excluded=()) -> None:
        self.start()
        if self.static_errors and not self._candidates(req, excluded):
            for address in self.static:
                self._probe_static(address)
        self.directory.wait_for(lambda _: bool(self._candidates(req, excluded)), self.discovery_timeout)

    # ---- placing tasks ----------------------------------------------------------------------------

    def submit(self, fn, args=(), kwargs=None, *, req: Requirements, timeout: float | None = None,
               retries: int = 0, fn_bytes: bytes | None = None) -> TaskFuture:
        """Send one call to a matching peer; returns its future at once when a peer took it."""
        if retries < 0 or not isinstance(retries, int):
            raise ValueError(f"retries must be a non-negative integer, not {retries!r}")
        if timeout is not None and (not isinstance(timeout, (int, float)) or timeout <= 0):
            raise ValueError(f"timeout must be a positive number of seconds, not {timeout!r}")
        data, buffers = serialization.dumps((tuple(args), kwargs or {}))
        fn_bytes = fn_bytes or serialization.dumps(fn)[0]
        size = len(data) + len(fn_bytes) + sum(b.nbytes for b in buffers)
        if size > wire.max_message_bytes():
            raise ValueError(f"the task's function and arguments take {size / 2**20:.0f} MiB, over the "
                             f"{wire.max_message_bytes() >> 20} MiB message limit (GPULAYER_MAX_MESSAGE_MB)")
        task = _Task(self, fn_bytes, data, buffers, req, timeout, retries, getattr(fn, "__qualname__", type(fn).__name__))
        task.future = TaskFuture(task)
        self._place(task)
        return task.future

    def _place(self, task: _Task) -> None:
        """Give the task to the best matching peer; raise NoMatchingPeer when there is none."""
        fits = self._candidates(task.req, task.excluded)
        if not fits:
            self._wait_for_match(task.req, task.excluded)
            fits = self._candidates(task.req, task.excluded)
        failures = {}
        while fits:
            record = min(fits, key=lambda r: self._rank(task.req, r))
            fits.remove(record)
            try:
                conn = self._connection(record)
            except (OSError, GPULayerError) as exc:
                failures[f"{record.advert.name} ({record.address})"] = [f"down: {exc}"]
                continue
            why = match(task.req, conn.advert)
            if why:  # the cached or static advert was stale
                failures[f"{conn.name} ({conn.address})"] = list(why)
                continue
            conn.submit(task)
            return
        raise NoMatchingPeer(task.req, {**self._reasons(task.req, task.excluded), **failures})

    def _rank(self, req: Requirements, record: discovery.PeerRecord) -> tuple:
        conn = self._connections.get(record.advert.peer_id)
        if conn is None:
            return rank_key(req, record.advert, 0, 1.0)
        return rank_key(req, record.advert, conn.estimated_load, conn.latency)

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

    def _open(self, addresses: list[tuple[str, int]], source: str) -> PeerConnection:
        """Connect and authenticate; the peer's HELLO refreshes (or creates) its directory record."""
        conn = PeerConnection(self, addresses)
        fresh = discovery.PeerRecord(conn.advert, addresses, "static" if source == "static" else "mdns")
        if not self.directory.upsert(fresh):
            conn.fail("the peer belongs to another cluster")
            raise AuthError(f"{conn.address} belongs to another cluster")
        with self._lock:
            old = self._connections.get(conn.peer_id)
            self._connections[conn.peer_id] = conn
        if old is not None and old is not conn:
            old.fail("replaced")
        return conn

    def mark_down(self, peer_id: str, reason: str) -> None:
        record = self.directory.get(peer_id)
        if record is not None:
            record.down_until = time.monotonic() + DOWN_BACKOFF
            record.error = reason

    # ---- outcomes ---------------------------------------------------------------------------------

    def on_connection_lost(self, conn: PeerConnection, tasks: list[_Task], reason: str) -> None:
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

    def on_reject(self, task: _Task, conn: PeerConnection, code: str, message: str) -> None:
        cause = TaskRejected(code, f"{conn.name}: {message}")
        if code == "busy":  # back off, then choose again among all fitting peers
            task.busy_delay = min(task.busy_delay * 2 or 0.02, 1.0)
            task.busy_rejections += 1
            if task.busy_rejections <= MAX_BUSY_REJECTIONS:
                self._helpers.submit(self._replace, task, cause, task.busy_delay)
                return
        elif code == "no-match":  # its advert was stale: try the others
            task.excluded.add(conn.peer_id)
            self._helpers.submit(self._replace, task, cause)
            return
        task.complete(exc=cause)

    def on_error(self, task: _Task, msg: dict) -> None:
        code, message = msg.get("code", "?"), msg.get("message", "")
        if code in RETRYABLE:
            self._retry_or_fail(task, (WorkerDied if code == "worker-died" else PeerLost)(message))
        elif code == "timeout":
            task.complete(exc=TaskTimeout(message))
        elif code == "cancelled":
            task.complete(exc=CancelledError(message))
        elif code == "exception":
            task.complete(exc=_rebuild_exception(msg))
        else:
            task.complete(exc=TaskRejected(code, message))

    def _retry_or_fail(self, task: _Task, exc: GPULayerError) -> None:
        if task.done or self._closed.is_set():
            task.complete(exc=exc)
        elif task.retries > 0:
            task.retries -= 1
            task.excluded.add(task.conn.peer_id)
            log.info("retrying task %s elsewhere after %s", task.name, exc)
            self._helpers.submit(self._replace, task, exc)
        else:
            task.complete(exc=exc)

    def _replace(self, task: _Task, cause: GPULayerError, delay: float = 0.0) -> None:
        if delay and self._closed.wait(delay):
            task.complete(exc=cause)
            return
        if task.done:  # cancelled meanwhile
            return
        try:
            self._place(task)
        except NoMatchingPeer as exc:
            task.complete(exc=cause if isinstance(cause, PeerLost | WorkerDied) else exc)

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

    def peers(self, wait: float | None = None, probe: bool = True) -> list[dict]:
        """The known peers of this cluster with their state; `probe` asks each for its load."""
        self.start()
        # listen for mDNS answers; 1.5 s covers the browser's second query: a peer that announced
        # itself under a second ago stays silent to the first one (a record goes out once a second)
        self._closed.wait(min(self.discovery_timeout, 1.5) if wait is None else wait)
        rows = list(self._helpers.map(lambda record: self._describe(record, probe), self.directory.records()))
        rows += [{"name": label, "address": label, "state": "down", "error": err, "source": "static"}
                 for label, err in self.static_errors.items()]
        return sorted(rows, key=lambda r: r["name"])

    def _describe(self, record: discovery.PeerRecord, probe: bool) -> dict:
        a = record.advert
        row = {"name": a.name, "peer_id": a.peer_id, "address": record.address, "accelerator": a.accelerator,
               "device": a.device_name, "memory_kind": a.memory_kind, "device_memory_gb": list(a.device_memory_gb),
               "ram_gb": a.ram_gb, "frameworks": dict(a.frameworks), "capabilities": sorted(a.capabilities),
               "slots": a.slots, "busy": None, "queued": None, "source": record.source,
               "state": "up" if record.up else "down", "error": record.error}
        if probe:
            try:
                status = self._connection(record).request({"t": wire.STATUS}, CONNECT_TIMEOUT)
                row["busy"], row["queued"] = status["load"][:2]
                row["state"], row["error"] = "up", ""
            except (OSError, GPULayerError) as exc:
                self.mark_down(a.peer_id, str(exc))
                row["state"], row["error"] = "down", str(exc)
        return row

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        if self._started:
            self.directory.save_cache()
        for conn in list(self._connections.values()):
            conn.fail("the client closed")
        if self._browser is not None:
            self._browser.close()
        self._helpers.shutdown(wait=False, cancel_futures=True)


_FRAME_LINE = re.compile(r'^(\s*)File "([^"]+)", line (\d+), in .*$')


def _with_local_source(tb: str) -> str:
    """Add source lines the peer could not show (the code was shipped from here) from local files."""
    lines = tb.splitlines()
    out = []
    for i, line in enumerate(lines):
        out.append(line)
        frame = _FRAME_LINE.match(line)
        has_source = i + 1 < len(lines) and lines[i + 1].startswith(frame.group(1) + "  ") if frame else True
        if not has_source:
            source = linecache.getline(frame.group(2), int(frame.group(3))).strip()
            if source:
                out.append(f"{frame.group(1)}  {source}")
    return "\n".join(out) + "\n"


def _rebuild_exception(msg: dict) -> BaseException:
    """The remote exception itself when it unpickles here, with its remote traceback as cause."""
    tb = _with_local_source(msg.get("tb") or "")
    if msg.get("exc"):
        try:
            exc = serialization.loads(msg["exc"])
        except Exception:
            exc = None
        if isinstance(exc, BaseException):
            exc.__cause__ = RemoteTraceback(tb)
            return exc
    return RemoteError(msg.get("type", "Exception"), msg.get("message", ""), tb)
