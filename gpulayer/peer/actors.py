"""The peer's actors: live instances in workers of their own, and the calls on their way to them.

An actor is created like a task (an ACTOR message, admitted and scheduled by the scheduler, which
starts a fresh worker for it on one slot). Once its constructor returned, the slot stays held and
this table routes the actor's CALLs to its worker, in the order they arrive, and their outcomes back
to whichever connection sent each call. The actor ends on CLOSE from its creator, when its creator
has had no connection for `GRACE` seconds, when a call runs past its timeout, or when its worker
dies; every call still in flight then gets an `actor-died` error, and the slot a fresh warm worker.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from ..errors import ConfigError
from ..checks import check_timeout
from ..protocol import messages
from .slots import Slot
from .worker_processes import Worker

log = logging.getLogger("gpulayer.peer")

ENDED_KEPT = 4096  # ended actors remembered, so that a late call learns why its actor is gone
GRACE_ENV = "GPULAYER_ACTOR_GRACE"
DEFAULT_GRACE = 10.0


def grace_from_env() -> float:
    """Seconds an actor outlives its creator's last connection (GPULAYER_ACTOR_GRACE, default 10)."""
    value = os.environ.get(GRACE_ENV, str(DEFAULT_GRACE))
    try:
        grace = check_timeout(float(value))
    except ValueError:
        grace = None
    if grace is None:
        raise ConfigError(f"{GRACE_ENV} must be a positive number of seconds, not {value!r}")
    return grace


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
    timer: asyncio.TimerHandle | None = None


@dataclass(eq=False)
class Actor:
    """A live actor: its slot and worker, the calls in flight on it, in the order they were sent."""

    actor_id: str
    name: str  # the class's qualified name
    submitter_id: str  # the submitter that created it
    owner: CallOwner | None  # the creator's connection, where ACTOR_END goes
    slot: Slot
    worker: Worker
    calls: dict[int, Call] = field(default_factory=dict)
    served_here: int = 0  # calls answered through this peer
    served_direct: int = 0  # calls answered on direct connections, as its worker last reported (ADR 0012)
    grace: asyncio.TimerHandle | None = None
    worker_call_ids: itertools.count[int] = field(default_factory=lambda: itertools.count(1))  # a call's id on the worker

    @property
    def served(self) -> int:
        return self.served_here + self.served_direct

    @property
    def short_id(self) -> str:
        """What STATUS shows of the id: enough to tell actors apart, too little to call one."""
        return self.actor_id[:8]


class Actors:
    """The live actors of a peer, by id; `free(slot, worker)` gives an ended actor's slot back."""

    def __init__(self, free: Callable[[Slot, Worker, str], None], grace: float = DEFAULT_GRACE):
        self.live: dict[str, Actor] = {}
        self.ended: OrderedDict[str, str] = OrderedDict()  # id -> why it ended
        self.grace = grace
        self._free = free

    def add(self, actor: Actor) -> None:
        self.live[actor.actor_id] = actor
        log.info("actor %s (%s) of submitter %s lives on slot %d, worker %s", actor.short_id, actor.name,
                 actor.submitter_id, actor.slot.index, actor.worker.pid)

    def rows(self) -> list[dict[str, Any]]:
        """The live actors as STATUS lists them."""
        return [{"actor": a.short_id, "class": a.name, "slot": a.slot.index, "served": a.served,
                 "pending": len(a.calls), "pid": a.worker.pid} for a in self.live.values()]

    # ---- from submitters ----------------------------------------------------------------------

    def call(self, owner: CallOwner, msg: messages.Message, buffers: list[Any]) -> None:
        """Send a CALL (checked by messages.check_call) on to its actor's worker, or answer it with an error."""
        call_id = msg["id"]
        if call_id in owner.calls:
            return owner.send(messages.error("bad-request", f"call id {call_id} is already in use on this connection",
                                             call_id))
        actor = self._addressed(owner, msg)
        if actor is None:
            return
        worker_call_id = next(actor.worker_call_ids)
        call = actor.calls[worker_call_id] = Call(owner, call_id)
        owner.calls[call_id] = (actor, worker_call_id)
        actor.worker.send({"t": messages.CALL, "id": worker_call_id, "method": msg["method"], "args": msg["args"]}, buffers)
        timeout = check_timeout(msg.get("timeout"))
        if timeout is not None:
            call.timer = asyncio.get_running_loop().call_later(timeout, self._timed_out, actor, worker_call_id, timeout,
                                                               msg["method"])

    def cancel(self, owner: CallOwner, call_id: int) -> None:
        """Answer a call with `cancelled`; the worker skips it unless it has started (then its result is dropped)."""
        actor, worker_call_id = owner.calls.pop(call_id)
        call = actor.calls.pop(worker_call_id, None)
        if call is None:
            return
        _stop_timer(call)
        actor.worker.send(messages.cancel(worker_call_id))
        owner.send(messages.error("cancelled", "cancelled by the submitter", call_id))

    def close(self, owner: CallOwner, msg: messages.Message) -> None:
        """CLOSE (checked by messages.check_close) from a submitter: only the actor's creator may close it."""
        actor = self._addressed(owner, msg)
        if actor is None:
            return
        if actor.submitter_id != owner.submitter_id:
            owner.send(messages.error("not-owner", "only the submitter that created an actor may close it", msg["id"]))
        else:
            actor.owner = owner  # the answer goes to the connection that asked
            self.end(actor, "closed", "the actor was closed by its submitter", msg["id"])

    def _addressed(self, owner: CallOwner, msg: messages.Message) -> Actor | None:
        """The live actor a CALL or CLOSE (checked already) names; None once answered that it is gone."""
        actor = self.live.get(msg["actor"])
        if actor is None:
            owner.send(self.gone(msg["actor"], msg["id"]))
        return actor

    def gone(self, actor_id: str, request_id: int) -> messages.ErrorMessage:
        """The answer to a request for an actor that is not live here: why it ended, or that it never was."""
        reason = self.ended.get(actor_id)
        if reason is not None:
            return messages.error("actor-died", reason, request_id)
        return messages.error("no-actor", "no such actor on this peer", request_id)

    # ---- connections come and go ----------------------------------------------------------------

    def disconnected(self, owner: CallOwner, last: bool) -> None:
        """A connection closed: drop its calls' outcomes; if it was its submitter's `last`, the actors
        that submitter created end after the grace time unless it connects again."""
        for actor, worker_call_id in owner.calls.values():
            call = actor.calls.get(worker_call_id)
            if call is not None:
                call.owner = None
        owner.calls.clear()
        loop = asyncio.get_running_loop()
        for actor in self.live.values():
            if actor.owner is owner:
                actor.owner = None
            if last and actor.submitter_id == owner.submitter_id and actor.grace is None:
                actor.grace = loop.call_later(self.grace, self._orphaned, actor)

    def connected(self, owner: CallOwner) -> None:
        """A submitter (re)connected: it owns its actors again."""
        for actor in self.live.values():
            if actor.submitter_id == owner.submitter_id:
                actor.owner = owner
                if actor.grace is not None:
                    actor.grace.cancel()
                    actor.grace = None

    def _orphaned(self, actor: Actor) -> None:
        actor.grace = None
        self.end(actor, "died", f"its submitter {actor.submitter_id} was gone for {self.grace:g} s")

    # ---- from its worker ----------------------------------------------------------------------

    def reply(self, actor: Actor, reply: messages.Message, buffers: list[Any]) -> None:
        """A call's RESULT or ERROR, back to its connection; or the worker's count of the calls it
        answered on direct connections (a STATUS)."""
        if reply["t"] == messages.STATUS:
            served = reply.get("served")
            if isinstance(served, int) and not isinstance(served, bool) and served >= 0:
                actor.served_direct = served
            return
        call = actor.calls.pop(reply.get("id"), None)  # type: ignore[arg-type]
        actor.served_here += 1
        if call is None or call.owner is None:
            return  # cancelled, or its submitter is gone
        _stop_timer(call)
        call.owner.calls.pop(call.call_id, None)
        reply["id"] = call.call_id
        call.owner.send(reply, buffers)

    def output(self, actor: Actor, stream: str, data: bytes) -> bool:
        """Stdout or stderr of the actor, to its oldest call in flight; False when there is none."""
        call = next(iter(actor.calls.values()), None)
        if call is None or call.owner is None:
            return False
        call.owner.send(messages.log(call.call_id, stream, data))
        return True

    def _timed_out(self, actor: Actor, worker_call_id: int, timeout: float, method: str) -> None:
        call = actor.calls.pop(worker_call_id, None)
        if call is None:
            return
        call.timer = None
        reason = (f"its call of {method} ran past its timeout of {timeout:g} s; its worker was killed "
                  "(a running method cannot be stopped otherwise)")
        if call.owner is not None:
            call.owner.calls.pop(call.call_id, None)
            call.owner.send(messages.error("timeout", reason, call.call_id))
        self.end(actor, "died", f"the actor was stopped: {reason}")

    def end(self, actor: Actor, code: str, reason: str, request_id: int | None = None) -> None:
        """End an actor: its calls in flight get `actor-died`, its creator ACTOR_END, its slot a fresh worker."""
        if self.live.pop(actor.actor_id, None) is None:
            return
        self.ended[actor.actor_id] = reason
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)
        log.info("actor %s (%s) ended after %d call(s): %s", actor.short_id, actor.name, actor.served, reason)
        if actor.grace is not None:
            actor.grace.cancel()
        for call in actor.calls.values():
            _stop_timer(call)
            if call.owner is not None:
                call.owner.calls.pop(call.call_id, None)
                call.owner.send(messages.error("actor-died", reason, call.call_id))
        actor.calls.clear()
        if actor.owner is not None:
            actor.owner.send(messages.actor_end(actor.actor_id, code, reason, actor.served, request_id))
        self._free(actor.slot, actor.worker, f"its actor {actor.short_id} ended: {reason}")

    def end_all(self, reason: str) -> None:
        for actor in list(self.live.values()):
            self.end(actor, "died", reason)


def _stop_timer(call: Call) -> None:
    if call.timer is not None:
        call.timer.cancel()
        call.timer = None
