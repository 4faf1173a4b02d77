"""The peer's actors as pure transitions: live instances in workers of their own, and the calls on their way to them.

An actor is created like a task (an ACTOR message, admitted and scheduled by the scheduler, which
starts a fresh worker for it on one slot). Once its constructor returned, the slot stays held and
this table routes the actor's CALLs to its worker, in the order they arrive, and their outcomes back
to whichever connection sent each call. The actor ends on CLOSE from its creator, when its creator
has had no connection for `grace` seconds, when a call runs past its timeout, or when its worker
dies; every call still in flight then gets an `actor-died` error, and the slot a fresh warm worker.

As in `scheduler_state.py`, each event (a CALL, a cancel, a CLOSE, a connection come or gone, a
worker's reply, a timer that fired) changes the table and returns the actions that follow, in
order; no event loop, no process, no socket. The scheduler (`scheduler.py`) performs them, with the
scheduler state's, in the order decided: it sends, and arms and cancels the timers.
"""

from __future__ import annotations

import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, Union

from ..checks import check_timeout, seconds_from_env
from ..protocol import messages
from .scheduler_state import ToWorker
from .slots import Slot

if TYPE_CHECKING:
    import asyncio

    from .worker_processes import Worker

ENDED_KEPT = 4096  # ended actors remembered, so that a late call learns why its actor is gone
GRACE_ENV = "GPULAYER_ACTOR_GRACE"
DEFAULT_GRACE = 10.0


def grace_from_env() -> float:
    """Seconds an actor outlives its creator's last connection (GPULAYER_ACTOR_GRACE, default 10)."""
    return seconds_from_env(GRACE_ENV, DEFAULT_GRACE)


class CallOwner(Protocol):
    """The submitter connection that sent calls (or created actors)."""

    submitter_id: str  # the submitter's id, from its AUTH
    calls: dict[int, tuple[Actor, int]]  # its calls in flight: call id -> (actor, worker call id)

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None:
        """Write a message to the submitter."""


@dataclass(eq=False)
class Call:
    owner: CallOwner | None  # None once its connection is gone: its outcome is dropped
    call_id: int  # its id on its submitter's connection
    method: str
    timeout: float | None = None
    timer: asyncio.TimerHandle | None = None  # the scheduler's, while its timeout is armed


@dataclass(eq=False)
class Actor:
    """A live actor: its slot and worker, the calls in flight on it, in the order they were sent."""

    actor_id: str
    name: str  # the class's qualified name
    submitter_id: str  # the submitter that created it
    owner: CallOwner | None  # the creator's connection, where ACTOR_END goes
    slot: Slot
    worker: Worker
    calls: dict[int, Call] = field(default_factory=dict)  # by worker call id
    served_here: int = 0  # calls answered through this peer
    served_direct: int = 0  # calls answered on direct connections, as its worker last reported (ADR 0012)
    orphaned: bool = False  # its creator has no connection: it ends when the grace time runs out
    grace: asyncio.TimerHandle | None = None  # the scheduler's, while `orphaned`
    worker_call_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))  # a call's id on the worker

    @property
    def served(self) -> int:
        return self.served_here + self.served_direct

    @property
    def short_id(self) -> str:
        """What STATUS shows of the id: enough to tell actors apart, too little to call one."""
        return self.actor_id[:8]


# ---- actions: what the scheduler does, in the order given (with scheduler_state's ToWorker) ----------

@dataclass(frozen=True, eq=False)
class ToSubmitter:
    """Send `msg` on a submitter's connection."""
    owner: CallOwner
    msg: messages.Outgoing
    buffers: messages.Buffers = ()


@dataclass(frozen=True, eq=False)
class ArmCall:
    """Arm the call's timeout: when it fires, `call_timed_out(actor, worker_call_id)`."""
    actor: Actor
    worker_call_id: int
    call: Call


@dataclass(frozen=True, eq=False)
class StopCall:
    """Cancel the call's timeout, if armed."""
    call: Call


@dataclass(frozen=True, eq=False)
class ArmGrace:
    """Arm the actor's grace time: when it runs out, `grace_ended(actor)`."""
    actor: Actor
    seconds: float


@dataclass(frozen=True, eq=False)
class StopGrace:
    """Cancel the actor's grace time, if armed."""
    actor: Actor


@dataclass(frozen=True, eq=False)
class Gone:
    """The actor ended (log it): its worker is stopped and its slot gets a fresh warm one."""
    actor: Actor
    why: str


ActorAction = Union[ToWorker, ToSubmitter, ArmCall, StopCall, ArmGrace, StopGrace, Gone]
Actions = list[ActorAction]


class Actors:
    """The live actors of a peer, by id, and the reasons the last ENDED_KEPT ended."""

    def __init__(self, grace: float = DEFAULT_GRACE):
        self.live: dict[str, Actor] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # id -> why it ended
        self.grace = grace

    def add(self, actor: Actor) -> None:
        """Its constructor returned: it is live (its creator owns it while connected)."""
        self.live[actor.actor_id] = actor

    def rows(self) -> list[dict[str, Any]]:
        """The live actors as STATUS lists them."""
        return [{"actor": a.short_id, "class": a.name, "slot": a.slot.index, "served": a.served,
                 "pending": len(a.calls), "pid": a.worker.pid} for a in self.live.values()]

    # ---- from submitters ----------------------------------------------------------------------

    def call(self, owner: CallOwner, msg: messages.Message, buffers: list[Any]) -> Actions:
        """A CALL (checked by messages.check_call): on to its actor's worker under a worker call id, or an error."""
        call_id = msg["id"]
        if call_id in owner.calls:
            return [ToSubmitter(owner, messages.error("bad-request",
                                                      f"call id {call_id} is already in use on this connection", call_id))]
        actor = self.live.get(msg["actor"])
        if actor is None:
            return [ToSubmitter(owner, self.gone(msg["actor"], call_id))]
        worker_call_id = next(actor.worker_call_ids)
        call = actor.calls[worker_call_id] = Call(owner, call_id, msg["method"], check_timeout(msg.get("timeout")))
        owner.calls[call_id] = (actor, worker_call_id)
        actions: Actions = [ToWorker(actor.worker, {"t": messages.CALL, "id": worker_call_id, "method": msg["method"],
                                                    "args": msg["args"]}, buffers)]
        if call.timeout is not None:
            actions.append(ArmCall(actor, worker_call_id, call))
        return actions

    def cancel(self, owner: CallOwner, call_id: int) -> Actions:
        """Answer a call in flight with `cancelled`; the worker skips it unless it has started (then its
        result is dropped)."""
        actor, worker_call_id = owner.calls.pop(call_id)
        call = actor.calls.pop(worker_call_id, None)
        if call is None:
            return []
        return [*_stop(call), ToWorker(actor.worker, messages.cancel(worker_call_id)),
                ToSubmitter(owner, messages.error("cancelled", "cancelled by the submitter", call_id))]

    def close(self, owner: CallOwner, msg: messages.Message) -> Actions:
        """CLOSE (checked by messages.check_close) from a submitter: only the actor's creator may close it."""
        actor = self.live.get(msg["actor"])
        if actor is None:
            return [ToSubmitter(owner, self.gone(msg["actor"], msg["id"]))]
        if actor.submitter_id != owner.submitter_id:
            return [ToSubmitter(owner, messages.error("not-owner", "only the submitter that created an actor may close it",
                                                      msg["id"]))]
        actor.owner = owner  # the answer goes to the connection that asked
        return self.end(actor, "closed", "the actor was closed by its submitter", msg["id"])

    def gone(self, actor_id: str, request_id: int) -> messages.ErrorMessage:
        """The answer to a request for an actor that is not live here: why it ended, or that it never was."""
        reason = self.ended.get(actor_id)
        if reason is not None:
            return messages.error("actor-died", reason, request_id)
        return messages.error("no-actor", "no such actor on this peer", request_id)

    # ---- connections come and go ----------------------------------------------------------------

    def disconnected(self, owner: CallOwner, last: bool) -> Actions:
        """A connection closed: drop its calls' outcomes; if it was its submitter's `last`, the actors
        that submitter created end after the grace time unless it connects again."""
        for actor, worker_call_id in owner.calls.values():
            call = actor.calls.get(worker_call_id)
            if call is not None:
                call.owner = None
        owner.calls.clear()
        actions: Actions = []
        for actor in self.live.values():
            if actor.owner is owner:
                actor.owner = None
            if last and actor.submitter_id == owner.submitter_id and not actor.orphaned:
                actor.orphaned = True
                actions.append(ArmGrace(actor, self.grace))
        return actions

    def connected(self, owner: CallOwner) -> Actions:
        """A submitter (re)connected: it owns its actors again."""
        actions: Actions = []
        for actor in self.live.values():
            if actor.submitter_id == owner.submitter_id:
                actor.owner = owner
                if actor.orphaned:
                    actor.orphaned = False
                    actions.append(StopGrace(actor))
        return actions

    def grace_ended(self, actor: Actor) -> Actions:
        """The actor's grace time ran out: it ends, unless its submitter came back meanwhile."""
        if not actor.orphaned:
            return []
        return self.end(actor, "died", f"its submitter {actor.submitter_id} was gone for {self.grace:g} s")

    # ---- from its worker ----------------------------------------------------------------------

    def reply(self, actor: Actor, reply: messages.Message, buffers: list[Any]) -> Actions:
        """A call's RESULT or ERROR, back to its connection under its call id; or the worker's count of
        the calls it answered on direct connections (a STATUS)."""
        if reply["t"] == messages.STATUS:
            served = reply.get("served")
            if isinstance(served, int) and not isinstance(served, bool) and served >= 0:
                actor.served_direct = served
            return []
        call = actor.calls.pop(reply.get("id"), None)  # type: ignore[arg-type]
        actor.served_here += 1
        if call is None or call.owner is None:
            return []  # cancelled, or its submitter is gone
        call.owner.calls.pop(call.call_id, None)
        reply["id"] = call.call_id
        return [*_stop(call), ToSubmitter(call.owner, reply, buffers)]

    def output(self, actor: Actor, stream: str, data: bytes) -> Actions:
        """Stdout or stderr of the actor, to its oldest call in flight; nothing when there is none."""
        call = next(iter(actor.calls.values()), None)
        if call is None or call.owner is None:
            return []
        return [ToSubmitter(call.owner, messages.log(call.call_id, stream, data))]

    def call_timed_out(self, actor: Actor, worker_call_id: int) -> Actions:
        """A call ran past its timeout: it gets `timeout`, and the actor ends (its worker is killed)."""
        call = actor.calls.pop(worker_call_id, None)
        if call is None:
            return []
        reason = (f"its call of {call.method} ran past its timeout of {call.timeout:g} s; its worker was killed "
                  "(a running method cannot be stopped otherwise)")
        actions: Actions = []
        if call.owner is not None:
            call.owner.calls.pop(call.call_id, None)
            actions.append(ToSubmitter(call.owner, messages.error("timeout", reason, call.call_id)))
        return [*actions, *self.end(actor, "died", f"the actor was stopped: {reason}")]

    def end(self, actor: Actor, code: str, reason: str, request_id: int | None = None) -> Actions:
        """End an actor: its calls in flight get `actor-died`, its creator ACTOR_END (with the CLOSE's
        `request_id`), its slot a fresh worker."""
        if self.live.pop(actor.actor_id, None) is None:
            return []
        self.ended[actor.actor_id] = reason
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        actions: Actions = []
        if actor.orphaned:
            actor.orphaned = False
            actions.append(StopGrace(actor))
        for call in actor.calls.values():
            actions += _stop(call)
            if call.owner is not None:
                call.owner.calls.pop(call.call_id, None)
                actions.append(ToSubmitter(call.owner, messages.error("actor-died", reason, call.call_id)))
        actor.calls.clear()
        if actor.owner is not None:
            actions.append(ToSubmitter(actor.owner, messages.actor_end(actor.actor_id, code, reason, actor.served,
                                                                      request_id)))
        return [*actions, Gone(actor, reason)]

    def end_all(self, reason: str) -> Actions:
        """End every live actor (the peer stops)."""
        return [action for actor in list(self.live.values()) for action in self.end(actor, "died", reason)]


def _stop(call: Call) -> Actions:
    """Stop the call's timer, if it has one."""
    return [StopCall(call)] if call.timeout is not None else []
