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


def plan_slots(res: Resources, concurrency: int | None) -> list[Slot]:
    """One slot per GPU (or `concurrency` per GPU); CPU-only peers get one per core by default."""
    gpus = [d for d in res.devices if d.kind == res.accelerator]
    if not gpus:
        return [Slot(i, "cpu", env={"GPULAYER_DEVICE": "cpu"}) for i in range(concurrency or res.cpu_count or 1)]
    slots = []
    for gpu in gpus:
        if gpu.kind == "cuda":
            env = {"GPULAYER_DEVICE": "cuda:0", "CUDA_VISIBLE_DEVICES": str(gpu.index)}
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
    runner: asyncio.Task | None = None
    worker: Worker | None = None


@dataclass(eq=False)
class Connection:
    channel: AsyncChannel
    address: str
    client: str = "?"
    tasks: dict = field(default_factory=dict)
    serving: asyncio.Task | None = None  # the coroutine reading this connection; cancel it to drop it


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
        self._unauthenticated: dict[Connection, Connection] = {}  # oldest first
        self._draining = False
        self._forced = False
        self._accepting: asyncio.Task | None = None
        self._stopped: asyncio.Event | None = None
        self._server: socket.socket | None = None
        self._advertiser: discovery.Advertiser | None = None
        self._background: set[asyncio.Task] = set()
        self._pythonpath = job_pythonpath(config.python)

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers, listen, then advertise. Raises WorkerDied when workers cannot start."""
        self._stopped = asyncio.Event()
        _raise_fd_limit()
        preload = self.config.preload if self.config.preload is not None else default_preload(self.config.resources)
        for slot in self.slots:
            slot.worker = Worker(slot, self.config.python, preload, self._on_output, self._pythonpath)
        await asyncio.gather(*(s.worker.start(self.config.worker_start_timeout) for s in self.slots))
        host = self.config.interfaces[0] if self.config.interfaces else "0.0.0.0"
        self._server = socket.create_server((host, self.config.port), backlog=1024, reuse_port=False)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self._accepting = self._spawn(self._accept_loop())
        if self.config.advertise:
            loop = asyncio.get_running_loop()
            self._advertiser = await loop.run_in_executor(
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
            await asyncio.get_running_loop().run_in_executor(None, self._advertiser.close)
            self._advertiser = None
        self._accepting.cancel()
        self._server.close()
        if drain and self.load_total:
            log.info("draining %d task(s), up to %.0f s", self.load_total, self.config.drain_timeout)
            deadline = time.monotonic() + self.config.drain_timeout
            while self.load_total and time.monotonic() < deadline and not self._forced:
                await asyncio.sleep(0.05)
        self.cancel_all("the peer shut down before the task finished")
        runners = [s.task.runner for s in self.slots if s.task is not None]
        await asyncio.gather(*runners, return_exceptions=True)
        for conn in list(self._connections):
            conn.channel.write({"t": wire.BYE})
            try:
                await asyncio.wait_for(conn.channel.drain(0), 1.0)
            except asyncio.TimeoutError:
                pass
            conn.serving.cancel()
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
        task = asyncio.get_running_loop().create_task(coro)
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

    async def _accept_loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                sock, addr = await loop.sock_accept(self._server)
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if self._draining:
                sock.close()
                continue
            if len(self._unauthenticated) >= self.config.max_unauthenticated:
                oldest = next(iter(self._unauthenticated))  # evict the oldest, so floods cannot lock honest peers out
                self._unauthenticated.pop(oldest).serving.cancel()
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn = Connection(AsyncChannel(sock, wire.PRE_AUTH_MAX_FRAME), f"{addr[0]}:{addr[1]}")
            self._unauthenticated[conn] = conn
            conn.serving = self._spawn(self._serve(conn))
            conn.serving.add_done_callback(lambda _, channel=conn.channel: channel.close())

    async def _serve(self, conn: Connection) -> None:
        try:
            authenticated = await self._authenticate(conn)
        except asyncio.CancelledError:
            authenticated = False
        finally:
            self._unauthenticated.pop(conn, None)
        if not authenticated:
            return
        self._connections.add(conn)
        try:
            await self._read_loop(conn)
        except asyncio.CancelledError:
            pass
        finally:
            self._connections.discard(conn)
            for task in list(conn.tasks.values()):
                self._cancel(task, "cancelled", "the submitter disconnected", notify=False)

    async def _authenticate(self, conn: Connection) -> bool:
        channel = conn.channel
        nonce = security.new_nonce()
        channel.write(wire.hello(nonce, self.peer_id, self.advert.cluster, self.advert.to_txt()))
        try:
            msg, _ = await asyncio.wait_for(channel.recv(), self.config.handshake_timeout)
        except asyncio.TimeoutError:
            await self._refuse(conn, "timeout", "no AUTH within the handshake timeout")
            return False
        except ProtocolError as exc:
            await self._refuse(conn, exc.code, str(exc))
            return False
        except (ConnectionError, OSError):
            channel.close()
            return False
        reply = wire.check_auth(msg, self.config.key, nonce)
        if reply is None:
            await self._refuse(conn, "auth", "authentication failed: wrong cluster key, or no AUTH first")
            return False
        conn.client = str(msg.get("client", "?"))[:64]
        channel.reader.max_frame = wire.max_message_bytes()
        channel.write(reply)
        return True

    async def _refuse(self, conn: Connection, code: str, message: str) -> None:
        log.warning("closing connection from %s: %s", conn.address, message)
        conn.channel.write(wire.error(code, message))
        await conn.channel.aclose()

    async def _read_loop(self, conn: Connection) -> None:
        handlers = {wire.SUBMIT: self._on_submit, wire.CANCEL: self._on_cancel, wire.PING: self._on_ping,
                    wire.STATUS: self._on_status}
        while True:
            try:
                msg, buffers = await asyncio.wait_for(conn.channel.recv(), self.config.client_silence)
            except asyncio.TimeoutError:
                log.warning("submitter %s at %s went silent; dropping it", conn.client, conn.address)
                return
            except ProtocolError as exc:
                await self._refuse(conn, exc.code, str(exc))
                return
            except (ConnectionError, OSError):
                return
            kind = msg["t"]
            if kind == wire.BYE:
                return
            handler = handlers.get(kind)
            if handler is None:
                await self._refuse(conn, "protocol", f"unexpected message type {kind!r} from a submitter")
                return
            handler(conn, msg, buffers)

    def _on_ping(self, conn: Connection, msg: dict, _buffers) -> None:
        conn.channel.write({"t": wire.PONG, "id": msg.get("id"), "load": self.load()})

    def _on_status(self, conn: Connection, msg: dict, _buffers) -> None:
        conn.channel.write({**self.status(), "id": msg.get("id")})

    def _on_cancel(self, conn: Connection, msg: dict, _buffers) -> None:
        task = conn.tasks.get(msg.get("id"))
        if task is not None:
            self._cancel(task, "cancelled", "cancelled by the submitter")

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
        conn.channel.write({"t": wire.ACCEPT, "id": task_id, "load": self.load()})

    def _reject(self, conn: Connection, task_id, code: str, message: str) -> None:
        conn.channel.write({"t": wire.REJECT, "id": task_id, "code": code, "message": message, "load": self.load()})

    # ---- scheduling ---------------------------------------------------------------------------

    def _dispatch(self) -> None:
        """Start queued tasks on ready slots, first come first served, honouring device memory."""
        for slot in self.slots:
            if not self._queue:
                return
            if not slot.ready:
                continue
            task = next((t for t in self._queue if _fits(t.req, slot)), None)
            if task is None:
                continue
            self._queue.remove(task)
            slot.task = task
            task.worker = slot.worker
            task.runner = self._spawn(self._execute(task, slot))

    async def _execute(self, task: Task, slot: Slot) -> None:
        """Run a task on its slot's worker; replace the worker after a timeout, death or cancel."""
        worker = slot.worker
        msg = {"t": wire.SUBMIT, "id": task.client_id, "fn": task.msg["fn"], "args": task.msg["args"]}
        buffers, task.msg, task.buffers = task.buffers, None, None
        reply = None
        try:
            reply, buffers = await asyncio.wait_for(worker.run(msg, buffers), task.timeout)
            worker.drain_output()
        except asyncio.TimeoutError:
            reply, buffers = wire.error("timeout", f"the task ran past its timeout of {task.timeout:g} s; "
                                        "its worker was killed and replaced"), []
        except WorkerDied as exc:
            reply, buffers = wire.error("worker-died", str(exc)), []
        except asyncio.CancelledError:
            pass  # cancelled by the submitter, its disconnection or shutdown: already answered
        if reply is None or reply["t"] == wire.ERROR and reply["code"] != "exception":
            await self._replace_worker(slot)
        slot.task = None
        if reply is not None:
            self._answer(task, reply, buffers)
        self._dispatch()

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
        if task.runner is None:
            self._queue.remove(task)
        elif not task.runner.done():
            task.worker.ready = False
            task.runner.cancel()
        if notify:
            self._answer(task, wire.error(code, message))
        else:
            task.conn.tasks.pop(task.client_id, None)

    async def _replace_worker(self, slot: Slot) -> None:
        """Kill the slot's worker and start a fresh one in the background."""
        old = slot.worker
        code = await old.kill()
        log.info("worker %s of slot %d ended (%s); starting a new one", old.pid, slot.index, describe_exit(code))
        slot.worker = Worker(slot, old.python, old.preload, self._on_output, old.pythonpath)
        if not self._draining:
            self._spawn(self._start_worker(slot))

    async def _start_worker(self, slot: Slot) -> None:
        delay = 0.5
        while not self._draining:
            try:
                await slot.worker.start(self.config.worker_start_timeout)
            except (WorkerDied, OSError) as exc:
                log.error("%s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
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
