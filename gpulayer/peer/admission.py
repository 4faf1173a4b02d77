"""Admission as a pure decision: whether a SUBMIT or an ACTOR (checked by its validator) is queued, waits
for a new probe of the job interpreter, or is refused, and why. No event loop, no socket: the peer
(`server.py`) passes what admission reads (its advert, whether it drains, the scheduler's state, the
held results) and performs the decision: it sends the REJECT, starts the probe, fetches held arguments,
queues the task and tells the submitter what `acceptance` says.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import Any, Protocol, Union

from ..matching import Requirements, match, missing_software
from ..protocol import messages
from ..resources.model import Advert
from .scheduler_state import SchedulerState
from .slots import ActorHolder, Submission, TaskHolder, TaskOwner


class Submitter(TaskOwner, Protocol):
    """The connection a request came on, as admission reads and records it."""

    tasks: dict[int, Submission]  # its tasks and actor creations, queued or running, by task id
    probing: set[int]  # its tasks waiting for a new probe of the job interpreter


@dataclass(frozen=True)
class Reject:
    """Refuse the request: REJECT with `code` and `message`."""
    task_id: Any
    code: str
    message: str


@dataclass(frozen=True)
class Probe:
    """The task asks for software the job interpreter lacked: if a new probe is due, it waits for one and is
    decided again after it (with `probe=False`); else decide again now with `probe=False`."""
    missing: frozenset[str]


@dataclass(frozen=True)
class Admit:
    """Queue the task (recorded on its connection already); a task with held arguments (`refs`) once they
    are here."""
    task: Submission


Decision = Union[Reject, Probe, Admit]


def admit(conn: Submitter, msg: messages.Message, buffers: list[Any], state: SchedulerState, *, advert: Advert,
          draining: bool, max_queue: int, held: Container[str], probe: bool) -> Decision:
    """Decide a SUBMIT or an ACTOR of `conn`. `probe`: a task that asks for what the job interpreter lacked
    may wait for a new probe (it did not wait for one already)."""
    task_id = msg["id"]
    if task_id in conn.tasks or task_id in conn.probing and probe:
        return Reject(task_id, "bad-request", f"task id {task_id} is already in use on this connection")
    if draining:
        return Reject(task_id, "busy", "the peer is shutting down")
    try:
        req = Requirements.from_wire(msg.get("req") or {})
    except ValueError as exc:
        return Reject(task_id, "bad-request", str(exc))
    reasons = match(req, advert)
    missing = missing_software(req, advert) if reasons and probe else frozenset()
    if missing:
        return Probe(missing)
    if reasons:
        return Reject(task_id, "no-match", "; ".join(reasons))
    if state.queued >= max_queue:
        return Reject(task_id, "busy", f"the queue is full ({max_queue} tasks)")
    if state.actors_hold_all(req):
        return Reject(task_id, "busy", "actors hold the slots that fit")
    keep = msg.get("keep") if msg["t"] == messages.SUBMIT else None  # checked by check_submit; actors keep nothing
    if keep is not None and keep in held:
        return Reject(task_id, "bad-request", "the keep id names a result held already")
    task: Submission
    if msg["t"] == messages.SUBMIT:
        task = TaskHolder(owner=conn, task_id=task_id, msg=msg, buffers=buffers, req=req, timeout=msg.get("timeout"),
                          keep=keep, priority=msg.get("priority", 0),
                          user=f"{msg.get('user') or conn.submitter_id}@{conn.address.rsplit(':', 1)[0]}")
    else:
        task = ActorHolder(owner=conn, task_id=task_id, msg=msg, buffers=buffers, req=req, timeout=msg.get("timeout"),
                           class_name=messages.printable(msg["name"]))
    conn.tasks[task_id] = task
    return Admit(task)


def acceptance(task: Submission, started: bool) -> messages.Message | None:
    """What the submitter is told once its task was queued (`started`: it started at once), if anything: a
    task that waits, that it waits and may be withdrawn until it starts (an actor's creation may not); an
    actor that started, that its slot is taken (a gang creates its next rank then, ADR 0018)."""
    if started:
        return {"t": messages.ACCEPT, "id": task.task_id, "s": True} if isinstance(task, ActorHolder) else None
    if task.answered:
        return None
    return {"t": messages.ACCEPT, "id": task.task_id, "w": isinstance(task, TaskHolder)}
