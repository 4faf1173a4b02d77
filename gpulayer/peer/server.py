"""The peer's asyncio server: connections, authentication, admission, status and shutdown.

The peer never unpickles anything: it reads message envelopes (msgpack) and hands the
pickled payloads of authenticated submitters to its scheduler (scheduler.py), which runs
them in warm workers.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import resource
import signal
import socket
import sys
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psutil

from .. import discovery, invite, mdns, security
from ..errors import ConfigError, FrameTooLarge, ProtocolError
from ..jobs.store import RETENTION_DAYS, RETENTION_GB, StateDirInUse
from ..matching import Requirements, match
from ..protocol import framing, handshake, messages
from ..resources.model import Advert, Resources
from ..resources.utilisation import Sample, Sampler
from ..transport import shm, sockets
from ..transport.channel import AsyncChannel
from .actors import Actor, grace_from_env
from .jobs import Jobs
from .local import LocalLinks
from .quiet import QuietLog
from .reprobe import Reprobe
from .worker_processes import Worker
from . import admission, gossip, held, pull
from .scheduler import Scheduler, default_preload, plan_slots
from .slots import Submission, TaskHolder

log = logging.getLogger("gpulayer.peer")

ACCEPT_PAUSE_MIN, ACCEPT_PAUSE_MAX = 0.05, 1.0  # back-off of accepting when out of descriptors (s)

Handler = Callable[["Connection", messages.Message, list[Any]], None]  # one kind of message from a submitter


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
    workdir: str | None = None  # where tasks start; None: a scratch folder removed at stop
    measured_from: str | None = None  # recorded readings replacing the measured utilisation (a test seam)
    state_dir: str | None = None  # the jobs' folder (peer/jobs.py); None: the first free one of the user's
    job_retention_days: float = RETENTION_DAYS
    job_retention_gb: float = RETENTION_GB
    max_slots_per_user: int | None = None  # the slots one user@host may hold at once (tasks and jobs); None: no cap
    seeds: list[tuple[str, int]] = field(default_factory=list)  # peers to gossip with at first (gossip.py)
    pull: bool = True  # take over jobs queued on other peers when a slot is free (pull.py, ADR 0019)


class Connection:
    """One submitter's TCP connection: authentication first, then its tasks."""

    def __init__(self, peer: Peer, sock: socket.socket, address: str):
        self.peer = peer
        self.address = address
        self.submitter_id = "?"
        self.authenticated = False
        self.tasks: dict[int, Submission] = {}  # its tasks and actor creations, queued or running
        self.calls: dict[int, tuple[Actor, int]] = {}  # its actor calls in flight (peer/actors.py)
        self.probing: set[int] = set()  # its tasks waiting for a new probe of the job interpreter (reprobe.py)
        self.last_pong = 0.0
        self.link: socket.socket | None = None  # its local link for shared memory, if it has one (local.py)
        self.hello = handshake.hello(security.new_nonce(), peer.peer_id, peer.advert.cluster, peer.advert.to_txt())
        self.channel = AsyncChannel(sock, framing.PRE_AUTH_MAX_FRAME, self.on_message, self.on_closed)
        self.channel.write(self.hello)

    def on_message(self, msg: messages.Message, buffers: list[Any]) -> None:
        try:
            if self.authenticated:
                if "fds" in msg:
                    buffers = self._attach(msg, buffers)
                self.peer.handle(self, msg, buffers)
            else:
                self.peer.handle_unauthenticated(self, msg)
        except shm.ShmError as exc:
            self.peer.refuse(self, "protocol", str(exc))
        except FrameTooLarge as exc:
            self.peer.refuse(self, exc.code, str(exc))
        except Exception:  # a bug of ours must cost this connection, never the peer
            log.exception("failed to handle a %r message from %s", msg.get("t"), self.address)
            self.peer.refuse(self, "internal", "the peer failed to handle this message")

    def _attach(self, msg: messages.Message, buffers: list[Any]) -> list[Any]:
        """The buffers of a message with shared-memory segments on the local link, within the message limit."""
        buffers = shm.receive_with(self.link, msg, buffers)
        total = sum(memoryview(b).nbytes for b in buffers)
        if total > self.channel.reader.max_frame:
            raise FrameTooLarge(f"a message of {total} bytes exceeds the limit of {self.channel.reader.max_frame} "
                                "bytes a message")
        return buffers

    def on_closed(self, reason: str, error: ProtocolError | None) -> None:
        if error is not None:
            self.peer.refuse(self, error.code, str(error))
        else:
            self.peer.drop(self)

    # ---- TaskOwner: where the scheduler sends a task's outcome and output ----

    def task_done(self, task: Submission, reply: messages.Outgoing, buffers: list[Any]) -> None:
        self.tasks.pop(task.task_id, None)
        keep = task.keep if isinstance(task, TaskHolder) else None
        if keep is not None and reply["t"] == messages.RESULT:  # type: ignore[typeddict-item]
            reply, buffers = self.peer.held.keep(keep, self.submitter_id, reply, buffers)
        self.send(reply, buffers)

    def task_output(self, task: Submission, msg: messages.LogMessage) -> None:
        self.channel.write(msg)

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None:
        """Write a message; its segments go by descriptor over the local link, if there is one.

        A message that a frame cannot carry (over 4 GiB: from a worker that did not check its result)
        is answered with an ERROR "too-large" for its id instead; if its descriptors went ahead on the
        link, the link is out of step and the connection is closed."""
        try:
            self.channel.write(msg, shm.send_over(self.link, msg, buffers, copy=False))
        except FrameTooLarge as exc:
            log.warning("a message to %s is too large for the wire: %s", self.address, exc)
            self.channel.write(messages.error(exc.code, str(exc), msg.get("id")))
            if "fds" in msg:
                self.peer.refuse(self, exc.code, str(exc))


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
        preload = config.preload if config.preload is not None else default_preload(config.resources)
        self.scheduler = Scheduler(self.slots, config.python, preload, config.worker_start_timeout, config.workdir,
                                   config.max_slots_per_user)
        # measured utilisation: for STATUS, and free memory for starting tasks
        self.held = held.HeldResults(held.limit_from_env(), grace_from_env())  # results kept (keep=True)
        self.sampler = Sampler(recorded=config.measured_from, on_sample=self._on_sample)
        self.reprobe = Reprobe(config.python)  # looks again for what tasks ask and the last probe missed
        self.invites = invite.Invites(config.key, log.warning)  # open invite codes (invite.py)
        self.gossip = gossip.Gossip(config.key, self.peer_id, [], config.seeds)  # its addresses once it listens
        self.port = 0
        self._connections: set[Connection] = set()
        self._unauthenticated: dict[Connection, float] = {}  # oldest first, with its deadline
        self._lingering: dict[Connection, None] = {}  # refused, closing in the background; oldest first
        self._accept_pause = 0.0  # seconds accepting pauses after running out of descriptors
        self.quiet = QuietLog(log)  # warnings that anyone can cause: a line a kind per interval
        self._draining = False
        self._forced = False
        self._stopped: asyncio.Event | None = None
        self._server: socket.socket | None = None
        self._advertiser: mdns.Advertiser | None = None
        self._browser: mdns.Browser | None = None  # the peers that pulling asks, heard over mDNS
        self._directory: discovery.Directory | None = None  # what the browser heard
        self._loop: asyncio.AbstractEventLoop | None = None
        self._local: LocalLinks | None = None  # shared memory with submitters of this host and user
        self._headroom = memory_headroom()
        check_shm_settings()
        try:
            self.jobs = Jobs(self.scheduler, config.python, config.state_dir, lambda: self.advert,
                             config.job_retention_days, config.job_retention_gb, config.key)
        except (OSError, StateDirInUse) as exc:
            raise ConfigError(f"the state folder: {exc}") from None
        self.jobs.gangs.where = self.paths
        self.puller: pull.Puller | None = None  # once started, with --pull (the default)
        self._pre_auth, self._post_auth = self._handlers()

    def _memory_refusal(self, total: int) -> str | None:
        return memory_refusal(total, self._headroom)

    def _on_sample(self, sample: Sample) -> None:
        """From the sampling thread: hand a new measurement to the scheduler, on the event loop."""
        try:
            if self._loop is not None:
                self._loop.call_soon_threadsafe(self.scheduler.measure, sample)
        except RuntimeError:  # the loop has closed: the peer is gone
            pass

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the workers, listen, then advertise. Raises WorkerDied when workers cannot start."""
        self._loop = asyncio.get_running_loop()
        self._stopped = asyncio.Event()
        _raise_fd_limit()
        await self.scheduler.start()
        self.jobs.recover()
        host = self.config.interfaces[0] if self.config.interfaces else ""
        self._server = listen_socket(host, self.config.port)
        self._server.setblocking(False)
        self.port = self._server.getsockname()[1]
        self._loop.add_reader(self._server.fileno(), self._on_accept)
        if shm.enabled():
            self._local = LocalLinks(self._loop, self.quiet)
        self.scheduler.spawn(self._watchdog())
        self.gossip.addresses = [(a, self.port) for a in discovery.advertised_addresses(self.config.interfaces)]
        self.scheduler.spawn(gossip.rounds(self.gossip, self.port))
        self.sampler.start()
        if self.config.pull:
            await self._start_pulling()
        if self.config.advertise:
            self._advertiser = await self._loop.run_in_executor(
                None, mdns.Advertiser, self.advert, self.port, self.config.interfaces, self.jobs.dir)
        log.info("peer %s (%s) listening on %s with %d slot(s): %s", self.name, self.peer_id,
                 discovery.host_port((host or "*", self.port)),
                 len(self.slots), ", ".join(s.device for s in self.slots))

    async def _start_pulling(self) -> None:
        """Pull queued jobs from the peers that mDNS (when it is on) and gossip name (pull.py)."""
        assert self._loop is not None
        directory = self._directory = discovery.Directory(self.advert.cluster)
        if self.config.advertise:
            self._browser = await self._loop.run_in_executor(None, mdns.Browser, directory,
                                                             self.config.interfaces)

        def owners() -> list[list[discovery.Address]]:
            """Gossip's members, and the peers mDNS names that no handshake verified yet: an advert naming
            a verified peer at other addresses (a twin) is a hint no peer follows."""
            verified = self.gossip.members.keys() | puller.verified()
            heard = [r.addresses for r in directory.records() if r.advert.peer_id != self.peer_id
                     and r.advert.peer_id not in verified and messages.JOB_PULL in r.advert.features]
            known = heard + [m.addresses for m in self.gossip.members.values()]
            return [list(a) for a in dict.fromkeys(tuple(a) for a in known if a)]

        self.puller = puller = pull.Puller(self.jobs, self.config.key, self.peer_id, lambda: self.advert, owners)
        loop = self._loop

        def heard(_record: discovery.PeerRecord) -> None:  # on the browser's thread
            loop.call_soon_threadsafe(puller.heard)

        directory.on_new = heard
        self.scheduler.on_acted = self.puller.changed
        self.scheduler.spawn(self.puller.run())

    def paths(self, peer_id: str) -> list[discovery.Address]:
        """Where this peer would reach `peer_id`, best first (hints: a handshake there proves the id): itself at
        the addresses it listens on; another where its gossip verified it, then where mDNS adverts claim it."""
        if peer_id == self.peer_id:
            return list(self.gossip.addresses)
        member = self.gossip.members.get(peer_id)
        claims = self._directory.claims(peer_id) if self._directory is not None else []
        return [*(member.addresses if member else []), *(a for claim in claims for a in claim.addresses)]

    async def wait_stopped(self) -> None:
        assert self._stopped is not None
        await self._stopped.wait()

    @property
    def draining(self) -> bool:
        return self._draining

    @property
    def instance(self) -> str | None:
        """The mDNS instance name it advertises under, None when it does not advertise."""
        return self._advertiser.info.name if self._advertiser is not None else None

    async def stop(self, drain: bool = True) -> None:
        """Withdraw the mDNS record first, then drain (or cancel) the tasks, then close."""
        if self._draining:
            return
        assert self._loop is not None and self._server is not None and self._stopped is not None
        self._draining = self.scheduler.stopping = True
        self.scheduler.end_leases()
        log.info("peer %s stopping: withdrawing its mDNS record", self.name)
        if self._advertiser is not None:
            await self._loop.run_in_executor(None, self._advertiser.close)
            self._advertiser = None
        if self.puller is not None:
            self.puller.stop()
        if self._browser is not None:
            await self._loop.run_in_executor(None, self._browser.close)
            self._browser = None
        self._loop.remove_reader(self._server.fileno())
        self._server.close()
        if self._local is not None:
            self._local.close()
        if drain and self.load_total:
            log.info("draining %d task(s), up to %.0f s", self.load_total, self.config.drain_timeout)
            deadline = time.monotonic() + self.config.drain_timeout
            while self.load_total and time.monotonic() < deadline and not self._forced:
                await asyncio.sleep(0.05)
        self.cancel_all("the peer shut down before the task finished")
        for conn in list(self._connections):
            conn.channel.write({"t": messages.BYE})
        await asyncio.gather(*(c.channel.close_gracefully() for c in list(self._connections)))
        await self.jobs.shutdown()
        await self.scheduler.stop()
        self.sampler.stop()
        self.quiet.flush(final=True)
        self._stopped.set()

    def cancel_all(self, message: str) -> None:
        """Answer every task with a peer-shutdown error and stop it."""
        self._forced = True
        self.scheduler.end_actors(message)
        for conn in list(self._connections):
            for task in list(conn.tasks.values()):
                self.scheduler.cancel(task, "peer-shutdown", message)

    # ---- load ---------------------------------------------------------------------------------

    @property
    def tasks_done(self) -> int:
        return self.scheduler.state.tasks_done

    @property
    def load_total(self) -> int:
        """Tasks running or queued (actors are not waited for: they end when the peer stops; jobs are
        recorded, lost if they ran, and queued ones start after a restart)."""
        state = self.scheduler.state
        return state.busy - state.held_by_actors - state.held_by_jobs + state.queued - len(self.jobs.queued)

    def status(self) -> dict[str, Any]:
        return {"t": messages.STATUS, "advert": self.advert.to_txt(), **self.scheduler.report({}), "slots": len(self.slots),
                "done": self.tasks_done, "withdrawn": self.scheduler.state.withdrawn, "draining": self._draining,
                "actors": self.scheduler.actors.rows(),
                "devices": [{"slot": s.index, "device": s.device, "busy": s.task is not None,
                             "pid": s.worker.pid if s.worker else None} for s in self.slots],
                **self.scheduler.activity.snapshot(), "util": self.sampler.latest(),
                "unreserved_gb": self.scheduler.state.free_memory(), "held_bytes": self.held.bytes, "held": len(self.held),
                "jobs": self.jobs.summary(), **self.jobs.isolation}

    # ---- connections --------------------------------------------------------------------------

    def _on_accept(self) -> None:
        assert self._server is not None
        for _ in range(64):
            try:
                sock, addr = self._server.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                self._accept_failed(exc)
                return
            self._accept_pause = 0.0
            self._make_room()
            sockets.tune(sock)
            conn = Connection(self, sock, discovery.host_port(discovery.remote(addr)))
            self._unauthenticated[conn] = time.monotonic() + self.config.handshake_timeout

    def _make_room(self) -> None:
        """Keep connections not (or no longer) authenticated under the cap: close the oldest.

        Lingering refused connections go first, then the oldest handshake, so that a flood
        cannot lock honest submitters out.
        """
        while len(self._unauthenticated) + len(self._lingering) >= self.config.max_unauthenticated:
            pool: dict[Connection, Any] = self._lingering or self._unauthenticated
            oldest = next(iter(pool))
            del pool[oldest]
            oldest.channel.close()

    def _accept_failed(self, exc: OSError) -> None:
        """Out of descriptors (or another accept error): pause accepting, back off, warn rarely (quiet.py)."""
        assert self._loop is not None and self._server is not None
        self._accept_pause = min(max(2 * self._accept_pause, ACCEPT_PAUSE_MIN), ACCEPT_PAUSE_MAX)
        self.quiet.warning("failed accepts", "accept failed: %s; pausing new connections for %.2f s",
                           exc, self._accept_pause)
        fd = self._server.fileno()
        self._loop.remove_reader(fd)
        self._loop.call_later(self._accept_pause, self._resume_accepting, fd)

    def _resume_accepting(self, fd: int) -> None:
        if not self._draining and self._loop is not None:
            self._loop.add_reader(fd, self._on_accept)

    async def _watchdog(self) -> None:
        """Close handshakes that stall and submitters that went silent (no PING for a while)."""
        while True:
            await asyncio.sleep(0.25)
            self.quiet.flush()
            now = time.monotonic()
            while self._unauthenticated:
                conn, deadline = next(iter(self._unauthenticated.items()))
                if deadline > now:
                    break
                self.refuse(conn, "timeout", "no AUTH within the handshake timeout")
            for conn in list(self._connections):
                if now - conn.channel.last_received > self.config.client_silence:
                    log.warning("submitter %s at %s went silent; dropping it", conn.submitter_id, conn.address)
                    conn.channel.close()
                    self.drop(conn)
                elif conn.channel.reader.mid_message and now - conn.last_pong > 1.0:
                    # a long upload: the submitter cannot send its pings now, so show we are alive
                    conn.last_pong = now
                    conn.channel.write(self.scheduler.report({"t": messages.PONG, "id": None}))

    def authenticate(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Check an AUTH: the connection is a key holder's from now on, its later frames sealed; else refuse it."""
        checked = handshake.check_auth(msg, self.config.key, conn.hello)
        if checked is None:
            self.refuse(conn, "auth", "authentication failed: wrong cluster key, or no AUTH first")
            return
        reply, keys = checked
        conn.authenticated = True
        conn.submitter_id = "".join(ch for ch in str(msg.get("client", "?"))[:64] if ch.isprintable())
        self._connections.add(conn)
        conn.channel.write(reply)  # the last frame in clear: every later byte both ways is sealed
        conn.channel.secure(*keys)
        self._receiving(conn.channel.reader, conn.submitter_id)
        self.scheduler.submitter_connected(conn)
        self.held.connected(conn.submitter_id)

    def _invite_step(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """One message of an invite's exchange (invite.py): unauthenticated, it can get the cluster key
        for the right code and nothing else; the connection closes after it."""
        reply, more = self.invites.step(conn, conn.hello, msg)
        if reply["t"] == messages.ERROR:
            return self.refuse(conn, reply["code"], reply["message"])
        conn.channel.write(reply)
        if more:
            self._unauthenticated[conn] = time.monotonic() + self.config.handshake_timeout
            return
        log.info("gave the cluster key to %s, which had an invite's code", conn.address)
        self.drop(conn)
        conn.channel.close_gracefully()

    def _receiving(self, reader: framing.MessageReader, submitter_id: str) -> None:
        """Receive big buffers as this peer does: within the memory headroom, into segments where it has
        local links (segments pooled for this submitter's data only)."""
        reader.budget = self._memory_refusal
        if self._local is not None:
            reader.allocate = functools.partial(_receive_buffer, owner=submitter_id)

    def refuse(self, conn: Connection, code: str, message: str) -> None:
        """Tell the other side why, then close (in the background)."""
        if conn.authenticated:  # a key holder's connection: each is worth its line
            log.warning("closing connection from %s: %s", conn.address, message)
        else:  # anyone can cause these, as often as they like
            self.quiet.warning(f"connections refused before authentication ({code})",
                               "closing connection from %s: %s", conn.address, message)
        self._unauthenticated.pop(conn, None)
        self.drop(conn)
        conn.channel.write(messages.error(code, message))
        # a submitter may be in the middle of a large message: give it time to finish sending it,
        # so that closing does not reset the connection before it has read why
        closing = conn.channel.close_gracefully(5.0 if conn.authenticated else 1.0)
        if not closing.done():
            self._lingering[conn] = None
            closing.add_done_callback(lambda _: self._lingering.pop(conn, None))

    def drop(self, conn: Connection) -> None:
        """Forget a connection and cancel its tasks: its submitter is gone."""
        self._unauthenticated.pop(conn, None)
        self.invites.forget(conn)
        if self._local is not None:
            self._local.forget(conn)
        self.jobs.forget(conn)
        if conn in self._connections:
            self._connections.discard(conn)
            for task in list(conn.tasks.values()):
                self.scheduler.cancel(task, "cancelled", "the submitter disconnected", notify=False)
            conn.tasks.clear()
            remaining = next((other for other in self._connections if other.submitter_id == conn.submitter_id), None)
            self.scheduler.submitter_disconnected(conn, remaining is None)
            if remaining is None:
                self.held.disconnected(conn.submitter_id)
            else:  # its actors' ACTOR_END goes there now (the connection that went was handed over, say)
                self.scheduler.submitter_connected(remaining)

    # ---- messages: one handler a kind ------------------------------------------------------------

    def _handlers(self) -> tuple[dict[str, Handler], dict[str, Handler]]:
        """The kinds of message a connection may send before it authenticated (AUTH, and an invite's PAKE
        steps, which give the cluster key for the right code and nothing else: nothing there is
        unpickled, queued or answered with data) and after (as rpyc's `_request_handlers()`)."""
        pre_auth: dict[str, Handler] = {messages.AUTH: self.authenticate, messages.PAKE: self._invite_step,
                                        messages.PAKE_CONFIRM: self._invite_step}
        post_auth: dict[str, Handler] = {
            messages.SUBMIT: self._admit, messages.ACTOR: self._admit, messages.CANCEL: self._cancel,
            messages.WITHDRAW: self._withdraw, messages.PING: self._ping, messages.STATUS: self._status,
            messages.BYE: self._bye, messages.CALL: self.scheduler.call_actor, messages.CLOSE: self._close_actor,
            messages.DIRECT: self._direct, messages.LEASE: self._lease, messages.LOCAL: self._local_link,
            messages.FETCH: self._fetch, messages.RELEASE: self._release, messages.INVITE: self._invite,
            messages.PEERS: self._peers, **dict.fromkeys(messages.JOB_REQUESTS, self._job_request)}
        return pre_auth, post_auth

    def handle_unauthenticated(self, conn: Connection, msg: messages.Message) -> None:
        """Route one message of a connection that has not authenticated yet: an AUTH or an invite's step,
        else it is refused."""
        self._unauthenticated.pop(conn, None)  # an invite's next step puts it back, last (oldest first)
        handler = self._pre_auth.get(msg["t"])
        if handler is None:
            return self.refuse(conn, "auth", "authentication failed: wrong cluster key, or no AUTH first")
        handler(conn, msg, [])

    def handle(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Route one message of an authenticated submitter."""
        kind = msg["t"]
        if framing.REFUSED in msg:  # its buffers were dropped as they came: no memory for them
            refusal = f"not received: {msg[framing.REFUSED]}"
            if kind in (messages.SUBMIT, messages.ACTOR):
                return self._reject(conn, msg.get("id"), "too-large", refusal)
            return conn.channel.write(messages.error("too-large", refusal, msg.get("id")))
        handler = self._post_auth.get(kind)
        if handler is None:
            return self.refuse(conn, "protocol", f"unexpected message type {kind!r} from a submitter")
        problem = messages.check(msg)  # its kind's validator, before its handler (h11's events)
        if problem is None:
            handler(conn, msg, buffers)
        elif kind in (messages.SUBMIT, messages.ACTOR):
            self._reject(conn, msg.get("id"), "bad-request", problem)
        else:
            conn.channel.write(messages.error("bad-request", problem, None if request_id(msg) == -1 else msg["id"]))

    def _cancel(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Cancel a task, one on a lease of this submitter (ADR 0013), one waiting for a probe, or an actor call."""
        task = conn.tasks.get(request_id(msg))
        if msg.get("lease") is not None:
            self.scheduler.cancel_leased(msg["lease"], conn.submitter_id, request_id(msg))
        elif task is not None:
            self.scheduler.cancel(task, "cancelled", "cancelled by the submitter")
        elif request_id(msg) in conn.probing:
            conn.probing.discard(request_id(msg))
        elif request_id(msg) in conn.calls:
            self.scheduler.cancel_call(conn, msg["id"])

    def _withdraw(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Give a queued task back to its submitter, to place elsewhere (ADR 0011); nothing once it started."""
        task = conn.tasks.get(request_id(msg))
        if task is not None and self.scheduler.withdraw(task):
            del conn.tasks[task.task_id]
            conn.channel.write(self.scheduler.report(
                messages.reject(task.task_id, "withdrawn", "taken back by its submitter before it started")))

    def _ping(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        conn.channel.write(self.scheduler.report({"t": messages.PONG, "id": msg.get("id")}))

    def _status(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        conn.channel.write({**self.status(), "id": msg.get("id")})

    def _bye(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        conn.channel.close()
        self.drop(conn)

    def _close_actor(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        self.scheduler.close_actor(conn, msg)

    def _local_link(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """The submitter asks for a local link: the answer has none when there is none."""
        offer = self._local.offer(conn) if self._local is not None and conn.link is None else {"t": messages.LOCAL}
        conn.channel.write({**offer, "id": msg.get("id")})

    def _fetch(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        conn.channel.write(*held.answer_fetch(self.held, msg, conn.submitter_id))

    def _release(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        self.held.release(msg["ref"], conn.submitter_id)

    def _job_request(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        self.jobs.handle(conn, msg, buffers, self._draining)

    def _invite(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        conn.channel.write(self.invites.answer(msg))

    def _peers(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Gossip (gossip.py): what the other peer knows, for what this one knows."""
        self.gossip.heard_from(conn.address.rpartition(":")[0].strip("[]"), msg)
        conn.channel.write(messages.peers(msg.get("id"), self.gossip.listing()))

    def _admit(self, conn: Connection, msg: messages.Message, buffers: list[Any], probed: bool = False) -> None:
        """Queue a SUBMIT or an ACTOR (both checked by their validators), or REJECT it, as admission decides
        (admission.py). A task that asks for software the job interpreter lacked waits for a new probe,
        when one is due (`_admit_after_probe`); `probed` says that it did."""
        decide = functools.partial(admission.admit, conn, msg, buffers, self.scheduler.state, advert=self.advert,
                                   draining=self._draining, max_queue=self.config.max_queue, held=self.held)
        decision = decide(probe=not probed)
        if isinstance(decision, admission.Probe):
            if self.reprobe.due(decision.missing):
                conn.probing.add(msg["id"])
                self.scheduler.spawn(self._admit_after_probe(conn, msg, buffers, decision.missing))
                return
            decision = decide(probe=False)
        if isinstance(decision, admission.Reject):
            return self._reject(conn, decision.task_id, decision.code, decision.message)
        assert isinstance(decision, admission.Admit)
        task = decision.task
        if isinstance(task, TaskHolder) and msg.get("refs"):
            conn.channel.write(self.scheduler.report({"t": messages.ACCEPT, "id": task.task_id}))
            self.scheduler.spawn(self._enqueue_with_refs(conn, task, msg["refs"]))
            return
        accepted = admission.acceptance(task, self.scheduler.enqueue(task))
        if accepted is not None:
            conn.channel.write(self.scheduler.report(accepted))

    async def _admit_after_probe(self, conn: Connection, msg: messages.Message, buffers: list[Any],
                                 missing: frozenset[str]) -> None:
        """Probe the job interpreter again for what the task asks (a pip install since the last probe),
        advertise what changed, then admit the task or refuse it with what is still missing."""
        found = await self.reprobe.look(self.config.resources, missing)
        if found is not None:
            self._advertise(found)
        if msg["id"] in conn.probing and conn in self._connections:  # else cancelled meanwhile: it never runs
            self._admit(conn, msg, buffers, probed=True)
        conn.probing.discard(msg["id"])

    def _advertise(self, resources: Resources) -> None:
        """Take resources that a new probe found: the advert that new connections get and STATUS shows,
        the mDNS record, and the submitters connected now (an unasked PONG with the advert)."""
        advert = Advert.from_resources(resources, peer_id=self.peer_id, name=self.name, cluster=self.advert.cluster,
                                       slots=len(self.slots))
        self.config.resources, old, self.advert = resources, self.advert, advert
        if advert == old:  # the same TXT record (maybe other distributions, which only this peer knows)
            return
        log.info("the job interpreter changed: advertising frameworks %s, capabilities %s",
                 dict(advert.frameworks), sorted(advert.capabilities))
        if self._advertiser is not None:
            assert self._loop is not None
            self._loop.run_in_executor(None, self._advertiser.update, advert)
        for conn in list(self._connections):
            conn.channel.write(self.scheduler.report({"t": messages.PONG, "id": None, "advert": advert.to_txt()}))

    async def _enqueue_with_refs(self, conn: Connection, task: TaskHolder, refs: list[dict[str, Any]]) -> None:
        """Queue a task once the held results among its arguments are here (this peer's, or fetched
        from their peers); a lost one fails it with "held-lost"."""
        def fetch(ref: dict[str, Any]) -> tuple[bytes, list[Any]]:
            return held.fetch(self.config.key, f"peer-{self.peer_id}", ref, conn.submitter_id,
                              functools.partial(self._receiving, submitter_id=conn.submitter_id))

        try:
            resolved = await held.gather(self.held, refs, conn.submitter_id, self.peer_id, fetch)
        except ConnectionError as exc:
            self.scheduler.cancel(task, "held-lost", f"a held result among its arguments is lost: {exc}")
            return
        if not task.answered:  # not cancelled meanwhile
            task.refs = resolved
            self.scheduler.enqueue(task)

    @staticmethod
    def _hand_over_problem(conn: Connection, msg: messages.Message) -> str | None:
        """Why a DIRECT or LEASE may not have this connection: it needs nothing in flight on it."""
        if conn.tasks or conn.calls or conn.link is not None:
            return f"a {messages.printable(msg['t'], 20).upper()} needs a connection with nothing in flight on it"
        return None

    def _direct(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Hand the connection to the worker of the actor it names, which answers its calls from then
        on without this peer in the way (ADR 0012); or answer why not (the connection stays ours)."""
        request_id = msg["id"]
        problem = self._hand_over_problem(conn, msg)
        if problem is not None:
            return conn.channel.write(messages.error("bad-request", problem, request_id))
        actor = self.scheduler.actors.live.get(msg["actor"])
        if actor is None:
            return conn.channel.write(self.scheduler.actors.gone(msg["actor"], request_id))
        if not actor.worker.direct:
            return conn.channel.write(messages.error(
                "no-direct", "the actor's worker cannot take a connection (no local link, or no cryptography "
                             "in its interpreter): call through the peer", request_id))
        conn.channel.pause_reading()
        conn.channel.write({"t": messages.DIRECT, "id": request_id})
        self.scheduler.spawn(self._hand_over(conn, actor.worker, {"t": messages.DIRECT},
                                             lambda: actor.actor_id in self.scheduler.actors.live))

    def _lease(self, conn: Connection, msg: messages.Message, buffers: list[Any]) -> None:
        """Lend a warm worker to this connection: the worker runs the tasks sent on it and answers them
        there, until the lease ends (ADR 0013); or answer why not (the connection stays ours)."""
        request_id, beat = msg["id"], msg["beat"]
        problem = self._hand_over_problem(conn, msg)
        if problem is None:
            try:
                req = Requirements.from_wire(msg.get("req") or {})
            except ValueError as exc:
                problem = str(exc)
        if problem is not None:
            return conn.channel.write(messages.error("bad-request", problem, request_id))
        refusal = "the peer is shutting down" if self._draining else "; ".join(match(req, self.advert))
        lease = refusal or self.scheduler.lease(conn.address, conn.submitter_id, req)
        if isinstance(lease, str):
            return conn.channel.write(messages.error("no-lease", lease, request_id))
        assert lease.slot is not None
        worker = lease.slot.worker
        assert worker is not None
        conn.channel.pause_reading()
        conn.channel.write({"t": messages.LEASE, "id": request_id, "lease": lease.lease_id})
        self.scheduler.spawn(self._hand_over(conn, worker, {**self.scheduler.lease_message(lease), "beat": beat},
                                             lambda: lease.slot is not None and lease.slot.task is lease,
                                             lambda: self.scheduler.lease_failed(lease)))

    async def _hand_over(self, conn: Connection, worker: Worker, msg: messages.Message, still: Callable[[], bool],
                         failed: Callable[[], None] = lambda: None) -> None:
        """Once the answer is sent, give the socket and its channel to `worker` with `msg`, if `still()`
        holds; `failed()` when it was not given."""
        await conn.channel.drain()
        self.drop(conn)
        try:
            sock, keys, counters = conn.channel.hand_over()
        except ProtocolError as exc:
            log.warning("not handing the connection from %s to worker %s: %s", conn.address, worker.pid, exc)
            conn.channel.close()
            failed()
            return
        with sock:  # the worker has its own copy once it is sent
            if not (still() and worker.hand_over(sock, keys, counters, msg)):
                failed()

    def _reject(self, conn: Connection, task_id: Any, code: str, message: str) -> None:
        self.scheduler.activity.refused(conn.address, code, message)
        conn.channel.write(self.scheduler.report(messages.reject(task_id, code, message)))


def request_id(msg: messages.Message) -> int:
    """The message's "id" when it is an int, else -1 (which names no task or call)."""
    value = msg.get("id")
    return value if isinstance(value, int) and not isinstance(value, bool) else -1


MEMORY_HEADROOM_MB = 512  # the default of GPULAYER_MEMORY_HEADROOM_MB


def memory_headroom() -> int:
    """Bytes of free memory the peer keeps when it receives a message: GPULAYER_MEMORY_HEADROOM_MB."""
    value = os.environ.get("GPULAYER_MEMORY_HEADROOM_MB", str(MEMORY_HEADROOM_MB))
    if not value.isdigit():
        raise ConfigError(f"GPULAYER_MEMORY_HEADROOM_MB must be a whole number of MiB, not {value!r}")
    return int(value) << 20


def check_shm_settings() -> None:
    """A bad GPULAYER_SHM or GPULAYER_SHM_POOL_* setting fails the peer's start, not a big message later."""
    try:
        shm.enabled()
        shm.pool_settings()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


def memory_refusal(total: int, headroom: int) -> str | None:
    """Why a message whose buffers come to at least `total` bytes may not be received now, or None."""
    available = psutil.virtual_memory().available
    if available - total < headroom and shm.POOL.drop_free():  # segments kept for reuse yield first
        available = psutil.virtual_memory().available
    if available - total >= headroom:
        return None
    return (f"its buffers come to at least {total >> 20} MiB, and the peer has {available >> 20} MiB of memory free "
            f"and keeps {headroom >> 20} MiB of it (GPULAYER_MEMORY_HEADROOM_MB)")


def _receive_buffer(size: int, owner: str) -> Any:
    """Where a large frame of submitter `owner` is received: a segment, which goes on to the worker by descriptor."""
    return shm.receive_segment(size, owner) if size >= shm.SHM_MIN else framing.receive_buffer(size)


def listen_socket(host: str, port: int) -> socket.socket:
    """The peer's TCP socket: on `host`, an IPv4 or IPv6 address; on every address, IPv4 and IPv6, for ""."""
    if host:
        return socket.create_server((host, port), family=socket.AF_INET6 if ":" in host else socket.AF_INET,
                                    backlog=1024)
    if socket.has_dualstack_ipv6():
        return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True, backlog=1024)
    return socket.create_server(("", port), backlog=1024)


def _raise_fd_limit() -> None:
    """Allow many connections (half-open ones included) up to the hard limit."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run_peer(config: PeerConfig, ready: Callable[[Peer], None] | None = None) -> None:
    """Run a peer until SIGINT or SIGTERM; a second signal cancels its tasks at once."""
    peer = Peer(config)
    await peer.start()
    if ready is not None:
        ready(peer)
    loop = asyncio.get_running_loop()

    def on_signal() -> None:
        if peer.draining:
            log.warning("second signal: cancelling every task now")
            peer.cancel_all("the peer was stopped")
        else:
            peer.scheduler.spawn(peer.stop())

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    await peer.wait_stopped()
