"""The peer's slots and what holds them: a task, an actor, a lease or a job, each a small type of its own.

A holder takes one slot (or `devices` of them) when the scheduler starts it and gives them back when
it ends. `scheduler_state.py` decides with these types; what differs between them (the message that
starts its worker, whether its slot stays held after a RESULT, whether it may run on a lent slot)
is said here, on each type. A new kind of holder is one more subclass.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Protocol, Union

from ..protocol import messages
from ..matching import Requirements

if TYPE_CHECKING:
    import asyncio

    from .actors import Actor
    from .worker_processes import Worker


@dataclass(eq=False)
class Slot:
    """The right to run one task on one device. `env` is given to its worker."""

    index: int
    device: str  # "cpu", "cuda:0", "mps"
    memory_gb: float | None = None
    env: dict[str, str] = field(default_factory=dict)
    unified: bool = False  # its device's memory is the system's (a Mac)
    worker: Worker | None = None  # None only while the scheduler replaces it
    task: Holder | None = None  # what holds it now
    lent_by: Holder | None = None  # a borrowed slot: the blocked holder whose slot it stands in for (ADR 0014)

    @property
    def ready(self) -> bool:
        return self.task is None and self.worker is not None and self.worker.ready


class TaskOwner(Protocol):
    """The submitter connection a task (or an actor's creation) came from."""

    address: str  # the submitter's "host:port"
    submitter_id: str  # the submitter's id (its AUTH's "client"): whose data its tasks' workers hold

    def task_done(self, task: Submission, reply: messages.Outgoing, buffers: list[Any]) -> None:
        """Send the task's outcome (once)."""

    def task_output(self, task: Submission, msg: messages.LogMessage) -> None:
        """Send a piece of the task's stdout or stderr."""

    def send(self, msg: messages.Outgoing, buffers: messages.Buffers = ()) -> None:
        """Send any message to the submitter."""


@dataclass(eq=False, kw_only=True)
class Holder:
    """What holds a group of slots: started on them, then ended (answered, or a lease given back)."""

    req: Requirements
    slot: Slot | None = None  # the lead slot, where its worker runs
    group: list[Slot] = field(default_factory=list)  # every slot it holds (devices=N holds N)
    started: float = 0.0  # time.monotonic() when it started: its outcome says how long it ran ("ran")
    answered: bool = False  # it ended: its outcome was sent (a lease: it was given back)
    blocked: bool = False  # its worker waits on a future: its slots are lent meanwhile (ADR 0014)
    user: str = ""  # whose quota of slots it counts in (--max-slots-per-user): "user@host"; "" none (actors, leases)

    @property
    def address(self) -> str:
        """The submitter's "host:port"."""
        raise NotImplementedError

    @property
    def resident(self) -> bool:
        """Whether it holds its slot beyond one task (a live actor): it is not load that ends by itself."""
        return False


@dataclass(eq=False, kw_only=True)
class Submission(Holder):
    """What a submitter sent to run (a SUBMIT or an ACTOR): queued, started, answered exactly once."""

    owner: TaskOwner
    task_id: int  # its id on the submitter's connection
    msg: messages.Message | None  # what the submitter sent, until it starts
    buffers: list[Any] | None
    timeout: float | None
    env: dict[str, str] = field(default_factory=dict)  # its environment variables (the message's "env")
    one_off: bool = False  # it runs in a worker of its own, which a warm one replaces after it
    timer: asyncio.TimerHandle | None = None  # its timeout, while it runs
    priority: int = 0  # its place in the queue (jobs/queue.py): a SUBMIT's "priority" (default 0; actors 0)
    share: str = ""  # whose turn it counts in among the queued work of its priority: tasks share one
    borrows: ClassVar[bool] = True  # it may run on a slot lent by a blocked task (it gives it back when it ends)

    @property
    def address(self) -> str:
        return self.owner.address

    @property
    def name(self) -> Any:
        """Its function's or class's name, as the submitter gave it (for STATUS)."""
        return self.msg.get("name") if self.msg else None

    def needs_own_worker(self, fresh: bool) -> bool:
        """Whether it runs in a worker of its own rather than the slot's warm one (`fresh`: its env sets
        a variable read at load). One that holds several devices always does."""
        return fresh or len(self.group) > 1

    def work(self) -> tuple[messages.Message, list[Any]]:
        """The message (and its buffers) that its worker gets to start it; forgets what it came with."""
        raise NotImplementedError

    def keeps_slot(self, reply: messages.Message) -> bool:
        """Whether it holds its slot on after this outcome."""
        return False


@dataclass(eq=False, kw_only=True)
class TaskHolder(Submission):
    """A task (a SUBMIT): one call of a function, then its slots are free."""

    keep: str | None = None  # hold its result under this id (the SUBMIT's "keep"; peer/held.py)
    refs: list[tuple[str, bytes, list[Any]]] = field(default_factory=list)  # held results among its arguments

    def work(self) -> tuple[messages.Message, list[Any]]:
        assert self.msg is not None
        msg: messages.Message = {"t": messages.SUBMIT, "id": self.task_id, "fn": self.msg["fn"],
                             "args": self.msg["args"], "owner": self.owner.submitter_id}
        buffers = self.buffers or []
        if self.refs:  # after the task's own buffers: each held result's, in order
            msg["ab"] = len(buffers)
            msg["refs"] = [[rid, data, len(bufs)] for rid, data, bufs in self.refs]
            buffers = [*buffers, *(b for _, _, bufs in self.refs for b in bufs)]
            self.refs = []
        self.msg = self.buffers = None
        return msg, buffers


def new_actor_id() -> str:
    """A new actor's id: unguessable, so that only who was told it can call the actor."""
    return secrets.token_hex(messages.ACTOR_ID_HEX // 2)


@dataclass(eq=False, kw_only=True)
class ActorHolder(Submission):
    """An actor (an ACTOR): its creation is answered like a task's; once its constructor returned, the
    actor lives in that worker and holds the slot until it ends (peer/actors.py)."""

    class_name: str  # the class's qualified name
    actor_id: str = field(default_factory=new_actor_id)  # given to its worker with the ACTOR message
    actor: Actor | None = None  # the live actor, once its constructor returned
    borrows: ClassVar[bool] = False  # never on a lent slot: it would keep it

    @property
    def resident(self) -> bool:
        return self.actor is not None

    def needs_own_worker(self, fresh: bool) -> bool:
        return True  # a fresh worker, kept out of the warm pool for the actor's life

    def work(self) -> tuple[messages.Message, list[Any]]:
        assert self.msg is not None
        msg: messages.Message = {"t": messages.ACTOR, "id": self.task_id, "cls": self.msg["cls"],
                             "args": self.msg["args"], "conc": self.msg["conc"], "actor": self.actor_id}
        buffers = self.buffers or []
        self.msg = self.buffers = None
        return msg, buffers

    def keeps_slot(self, reply: messages.Message) -> bool:
        return bool(reply["t"] == messages.RESULT)  # its constructor returned: it lives


@dataclass(eq=False, kw_only=True)
class LeaseHolder(Holder):
    """A lease (ADR 0013): a warm worker lent to a submitter's connection, which it serves itself. The
    peer sends nothing to that submitter: the worker ends the lease when idle or when asked to."""

    lease_id: str
    submitter: str  # the submitter's "host:port"
    submitter_id: str  # its id: only it may cancel the lease's tasks
    yielding: bool = False  # its worker was asked to end it

    @property
    def address(self) -> str:
        return self.submitter


@dataclass(eq=False, kw_only=True)
class JobHolder(Holder):
    """A job (ADR 0016, peer/jobs.py): queued like a task; once started, a process of its own (not a
    worker) runs on its slots until it ends, and `job_ended` gives them back."""

    job_id: str
    name: str
    start: Callable[[list[Slot], dict[str, str]], None]  # runs it, given its slots and their device variables
    priority: int = 0  # higher starts first (jobs/queue.py; its spec's --priority)
    share: str = ""  # its submitter ("user@host"), whose turn it counts in among the queued jobs of its priority
    borrows: ClassVar[bool] = True

    @property
    def address(self) -> str:
        return f"job {self.job_id}"


Queued = Union[Submission, JobHolder]  # what waits in the scheduler's queue
