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
from typing import TYPE_CHECKING, Any

from ..errors import GPULayerError, PeerLost, WorkerDied
from ..protocol import messages
from ..resources.model import Advert
from ..transport import shm
from .connection import PeerConnection
from .tasks import SubmittedTask

if TYPE_CHECKING:
    from ..matching import Requirements
    from .engine import Client

log = logging.getLogger("gpulayer.client")

SHORT_TASK_S = 0.002  # a peer's typical run time under which a lease takes any number of tasks at once
ASK_AGAIN_S = 0.25  # after a peer had no worker to lend, the least time before asking it again


def enabled() -> bool:
    """Leases are on unless GPULAYER_LEASES=0 (every task then goes through its peer)."""
    return os.environ.get("GPULAYER_LEASES", "1") != "0"


class Leases:
    """This submitter's leases: at most one per peer. `on`: whether to ask for them (None: GPULAYER_LEASES)."""

    def __init__(self, client: Client, on: bool | None = None):
        self.client = client
        self.on = enabled() if on is None else on
        self.by_peer: dict[str, PeerConnection] = {}
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
            lease = PeerConnection(LeaseListener(self), main.addresses, self.client.key, self.client.client_id,
                                   messages.lease(0, req.to_wire(), self.client.heartbeat))
        except (OSError, GPULayerError) as exc:  # no free worker, an older peer, gone: through the peer
            log.debug("no lease from peer %s: %s", main.name, exc)
            return
        lease.requirements = req
        lease.on_cancel = lambda task_id: self.cancel_running(lease, task_id)
        if lease.peer_id != main.peer_id or self.client.closed:
            lease.fail("not needed")
            return
        with self._lock:
            old = self.by_peer.get(lease.peer_id)
            if old is None or old.closed:
                self.by_peer[lease.peer_id] = lease
                return
        lease.fail("a lease of this peer is open already")

    def cancel_running(self, lease: PeerConnection, task_id: int) -> None:
        """Ask the lease's peer to stop the task if it runs now (only the peer may kill the worker)."""
        main = self.client.pooled(lease.peer_id)
        if main is not None and lease.lease_id is not None:
            try:
                main.send({**messages.cancel(task_id), "lease": lease.lease_id})
            except OSError:
                pass

    def check_alive(self, limit: float) -> None:
        """End the leases with tasks in flight that were silent for `limit` seconds: their worker says it
        is alive while it runs a task, so the path to it, or its host, is down (the heartbeat calls this)."""
        for lease in self.all():
            silent = lease.silent_for()
            if lease.pending and silent > limit:
                lease.fail(f"no word from the leased worker for {silent:.1f} s", silent=True)

    def in_flight(self, peer_id: str) -> int:
        lease = self.by_peer.get(peer_id)
        return len(lease.pending) if lease is not None else 0

    def all(self) -> list[PeerConnection]:
        return list(self.by_peer.values())

    def lost(self, lease: PeerConnection, tasks: list[SubmittedTask], reason: str) -> None:
        """A lease's connection closed with `tasks` unanswered. Those that its worker cannot have started
        (`maybe_started`) are placed again. The others may have run, or be running still (the worker
        answers each task as it ends, but the answer may be lost on the way, or the worker died): their
        fate is unknown, so each is retried only under `retries=`, as a task whose worker died, and
        otherwise fails saying so (exactly once)."""
        with self._lock:
            if self.by_peer.get(lease.peer_id) is lease:
                del self.by_peer[lease.peer_id]
        where = f"peer {lease.name} ({lease.address})"
        cause = PeerLost if lease.silent else WorkerDied
        for task in sorted(tasks, key=lambda t: t.task_id):
            if lease.maybe_started(task):
                self.client.retry_or_fail(task, cause(
                    f"the lease of {where} was lost after the task was sent to its worker, which may have run it "
                    f"(its fate is unknown: it runs again only under retries=): {reason}"))
            else:
                self.client.place_again_soon(task, PeerLost(f"the lease of {where} ended before the task started: "
                                                            f"{reason}"))


class LeaseListener:
    """Where a lease's connection reports: outcomes as any connection's; its end to `Leases.lost`."""

    def __init__(self, leases: Leases):
        self.leases = leases

    def on_outcome(self, conn: PeerConnection, task: Any, msg: dict[str, Any], buffers: list[Any]) -> None:
        client = self.leases.client
        client.placement.contention.heard(conn.peer_id, msg)  # its "ran"
        client.settle(conn, task, msg, buffers)

    def on_actor_end(self, conn: PeerConnection, msg: dict[str, Any]) -> None:
        pass

    def on_leaving(self, conn: PeerConnection) -> None:
        pass

    def on_idle(self, conn: PeerConnection) -> None:
        pass

    def on_advert(self, conn: PeerConnection, advert: Advert) -> None:
        pass  # only the peer sends it

    def on_lost(self, conn: PeerConnection, tasks: list[Any], reason: str) -> None:
        self.leases.lost(conn, tasks, reason)


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
