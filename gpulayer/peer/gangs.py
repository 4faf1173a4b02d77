"""Gangs as jobs (ADR 0020): N rank jobs on N peers, reserved in peer-id order, started together,
watched by rank 0's peer, stopped together.

A gang job is N rank jobs, each recorded (with its folder) on its own peer where it waits, and the
gang's own record on rank 0's peer, which names them. That peer runs a `Watcher` for it: a thread with
one authenticated connection to each rank's peer (its own included) that claims every rank, reserves
their slots one after another in rank order (ranks are in peer-id order, so two gangs never wait for
each other in a cycle), starts every rank with the rendezvous variables once all hold their slots, and
waits for them. The first rank that fails, or whose peer is lost, has every other one stopped, and the
gang's record says which rank, on which peer, and why. A rank's peer binds the rank to the watcher's
connection that claimed it: when that connection goes (the watcher's peer died, or went silent), the
rank is stopped. Nothing of this depends on the submitter, which is gone once the gang is recorded.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from .. import distributed
from ..discovery import Address
from ..errors import GPULayerError
from ..jobs.store import ENDED, FAILED, LOST, RUNNING, STOPPED, SUCCEEDED, JobRow
from ..protocol import handshake, jobs as job_protocol, messages
from ..transport import blocking
from .slots import JobHolder

if TYPE_CHECKING:
    from .jobs import JobConnection, Jobs

log = logging.getLogger("gpulayer.peer")

CLAIM_S = 60.0  # a rank that no gang's watcher claimed this long after it was recorded fails (its submitter went)
PING_S = 1.0  # the watcher pings each rank's peer this often
LOST_AFTER_S = 5.0  # a rank's peer silent this long is lost: the gang fails
STOP_GRACE_S = 5.0  # the other ranks' SIGTERM -> SIGKILL when one failed
STOP_WAIT_S = STOP_GRACE_S + 10.0  # how long the watcher waits for them to end before it closes its connections
CONNECT_S = 5.0
HOSTFILE = "mlx-hostfile.json"  # a rank's MLX ring hostfile, in its job's folder


@dataclass(frozen=True)
class JobSteps:
    """The steps of the peer's jobs that gangs take too (peer/jobs.py passes its own)."""

    info: Callable[..., None]  # (conn, request, **extra): answer with the request's job
    enqueue: Callable[[JobRow], None]  # queue the job for its slots
    end: Callable[[str, str, str, int | None], None]  # (job id, state, reason, exit code): record its end
    append_log: Callable[[str, str], None]  # (job id, line): a line of GPUlayer's in its log


@dataclass
class Bound:
    """A rank waiting on this peer: the watcher's connection that claimed it, and how far it got."""

    timer: asyncio.TimerHandle
    conn: JobConnection | None = None  # the watcher's, once claimed
    reserve: messages.Message | None = None  # the reserve request, until the scheduler gives the slots
    task: JobHolder | None = None  # the slots, once held
    slot_env: dict[str, str] = field(default_factory=dict)
    started: bool = False


class Gangs:
    """This peer's part in gang jobs: the ranks it holds for their watchers, and the watchers it runs."""

    def __init__(self, jobs: Jobs, steps: JobSteps, key: bytes):
        self.jobs = jobs
        self.steps = steps
        self.key = key
        self.ranks: dict[str, Bound] = {}
        self.watchers: dict[str, Watcher] = {}
        self.where: Callable[[str], list[Address]] = lambda peer_id: []  # the peer's (server.py `paths`)

    # ---- a rank's side ------------------------------------------------------------------------

    def recorded(self, row: JobRow) -> None:
        """A gang's record starts its watcher; a rank waits to be claimed by one (for CLAIM_S)."""
        loop = asyncio.get_running_loop()
        if "ranks" in row.spec.gang:
            paths = [self.paths(row, rank) for rank in row.spec.gang["ranks"]]
            watcher = self.watchers[row.id] = Watcher(self, row, loop, paths)
            threading.Thread(target=watcher.run, name=f"gpulayer-gang-{row.id}", daemon=True).start()
            return
        self.ranks[row.id] = Bound(loop.call_later(CLAIM_S, self._unclaimed, row.id))

    def paths(self, row: JobRow, rank: dict[str, Any]) -> list[Address]:
        """Where the watcher of gang `row` dials a rank's peer, best first: where this peer knows that peer id to
        be (`where`), the addresses the rank's peer gave of itself, then those the submitter reached it at, but
        their loopback ones only when the submitter is on this host (others are the submitter's own host's).
        Each is a hint: the handshake there must prove the rank's peer id (when the record names it)."""
        local = distributed.loopback(row.spec.submitter.rpartition("@")[2])
        known = self.where(rank["peer_id"]) if "peer_id" in rank else []
        told = [(host, port) for host, port in rank.get("own", [])]
        reached = [(host, port) for host, port in rank["at"] if local or not distributed.loopback(host)]
        return list(dict.fromkeys([*known, *told, *reached]))

    def _unclaimed(self, job_id: str) -> None:
        bound = self.ranks.get(job_id)
        if bound is not None and bound.conn is None:
            del self.ranks[job_id]
            self.steps.end(job_id, FAILED, f"no gang's watcher claimed this rank within {CLAIM_S:g} s (its "
                                           "submitter went before the gang was recorded)", None)

    def request(self, conn: JobConnection, msg: messages.Message, row: JobRow) -> None:
        """A JOB_GANG of a watcher: claim the rank (bind it to this connection), reserve its slots
        (answered with two free ports once it holds them), or start it with the rendezvous variables."""
        bound, op = self.ranks.get(row.id), msg["op"]
        owner = bound is not None and (bound.conn is conn or (op == "claim" and bound.conn is None))
        ready = {"claim": True, "reserve": bound is not None and bound.reserve is None and bound.task is None
                 and not bound.started, "start": bound is not None and bound.task is not None}[op]
        if bound is None or not owner or not ready:
            return conn.channel.write(messages.error(
                "bad-request", f"job {row.id} is not a rank waiting here for this gang's {op}", msg["id"]))
        if op == "claim":
            bound.timer.cancel()
            bound.conn = conn
            self.steps.info(conn, msg)
        elif op == "reserve":
            bound.reserve = msg
            self.steps.enqueue(row)
        else:
            assert bound.task is not None
            hostfile = self.jobs.store.folder(row.id) / HOSTFILE
            hostfile.write_text(msg["env"].get("MLX_HOSTFILE", "[]"))
            hostfile.chmod(0o600)
            task, bound.task, bound.started = bound.task, None, True
            self.jobs.run(row.id, task, {**bound.slot_env, **msg["env"], "MLX_HOSTFILE": str(hostfile)})
            self.steps.info(conn, msg)

    def holds(self, job_id: str, task: JobHolder, slot_env: dict[str, str]) -> bool:
        """The scheduler gave a rank its slots: it holds them until its watcher starts it (True), and the
        watcher hears it with two ports free on this host (torch's store, MLX's ring)."""
        bound = self.ranks.get(job_id)
        if bound is None or bound.reserve is None or bound.conn is None:
            return False
        msg, bound.reserve, bound.task, bound.slot_env = bound.reserve, None, task, slot_env
        self.steps.info(bound.conn, msg, ports=[distributed.free_port(), distributed.free_port()])
        return True

    def stop(self, row: JobRow, grace: float) -> bool:
        """A stop of a gang stops all its ranks (its watcher does); of a rank that waits, or holds its slots
        and waits to start, ends it stopped. False when the usual stop applies (queued or running)."""
        watcher = self.watchers.get(row.id)
        if watcher is not None:
            watcher.events.put(("stop", grace))
            return True
        bound = self.ranks.get(row.id)
        if bound is None or bound.started or bound.reserve is not None:
            return "ranks" in row.spec.gang  # a gang that ended has nothing to stop
        del self.ranks[row.id]
        bound.timer.cancel()
        if bound.task is not None:
            self.jobs.scheduler.job_ended(bound.task, STOPPED)
        self.steps.end(row.id, STOPPED, "stopped before its gang started", None)
        return True

    def forget(self, conn: JobConnection) -> None:
        """A watcher's connection went: the ranks it claimed are stopped (their gang's watcher is gone)."""
        for job_id in [job_id for job_id, bound in self.ranks.items() if bound.conn is conn]:
            row = self.jobs.store.get(job_id)
            if row is not None and row.state not in ENDED:
                self.steps.append_log(job_id, "gpulayer: the gang's watcher (on rank 0's peer) went away: "
                                              "this rank is stopped\n")
                self.jobs.stop(row, STOP_GRACE_S)
            self.ranks.pop(job_id, None)

    def shutdown(self) -> None:
        """The peer stops: each gang it watches is recorded lost; the ranks' peers stop them as the
        connections go."""
        for job_id, watcher in list(self.watchers.items()):
            watcher.close()
            self.steps.end(job_id, LOST, "its watcher's peer (rank 0's) was stopped while the gang ran", None)
        self.watchers.clear()

    # ---- the watcher's side --------------------------------------------------------------------

    def watched(self, job_id: str, started: bool, outcome: tuple[str, str, int | None] | None) -> None:
        """From a watcher (on the event loop): every rank started, or the gang ended with `outcome`."""
        if job_id not in self.watchers:
            return
        if started:
            self.jobs.store.update(job_id, state=RUNNING, started=time.time())
        if outcome is not None:
            del self.watchers[job_id]
            state, reason, code = outcome
            self.steps.append_log(job_id, f"gpulayer: the gang {state}{': ' + reason if reason else ''}\n")
            self.steps.end(job_id, state, reason, code)


@dataclass
class Member:
    """One rank as its gang's watcher sees it."""

    index: int
    job: str
    peer: str
    peer_id: str | None  # the id its peer's handshake must prove (None: a record of an older submitter)
    at: list[Address]  # where to dial its peer, best first (`Gangs.paths`)
    conn: blocking.BlockingConnection | None = None
    reached: str = ""  # the host its peer was reached at
    pinged: float = 0.0
    ports: tuple[int, int] = (0, 0)
    started: bool = False
    stopping: bool = False
    ended: dict[str, Any] | None = None  # its row once it ended


class Watcher:
    """One gang's watcher, on a thread of its own in rank 0's peer: one connection to each rank's peer,
    one reader thread each, and the steps decided here, one event at a time."""

    def __init__(self, gangs: Gangs, row: JobRow, loop: asyncio.AbstractEventLoop, paths: list[list[Address]]):
        self.gangs, self.row, self.loop = gangs, row, loop
        self.members = [Member(i, r["job"], r["peer"], r.get("peer_id"), at)
                        for i, (r, at) in enumerate(zip(row.spec.gang["ranks"], paths))]
        self.events: queue.Queue[tuple[Any, ...]] = queue.Queue()
        self.pending: dict[tuple[int, int], str] = {}  # (rank, request id) -> what was asked
        self.ids = itertools.count(1)
        self.failures: list[tuple[int, str, int | None, bool]] = []  # (rank, cause, exit code, died), as they came
        self.stopped = False  # by a stop of the gang
        self.deadline: float | None = None  # once ending: when the watcher stops waiting for the ranks

    def close(self) -> None:
        for member in self.members:
            if member.conn is not None:
                member.conn.close()

    def run(self) -> None:
        outcome: tuple[str, str, int | None]
        try:
            outcome = self._watch()
        except Exception as exc:  # recorded as the gang's failure, never lost
            log.exception("gang %s: its watcher failed", self.row.id)
            outcome = FAILED, f"its watcher failed: {exc}", None
        finally:
            self.close()
        self._on_loop(self.gangs.watched, self.row.id, False, outcome)

    def _on_loop(self, step: Callable[..., None], *args: Any) -> None:
        """Have the peer's event loop take a step (it alone writes the store and the logs)."""
        try:
            self.loop.call_soon_threadsafe(step, *args)
        except RuntimeError:  # the loop ended: the peer stopped, and recorded the gang lost
            pass

    def _watch(self) -> tuple[str, str, int | None]:
        for member in self.members:
            self._connect(member)
        for member in self.members:
            self._ask(member, "claim")
        self._ask(self.members[0], "reserve")
        while not all(m.ended is not None for m in self.members):
            if self.deadline is not None and time.monotonic() > self.deadline:
                break
            try:
                event = self.events.get(timeout=PING_S)
            except queue.Empty:
                event = None
            if event is not None:
                self._on(event)
            self._ping()
        return self._outcome()

    def _connect(self, member: Member) -> None:
        errors: list[str] = []
        for host, port in member.at:
            try:
                conn = blocking.dial((host, port), CONNECT_S)
            except OSError as exc:
                errors.append(f"{host}:{port}: {exc.strerror or exc}")
                continue
            try:
                hello = handshake.client_handshake(conn, self.gangs.key, f"gang-{self.row.id}")
            except (OSError, GPULayerError) as exc:
                conn.close()
                errors.append(f"{host}:{port}: {exc}")
                continue
            if member.peer_id is not None and hello["peer"] != member.peer_id:
                conn.close()
                errors.append(f"{host}:{port}: peer {messages.printable(hello['peer'], 64)}, not {member.peer_id}")
                continue
            member.conn, member.pinged, member.reached = conn, time.monotonic(), host
            threading.Thread(target=self._read, args=(member, conn), daemon=True,
                             name=f"gpulayer-gang-{self.row.id}-{member.index}").start()
            return
        self._lost(member, f"unreachable ({'; '.join(errors) or 'no address'})")

    def _read(self, member: Member, conn: blocking.BlockingConnection) -> None:
        """Put each message of a rank's peer on the events, and its loss."""
        while True:
            try:
                msg, _ = conn.recv()
            except (OSError, ConnectionError, GPULayerError) as exc:
                self.events.put(("lost", member, str(exc)))
                return
            self.events.put(("msg", member, msg))

    def _send(self, member: Member, msg: messages.Message) -> None:
        if member.conn is None:
            return
        try:
            member.conn.send(msg)
        except OSError as exc:
            self._lost(member, str(exc))

    def _ask(self, member: Member, what: str, **fields: Any) -> None:
        """Send a request about the member's job: a JOB_GANG step ("claim", "reserve", "start") or
        a JOB_WAIT ("wait") or JOB_STOP ("stop")."""
        request_id = next(self.ids)
        self.pending[(member.index, request_id)] = what
        kind = {"wait": messages.JOB_WAIT, "stop": messages.JOB_STOP}.get(what, messages.JOB_GANG)
        extra = {"op": what} if kind == messages.JOB_GANG else {}
        self._send(member, job_protocol.request(kind, request_id, member.job, **extra, **fields))

    def _ping(self) -> None:
        now = time.monotonic()
        for member in self.members:
            if member.conn is None or member.ended is not None:
                continue
            if now - member.conn.last_received > LOST_AFTER_S:
                self._lost(member, f"silent for {LOST_AFTER_S:g} s")
            elif now - member.pinged >= PING_S:
                member.pinged = now
                self._send(member, messages.ping())

    # ---- events -------------------------------------------------------------------------------

    def _on(self, event: tuple[Any, ...]) -> None:
        kind, *rest = event
        if kind == "stop":
            self.stopped = True
            self._end_all(rest[0])
        elif kind == "lost":
            member, reason = rest
            self._lost(member, reason)
        else:
            member, msg = rest
            what = self.pending.pop((member.index, msg.get("id")), None) if msg["t"] != messages.PONG else None
            if what is not None:
                self._answered(member, what, msg)

    def _answered(self, member: Member, what: str, msg: messages.Message) -> None:
        if msg["t"] == messages.ERROR:
            member.ended = member.ended or {"state": FAILED}
            return self._fail(member, f"its peer refused the {what}: {messages.printable(msg.get('message'))}",
                              None, False)
        job = msg["job"] if isinstance(msg.get("job"), dict) else {}
        if job.get("state") in ENDED:
            return self._ended(member, job)
        if what == "reserve":
            ports = msg["ports"]
            member.ports = (int(ports[0]), int(ports[1]))
            following = self.members[member.index + 1:]
            if self.deadline is not None:
                return
            self._note(f"rank {member.index} holds its slots on peer {member.peer}"
                       + (f"; rank {following[0].index} waits for a slot of peer {following[0].peer}" if following
                          else "; every rank holds its slots: the gang starts"))
            if following:
                return self._ask(following[0], "reserve")
            addresses = distributed.rank_addresses(  # as this peer reached them; a loopback one's host has others
                [list(dict.fromkeys([m.reached, *(host for host, _ in m.at)])) for m in self.members])
            for other in self.members:  # every rank holds its slots: start them all
                variables = distributed.rendezvous(other.index, addresses, [m.ports for m in self.members])
                self._ask(other, "start", env=variables)
                self._ask(other, "wait", timeout=None)
                other.started = True
            self._on_loop(self.gangs.watched, self.row.id, True, None)

    def _ended(self, member: Member, job: dict[str, Any]) -> None:
        if member.ended is not None:
            return
        member.ended = job
        if job["state"] == SUCCEEDED or job["state"] == STOPPED and member.stopping:
            return
        code = job.get("exit_code")
        reason = job.get("reason") or job["state"]
        died = isinstance(code, int) and code < 0 or job["state"] == LOST
        self._fail(member, f"{job['state']} ({reason})", code, died)

    def _lost(self, member: Member, reason: str) -> None:
        if member.conn is not None:
            member.conn.close()
            member.conn = None
        if member.ended is None:
            member.ended = {"state": LOST}
            self._fail(member, f"its peer was lost: {reason}", None, True)

    def _fail(self, member: Member, cause: str, code: int | None, died: bool) -> None:
        self._note(f"rank {member.index} on peer {member.peer}: {cause}"
                   + ("" if self.deadline is not None else "; the other ranks are stopped"))
        self.failures.append((member.index, cause, code, died))
        self._end_all(STOP_GRACE_S)

    def _note(self, line: str) -> None:
        """A line of the watcher's in the gang's own log (`gpulayer logs` shows it after `[gang]`)."""
        log.info("gang %s: %s", self.row.id, line)
        self._on_loop(self.gangs.steps.append_log, self.row.id, f"gpulayer: {line}\n")

    def _end_all(self, grace: float) -> None:
        """Stop every rank that has not ended (SIGTERM, SIGKILL after `grace`), once."""
        if self.deadline is None:
            self.deadline = time.monotonic() + grace + STOP_WAIT_S
        for member in self.members:
            if member.ended is None and not member.stopping and member.conn is not None:
                member.stopping = True
                self._ask(member, "stop", grace=grace)

    def _outcome(self) -> tuple[str, str, int | None]:
        """The gang's state, reason and exit code: stopped, or failed naming the first rank that died (by a
        signal, or its peer lost) before the others failed for it, else the first that failed."""
        if self.stopped and not self.failures:
            return STOPPED, "stopped", None
        if not self.failures:
            return SUCCEEDED, "", 0
        index, cause, code, _ = next((f for f in self.failures if f[3]), self.failures[0])
        return FAILED, f"rank {index} on peer {self.members[index].peer}: {cause}", code
