"""Leases (ADR 0013): a peer lends one of its warm workers to this submitter, which sends tasks to it
on a connection of their own; the worker runs them and answers there, without the peer in the way.

A submitter asks a peer for a lease, in the background, when it places a task there that a lease may
take; until the lease comes, and whenever the lease cannot take a task, the task goes through the
peer as always. One lease per peer, asked for with the first task's requirements: a task of another
accelerator, or that declares more GPU memory, goes through the peer.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import TYPE_CHECKING, Any, ClassVar

from ..errors import GPULayerError, PeerLost, WorkerDied
from ..protocol import framing, messages
from ..transport import shm
from .connection import ConnectionTask, Listener, PeerConnection, Route
from .tasks import SubmittedTask

if TYPE_CHECKING:
    from ..matching import Requirements
    from .engine import Client

log = logging.getLogger("gpulayer.client")

SHORT_TASK_S = 0.002  # a peer's typical run time under which a lease takes any number of tasks at once
ASK_AGAIN_S = 0.25  # after a peer had no worker to lend, the least time before asking it again
OUTBOX_MAX = 1 << 18  # bytes of SUBMITs that a lease keeps back for one write at most


def enabled() -> bool:
    """Leases are on unless GPULAYER_LEASES=0 (every task then goes through its peer)."""
    return os.environ.get("GPULAYER_LEASES", "1") != "0"


class Leases(Listener):
    """This submitter's leases: at most one per peer (in its pool, `by_peer`), and where their connections
    report. `on`: whether to ask for them (None: GPULAYER_LEASES)."""

    def __init__(self, client: Client, on: bool | None = None):
        self.client = client
        self.on = enabled() if on is None else on
        self.by_peer: dict[str, LeaseConnection] = client.pool.leases
        self._asked: dict[str, float] = {}  # peer id -> when a lease was last asked for there
        self._lock = threading.Lock()

    def connection_for(self, task: SubmittedTask, main: PeerConnection) -> PeerConnection | None:
        """The lease to send `task` on, to the peer of `main`; None sends it through the peer (and asks
        that peer for a lease, in the background, if there is none and the task could take one)."""
        if not self.on or not _leasable(task):
            return None
        lease = self.by_peer.get(main.peer_id)
        if lease is None:
            self._ask(main, task)
            return None
        if lease.closed or not _lease_slot_takes(task.req, lease.requirements):
            return None
        # short tasks queue up on the lease (the worker gets through them faster than the submitter sends
        # them); a longer one goes through the peer while the lease is busy, to another slot, if the peer
        # has one free: else it would wait in the peer's queue behind the lease (and end it)
        if lease.pending and self.client.placement.contention.typical(main.peer_id) >= SHORT_TASK_S \
                and _free_besides_lease(main):
            return None
        return lease

    def _ask(self, main: PeerConnection, task: SubmittedTask) -> None:
        now = time.monotonic()
        with self._lock:
            if now - self._asked.get(main.peer_id, -ASK_AGAIN_S) < ASK_AGAIN_S:
                return
            self._asked[main.peer_id] = now
        self.client.run_soon(self._open, main, task.req)

    def _open(self, main: PeerConnection, req: Requirements) -> None:
        try:
            lease = LeaseConnection(self, main.addresses, req)
        except (OSError, GPULayerError) as exc:  # no free worker, an older peer, gone: through the peer
            log.debug("no lease from peer %s: %s", main.name, exc)
            return
        if lease.peer_id != main.peer_id or self.client.closed:
            lease.fail("not needed")
            return
        with self._lock:
            old = self.by_peer.get(lease.peer_id)
            if old is None or old.closed:
                self.by_peer[lease.peer_id] = lease
                return
        lease.fail("a lease of this peer is open already")

    def cancel_running(self, lease: LeaseConnection, task_id: int) -> None:
        """Ask the lease's peer to stop the task if it runs now (only the peer may kill the worker)."""
        main = self.client.pool.pooled(lease.peer_id)
        if main is not None:
            try:
                main.send({**messages.cancel(task_id), "lease": lease.lease_id})
            except OSError:
                pass

    def in_flight(self, peer_id: str) -> int:
        lease = self.by_peer.get(peer_id)
        return len(lease.pending) if lease is not None else 0

    def all(self) -> list[LeaseConnection]:
        return list(self.by_peer.values())

    def on_outcome(self, conn: PeerConnection, task: Any, msg: dict[str, Any], buffers: list[Any]) -> None:
        client = self.client
        client.placement.contention.heard(conn.peer_id, msg)  # its "ran"
        client.settle(conn, task, msg, buffers)

    def on_lost(self, conn: PeerConnection, tasks: list[Any], reason: str) -> None:
        """A lease's connection closed with `tasks` unanswered. Those that its worker cannot have started
        (`maybe_started`) are placed again. The others may have run, or be running still (the worker
        answers each task as it ends, but the answer may be lost on the way, or the worker died): their
        fate is unknown, so each is retried only under `retries=`, as a task whose worker died, and
        otherwise fails saying so (exactly once)."""
        assert isinstance(conn, LeaseConnection)
        with self._lock:
            if self.by_peer.get(conn.peer_id) is conn:
                del self.by_peer[conn.peer_id]
        where = f"peer {conn.name} ({conn.address})"
        cause = PeerLost if conn.silent else WorkerDied
        for task in sorted(tasks, key=lambda t: t.task_id):
            if conn.maybe_started(task):
                self.client.retry_or_fail(task, cause(
                    f"the lease of {where} was lost after the task was sent to its worker, which may have run it "
                    f"(its fate is unknown: it runs again only under retries=): {reason}"))
            else:
                self.client.place_again_soon(task, PeerLost(f"the lease of {where} ended before the task started: "
                                                            f"{reason}"))


class LeaseConnection(PeerConnection):
    """A connection that its peer handed to a warm worker lent to this submitter (ADR 0013). Its worker
    refuses a task id not above the last, so ids are given in the order the SUBMITs are written; while
    the worker is busy, further SUBMITs are kept back and written together when the next answer comes."""

    def __init__(self, leases: Leases, addresses: list[tuple[str, int]], req: Requirements):
        client = leases.client
        self.leases = leases
        self.requirements = req  # what it was asked for with (`_lease_slot_takes`)
        self.lease_ended = ""  # why, once the leased worker said LEASE_END
        self._outbox_lock = threading.Lock()  # guards the outbox and _at_worker
        self._outbox: list[Any] = []  # SUBMITs kept back while the worker is busy
        self._outbox_tasks = 0
        self._outbox_bytes = 0
        self._at_worker = 0  # SUBMITs written and not answered yet
        self._newest = 0  # the id of the newest task (in the outbox, or written)
        self.sent_up_to = 0  # the id of the newest task written to the worker (`maybe_started`)
        super().__init__(leases, addresses, client.key, client.submitter_id,
                         messages.lease(0, req.to_wire(), client.heartbeat))
        self.lease_id = messages.printable(self.handed_over.get("lease"), 64)

    def submit(self, task: ConnectionTask) -> None:
        """Write the SUBMIT at once when the worker has nothing to do, else keep it back: it is written
        with the others that come meanwhile when the next answer arrives (`_answered`). The worker
        could not start them sooner, and a burst of submits costs a few writes, not one each."""
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
        self._at_worker += self._outbox_tasks + (1 if parts else 0)
        self._outbox_tasks = self._outbox_bytes = 0
        self._send_lock.acquire()
        return batch

    def maybe_started(self, task: ConnectionTask) -> bool:
        """Whether the worker may have started a task of this lease that got no answer: not after
        LEASE_END (the worker starts nothing after it), nor when the task was still kept back here. Asked
        once the connection closed: no write can begin any more."""
        return not self.lease_ended and task.task_id <= self.sent_up_to

    def cancel(self, task: ConnectionTask) -> bool:
        """Forget the task, tell the worker (it drops a task that has not started), and ask the peer to
        stop it if it runs."""
        known = super().cancel(task)
        if known:
            self.leases.cancel_running(self, task.task_id)
        return known

    def _answered(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """A RESULT or ERROR of the worker: once no other waits to be read, what was kept back goes (not
        when the worker stopped the task and ends: what it was not sent is placed again); then routed as on
        any connection."""
        if msg.get("id") is not None:
            with self._outbox_lock:
                self._at_worker = max(0, self._at_worker - 1)
                ending = msg.get("ends") is True  # the worker stopped the task (a timeout, a cancel) and ends
                batch = self._take_outbox() if self._outbox and not ending \
                    and not (self._at_worker and self._wire.reader.messages) else None
            if batch is not None:
                try:
                    self._wire.send_encoded(batch)
                finally:
                    self._send_lock.release()
        PeerConnection.ROUTES[msg["t"]](self, msg, buffers)

    def _lease_end(self, msg: dict[str, Any], buffers: list[Any]) -> None:
        """The worker starts no task any more: the lease is over."""
        self.lease_ended = messages.printable(msg.get("reason"), 500) or "?"
        self.fail(f"the lease ended: {self.lease_ended}")

    ROUTES: ClassVar[dict[str, Route]] = {**PeerConnection.ROUTES, messages.RESULT: _answered, messages.ERROR: _answered,
                                          messages.LEASE_END: _lease_end}


def _free_besides_lease(main: PeerConnection) -> bool:
    """Whether the lease's peer has a free slot besides the lease's, as far as its last report and our
    tasks there say (the lease's slot counts as busy, whether that report knew of it or not)."""
    return max(main.estimated_load, len(main.pending) + 1) < main.advert.slots


def _lease_slot_takes(req: Requirements, lease: Requirements) -> bool:
    """Whether a task of `req`, placed on the lease's peer (which matched it), may run on the lease's
    slot: the same accelerator (the slot's device variables follow it) and no more memory than the
    lease reserved there."""
    return req.accelerator == lease.accelerator and (req.gpu_memory_gb or 0) <= (lease.gpu_memory_gb or 0)


def _leasable(task: SubmittedTask) -> bool:
    """Whether a lease may run the task: a plain task of one device with small buffers (big ones go by
    shared memory through the peer) whose SUBMIT the leased worker would not refuse (`lease_refusal`)."""
    return type(task) is SubmittedTask and task.req.devices == 1 \
        and sum(memoryview(b).nbytes for b in task.buffers or ()) < shm.SHM_MIN \
        and messages.lease_refusal({"keep": task.keep, "refs": task.held_args(), "env": task.env}) is None
