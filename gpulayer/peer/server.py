"""The peer's asyncio server: authentication, admission, the queue, slots, and shutdown.

The peer never unpickles anything: it reads message envelopes (msgpack) and hands the
pickled payloads of authenticated submitters to its workers.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import shutil
import signal
import socket
import sys
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from itertools import islice

from .. import discovery, security, wire
from ..errors import ProtocolError, WorkerDied
from ..matching import Requirements, match
from ..resources.model import Advert, Resources
from .channel import AsyncChannel
from .workers import Slot, Worker, describe_exit, job_pythonpath

log = logging.getLogger("gpulayer.peer")


@dataclass
class PeerConfig:
    key: bytes
    resources: Resources
    port: int = 0
    interfaces: list[str] | None = None
    name: str = ""
    python: str = sys.executable
    concurrency: int | None = None
    preload: list[str] | None = None
    advertise: bool = True
    max_queue: int = 100_000
    drain_timeout: float = 30.0
    handshake_timeout: float = 5.0
    max_unauthenticated: int = 256
    client_silence: float = 15.0
    worker_start_timeout: float = 120.0


_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")


def plan_slots(res: Resources, concurrency: int | None) -> list[Slot]:
    """One slot per GPU (or `concurrency` per GPU); CPU-only peers get one per core by default.

    CPU slots share the cores: each worker's math libraries get cores / slots threads (unless
    the operator set those variables), so that concurrent tasks do not fight over every core.
    """
    gpus = [d for d in res.devices if d.kind == res.accelerator]
    if not gpus:
        count = concurrency or res.cpu_count or 1
        threads = str(max(1, (res.cpu_count or 1) // count))
        env = {"GPULAYER_DEVICE": "cpu", **{v: threads for v in _THREAD_VARS if v not in os.environ}}
        return [Slot(i, "cpu", env=dict(env)) for i in range(count)]
    slots = []
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    for gpu in gpus:
        if gpu.kind == "cuda":  # the peer's own CUDA_VISIBLE_DEVICES numbers what it detected
            visible = inherited[gpu.index] if gpu.index < len(inherited) else str(gpu.index)
            env = {"GPULAYER_DEVICE": "cuda:0", "CUDA_VISIBLE_DEVICES": visible}
        else:
            env = {"GPULAYER_DEVICE": "mps"}
        env["GPULAYER_DEVICE_INDEX"] = str(gpu.index)
        slots += [Slot(len(slots) + i, f"{gpu.kind}:{gpu.index}", gpu.memory_gb, env) for i in range(concurrency or 1)]
    return slots


def default_preload(res: Resources) -> list[str]:
    """Keep the frameworks that GPU tasks use warm in every worker."""
    if res.accelerator == "cpu":
        return []
    wanted = ["torch", "mlx"] if res.accelerator == "mps" else ["torch"]
    return [name for name in wanted if res.framework(name)]


@dataclass(eq=False)
class Task:
    conn: Connection
    client_id: int
    msg: dict
    buffers: list
    req: Requirements
    timeout: float | None
    slot: Slot | None = None  # where its worker runs
    group: list = field(default_factory=list)  # every slot it holds (devices=N holds N)
    timer: asyncio.TimerHandle | None = None


class Connection:
    """One submitter's TCP connection: authentication first, then its tasks."""

    def __init__(self, peer: Peer, sock: socket.socket, address: str):
        self.peer = peer
        self.address = address
        self.client = "?"
        self.authenticated = False
        self.tasks: dict[int, Task] = {}
        self.last_pong = 0.0
        self.nonce = security.new_nonce()
        self.channel = AsyncChannel(sock, wire.PRE_AUTH_MAX_FRAME, self.on_message, self.on_closed)
        self.channel.write(wire.hello(self.nonce, peer.peer_id, peer.advert.cluster, peer.advert.to_txt()))

    def on_message(self, msg: dict, buffers: list) -> None:
        try:
            if self.authenticated:
                self.peer.handle(self, msg, buffers)
            else:
                self.peer.authenticate(self, msg)
        except Exception:  # a bug of ours must cost this connection, never the peer
            log.exception("failed to handle a %r message from %s", msg.get("t"), self.address)
            self.peer.refuse(self, "internal", "the peer failed to handle this message")

    def on_closed(self, reason: str, error: ProtocolError | None) -> None:
        if error is not None:
            self.peer.refuse(self, error.code, str(error))
        else:
            self.peer.drop(self)


class Peer:
    """One peer: serves submitters on TCP, runs their tasks in warm workers, advertises over mDNS."""

    def __init__(self, config: PeerConfig):
        self.config = config
        self.peer_id = uuid.uuid4().hex[:12]
        self.name = config.name or discovery.hostname()
        self.slots = plan_slots(config.resources, config.concurrency)
        for slot in self.slots:
            slot.env.update(GPULAYER_PEER_NAME=self.name, GPULAYER_PEER_ID=self.peer_id)
        self.advert = Advert.from_resources(config.resources, peer_id=self.peer_id, name=self.name,
                                            cluster=security.cluster_id(config.key), slots=len(self.slots))
        self.port = 0
        self.tasks_done = 0
        self._queue: deque[Task] = deque()
        self._connections: set[Connection] = set()
        self._unauthenticated: dict[Connection, float] = {}  # oldest first, with its deadline
        self._draining = False
        self._forced = False
        self._stopped: asyncio.Event | None = None
        self._server: socket.socket | None = None
        self._advertiser: discovery.Advertiser | None = None
        self._background: set[asyncio.Task] = set()
        self._pythonpath = job_pythonpath(config.python)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers, listen, then advertise. Raises WorkerDied when workers cannot start."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        _raise_fd_limit()
        preload = self.config.preload if self.config.preload is not None else default_preload(self.config.resources)
        for slot in self.slots:
            slot.worker = Worker(slot, self.config.python, preload, self._on_reply, self._on_output,
                                 self._on_worker_exit, self._pythonpath)
        await asyncio.gather(*(s.worker.start(self.config.worker_start_timeout) for s in self.slots))
        host = self.config.interfaces[0] if self.config.interfaces else "0.0.0.0"
        self._server = socket.create_server((host, self.config.port), backlog=1024)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self._loop.add_reader(self._server.fileno(), self._on_accept)
        self._spawn(self._watchdog())
        if self.config.advertise:
            self._advertiser = await self._loop.run_in_executor(
                None, discovery.Advertiser, self.advert, self.port, self.config.interfaces)
        log.info("peer %s (%s) listening on %s:%d with %d slot(s): %s", self.name, self.peer_id, host, self.port,
                 len(self.slots), ", ".join(s.device for s in self.slots))

    async def wait_stopped(self) -> None:
        await self._stopped.wait()

    async def stop(self, drain: bool = True) -> None:
        """Withdraw the mDNS record first, then drain (or cancel) the tasks, then close."""
        if self._draining:
            return
        self._draining = True
        log.info("peer %s stopping: withdrawing its mDNS record", self.name)
        if self._advertiser is not None:
            await self._loop.run_in_executor(None, self._advertiser.close)
            self._advertiser = None
        self._loop.remove_reader(self._server.fileno())
        self._server.close()
        if drain and self.load_total:
            log.info("draining %d task(s), up to %.0f s", self.load_total, self.config.drain_timeout)
            deadline = time.monotonic() + self.config.drain_timeout
            while self.load_total and time.monotonic() < deadline and not self._forced:
                await asyncio.sleep(0.05)
        self.cancel_all("the peer shut down before the task finished")
        for conn in list(self._connections):
            conn.channel.write({"t": wire.BYE})
        await asyncio.gather(*(c.channel.close_gracefully() for c in list(self._connections)))
        await asyncio.gather(*(s.worker.stop() for s in self.slots), return_exceptions=True)
        for bg in list(self._background):
            bg.cancel()
        if self._pythonpath:
            shutil.rmtree(self._pythonpath, ignore_errors=True)
        self._stopped.set()

    def cancel_all(self, message: str) -> None:
        """Answer every task with a peer-shutdown error and stop it."""
        self._forced = True
        for conn in list(self._connections):
            for task in list(conn.tasks.values()):
                self._cancel(task, "peer-shutdown", message)

    def _spawn(self, coro) -> asyncio.Task:
        task = self._loop.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        return task

    # ---- load ---------------------------------------------------------------------------------

    @property
    def busy(self) -> int:
        return sum(s.task is not None for s in self.slots)

    @property
    def load_total(self) -> int:
        return self.busy + len(self._queue)

    def load(self) -> list[int]:
        return [self.busy, len(self._queue)]

    def status(self) -> dict:
        return {"t": wire.STATUS, "advert": self.advert.to_txt(), "load": self.load(), "slots": len(self.slots),
                "done": self.tasks_done, "draining": self._draining,
                "devices": [{"slot": s.index, "device": s.device, "busy": s.task is not None, "pid": s.worker.pid}
                            for s in self.slots]}

    # ---- connections --------------------------------------------------------------------------

    def _on_accept(self) -> None:
        for _ in range(64):
            try:
                sock, addr = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                return
            if len(self._unauthenticated) >= self.config.max_unauthenticated:
                oldest = next(iter(self._unauthenticated))  # evict the oldest, so floods cannot lock honest peers out
                del self._unauthenticated[oldest]
                oldest.channel.close()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(self, sock, f"{addr[0]}:{addr[1]}")
            self._unauthenticated[conn] = time.monotonic() + self.config.handshake_timeout

    async def _watchdog(self) -> None:
        """Close handshakes that stall and submitters that went silent (no PING for a while)."""
        while True:
            await asyncio.sleep(0.25)
            now = time.monotonic()
            while self._unauthenticated:
                conn, deadline = next(iter(self._unauthenticated.items()))
                if deadline > now:
                    break
                self.refuse(conn, "timeout", "no AUTH within the handshake timeout")
            for conn in list(self._connections):
                if now - conn.channel.last_received > self.config.client_silence:
                    log.warning("submitter %s at %s went silent; dropping it", conn.client, conn.address)
                    conn.channel.close()
                    self.drop(conn)
                elif conn.channel.reader.mid_message and now - conn.last_pong > 1.0:
                    # a long upload: the submitter cannot send its pings now, so show we are alive
                    conn.last_pong = now
                    conn.channel.write({"t": wire.PONG, "id": None, "load": self.load()})

    def authenticate(self, conn: Connection, msg: dict) -> None:
        self._unauthenticated.pop(conn, None)
        reply = wire.check_auth(msg, self.config.key, conn.nonce)
        if reply is None:
            self.refuse(conn, "auth", "authentication failed: wrong cluster key, or no AUTH first")
            return
        conn.authenticated = True
        conn.client = str(msg.get("client", "?"))[:64]
        conn.channel.reader.allow(wire.max_message_bytes())
        self._connections.add(conn)
        conn.channel.write(reply)

    def refuse(self, conn: Connection, code: str, message: str) -> None:
        """Tell the other side why, then close (in the background)."""
        log.warning("closing connection from %s: %s", conn.address, message)
        self._unauthenticated.pop(conn, None)
        self.drop(conn)
        conn.channel.write(wire.error(code, message))
        # a submitter may be in the middle of a large message: give it time to finish sending it,
        # so that closing does not reset the connection before it has read why
        conn.channel.close_gracefully(5.0 if conn.authenticated else 1.0)

    def drop(self, conn: Connection) -> None:
        """Forget a connection and cancel its tasks: its submitter is gone."""
        self._unauthenticated.pop(conn, None)
        if conn in self._connections:
            self._connections.discard(conn)
            for task in list(conn.tasks.values()):
                self._cancel(task, "cancelled", "the submitter disconnected", notify=False)

    def handle(self, conn: Connection, msg: dict, buffers: list) -> None:
        kind = msg["t"]
        if kind == wire.SUBMIT:
            self._on_submit(conn, msg, buffers)
        elif kind == wire.PING:
            conn.channel.write({"t": wire.PONG, "id": msg.get("id"), "load": self.load()})
        elif kind == wire.CANCEL:
            task = conn.tasks.get(msg.get("id"))
            if task is not None:
                self._cancel(task, "cancelled", "cancelled by the submitter")
        elif kind == wire.STATUS:
            conn.channel.write({**self.status(), "id": msg.get("id")})
        elif kind == wire.BYE:
            conn.channel.close()
            self.drop(conn)
        else:
            self.refuse(conn, "protocol", f"unexpected message type {kind!r} from a submitter")

    def _on_submit(self, conn: Connection, msg: dict, buffers: list) -> None:
        task_id = msg.get("id")
        problem = _check_submit(msg)
        if problem is None and task_id in conn.tasks:
            problem = f"task id {task_id} is already in use on this connection"
        if problem is not None:
            return self._reject(conn, task_id, "bad-request", problem)
        if self._draining:
            return self._reject(conn, task_id, "busy", "the peer is shutting down")
        try:
            req = Requirements.from_wire(msg.get("req") or {})
        except ValueError as exc:
            return self._reject(conn, task_id, "bad-request", str(exc))
        reasons = match(req, self.advert)
        if reasons:
            return self._reject(conn, task_id, "no-match", "; ".join(reasons))
        if len(self._queue) >= self.config.max_queue:
            return self._reject(conn, task_id, "busy", f"the queue is full ({self.config.max_queue} tasks)")
        task = Task(conn, task_id, msg, buffers, req, msg.get("timeout"))
        conn.tasks[task_id] = task
        self._queue.append(task)
        self._dispatch()
        if task.slot is None:  # it waits: say so (a task that started at once needs no ACCEPT)
            conn.channel.write({"t": wire.ACCEPT, "id": task_id, "load": self.load()})

    def _reject(self, conn: Connection, task_id, code: str, message: str) -> None:
        conn.channel.write({"t": wire.REJECT, "id": task_id, "code": code, "message": message, "load": self.load()})

    # ---- scheduling ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued tasks on ready slots, first come first served, honouring device memory.

        A task that cannot start now (too little memory on the free devices, or too few free
        devices for devices=N) lets the tasks behind it go first; the search looks 256 deep.
        """
        while self._queue:
            ready = [s for s in self.slots if s.ready]
            if not ready:
                return
            found = next(((t, g) for t in islice(self._queue, 256) if (g := _group(t.req, ready))), None)
            if found is None:
                return
            task, group = found
            self._queue.remove(task)
            self._start(task, group)

    def _start(self, task: Task, group: list[Slot]) -> None:
        lead = group[0]
        for slot in group:
            slot.task = task
        task.slot, task.group = lead, group
        msg = {"t": wire.SUBMIT, "id": task.client_id, "fn": task.msg["fn"], "args": task.msg["args"]}
        buffers, task.msg, task.buffers = task.buffers, None, None
        if len(group) == 1:
            lead.worker.send(msg, buffers)
            self._arm_timeout(task)
            return
        # several devices: a worker of its own that sees all of them, in place of the lead's warm one
        visible = ",".join(s.env["CUDA_VISIBLE_DEVICES"] for s in group)
        old, lead.worker = lead.worker, lead.worker.replacement({"CUDA_VISIBLE_DEVICES": visible})
        self._spawn(self._start_group(task, old, lead.worker, msg, buffers))

    async def _start_group(self, task: Task, old: Worker, worker: Worker, msg: dict, buffers: list) -> None:
        await old.kill()
        try:
            await worker.start(self.config.worker_start_timeout)
        except (WorkerDied, OSError) as exc:
            if worker.slot.worker is worker:
                self._answer(task, wire.error("worker-died", str(exc)))
                self._replace_worker(worker.slot)
            return
        if worker.slot.worker is not worker or worker.slot.task is not task:  # cancelled while it started
            await worker.kill()
            return
        worker.send(msg, buffers)
        self._arm_timeout(task)

    def _arm_timeout(self, task: Task) -> None:
        if task.timeout:
            task.timer = self._loop.call_later(task.timeout, self._on_timeout, task)

    def _on_reply(self, worker: Worker, reply: dict, buffers: list) -> None:
        slot = worker.slot
        task = slot.task
        if task is None or slot.worker is not worker:
            return
        if len(task.group) > 1:
            self._replace_worker(slot)  # back to a warm worker that sees its own device only
        else:
            self._release(task)
        self._answer(task, reply, buffers)
        self._dispatch()

    def _on_worker_exit(self, worker: Worker, code: int | None) -> None:
        slot = worker.slot
        if slot.worker is not worker:
            return
        task = slot.task
        log.warning("worker %s of slot %d died (%s)", worker.pid, slot.index, describe_exit(code))
        self._replace_worker(slot)
        if task is not None:
            self._answer(task, wire.error("worker-died", f"the worker process {worker.pid} died while running "
                                                         f"the task ({describe_exit(code)})"))

    def _on_timeout(self, task: Task) -> None:
        task.timer = None
        self._answer(task, wire.error("timeout", f"the task ran past its timeout of {task.timeout:g} s; "
                                                 "its worker was killed and replaced"))
        self._replace_worker(task.slot)

    def _release(self, task: Task) -> None:
        """Free the slots a task holds and stop its timer."""
        for slot in task.group:
            if slot.task is task:
                slot.task = None
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None

    def _answer(self, task: Task, reply: dict, buffers=()) -> None:
        """Send the task's outcome, once."""
        if task.conn.tasks.pop(task.client_id, None) is None:
            return
        self.tasks_done += 1
        reply["id"] = task.client_id
        reply["load"] = self.load()
        task.conn.channel.write(reply, buffers)

    def _cancel(self, task: Task, code: str, message: str, notify: bool = True) -> None:
        """Drop a queued task, or stop a running one (its worker is killed and replaced)."""
        if task.slot is None:
            self._queue.remove(task)
        elif task.slot.task is task:
            self._replace_worker(task.slot)
        if notify:
            self._answer(task, wire.error(code, message))
        else:
            task.conn.tasks.pop(task.client_id, None)

    def _replace_worker(self, slot: Slot) -> None:
        """Free the slot (and the others its task holds), kill its worker and start a fresh one."""
        if slot.task is not None:
            self._release(slot.task)
        old, slot.worker = slot.worker, slot.worker.replacement()
        self._spawn(self._restart(old, slot))

    async def _restart(self, old: Worker, slot: Slot) -> None:
        code = await old.kill()
        log.info("worker %s of slot %d ended (%s); starting a new one", old.pid, slot.index, describe_exit(code))
        delay = 0.5
        while not self._draining:
            try:
                await slot.worker.start(self.config.worker_start_timeout)
            except (WorkerDied, OSError) as exc:
                log.error("%s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                slot.worker = slot.worker.replacement()
                continue
            self._dispatch()
            return

    def _on_output(self, worker: Worker, stream: str, data: bytes) -> None:
        task = worker.slot.task if worker.slot.worker is worker else None
        if task is None or task.conn.tasks.get(task.client_id) is not task:
            log.info("worker %s %s: %s", worker.pid, stream, data.decode("utf-8", "replace").rstrip())
            return
        task.conn.channel.write({"t": wire.LOG, "id": task.client_id, "stream": stream, "data": data})


def _check_submit(msg: dict) -> str | None:
    if not isinstance(msg.get("id"), int):
        return "a SUBMIT needs an integer 'id'"
    if not isinstance(msg.get("fn"), bytes) or not isinstance(msg.get("args"), bytes):
        return "a SUBMIT needs 'fn' and 'args' as binary pickles"
    timeout = msg.get("timeout")
    if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0):
        return f"bad timeout {timeout!r}: a positive number of seconds or nil"
    return None


def _fits(req: Requirements, slot: Slot) -> bool:
    return req.gpu_memory_gb is None or slot.memory_gb is None or slot.memory_gb >= req.gpu_memory_gb


def _group(req: Requirements, ready: list[Slot]) -> list[Slot] | None:
    """Ready slots for one task: one slot, or `devices` slots on distinct devices; None if too few."""
    chosen: dict[str, Slot] = {}
    for slot in ready:
        if _fits(req, slot):
            chosen.setdefault(slot.device, slot)
            if len(chosen) == req.devices:
                return list(chosen.values())
    return None


def _raise_fd_limit() -> None:
    """Allow many connections (half-open ones included) up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_peer(config: PeerConfig, ready=None) -> None:
    """Run a peer until SIGINT or SIGTERM; a second signal cancels its tasks at once."""
    peer = Peer(config)
    await peer.start()
    if ready is not None:
        ready(peer)
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if peer._draining:
            log.warning("second signal: cancelling every task now")
            peer.cancel_all("the peer was stopped")
        else:
            peer._spawn(peer.stop())

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await peer.wait_stopped()
