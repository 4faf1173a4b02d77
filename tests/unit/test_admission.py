"""Admission as a pure decision (peer/admission.py): a SUBMIT or an ACTOR, with what the peer reads (its
advert, whether it drains, the scheduler's state, the held results), is queued, waits for a new probe of
the job interpreter, or is refused with its reason. No event loop, no socket: a connection is what
admission reads and records of one (its submitter, its tasks, its tasks waiting for a probe)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gpulayer.matching import Requirements
from gpulayer.peer.admission import Admit, Probe, Reject, acceptance, admit
from gpulayer.peer.scheduler_state import SchedulerState
from gpulayer.peer.slots import ActorHolder, Slot, TaskHolder
from gpulayer.protocol import messages
from gpulayer.resources.model import Advert, Framework, Resources


@dataclass(eq=False)
class Up:
    ready: bool = True
    direct: bool = True


@dataclass(eq=False)
class Conn:
    address: str = "10.0.0.1:5000"
    submitter_id: str = "alice"
    tasks: dict = field(default_factory=dict)
    probing: set = field(default_factory=set)

    def task_done(self, task, reply, buffers):
        raise AssertionError("admission sends nothing itself")

    task_output = send = task_done


def advert(frameworks=()):
    """This peer's own advert (it knows every distribution of its job interpreter: here none)."""
    res = Resources(host="box", system="Linux", machine="x86_64", cpu_name="cpu", cpu_count=2, memory_gb=8.0,
                    python="3.11.7", devices=[], frameworks=[Framework(*f) for f in frameworks], distributions={})
    return Advert.from_resources(res, peer_id="id-box", name="box", cluster="c0ffee", slots=2)


def state(count=2):
    slots = [Slot(i, "cpu", env={"GPULAYER_DEVICE": "cpu"}) for i in range(count)]
    for slot in slots:
        slot.worker = Up()  # type: ignore[assignment]
    return SchedulerState(slots)


def submit(task_id=1, **extra):
    return {"t": messages.SUBMIT, "id": task_id, "fn": b"fn", "args": b"args", "name": "f", **extra}


def actor(task_id=2):
    return {"t": messages.ACTOR, "id": task_id, "cls": b"cls", "args": b"args", "name": "Counter", "conc": 1}


def decide(conn, msg, sched=None, *, draining=False, max_queue=100, held=(), probe=True, frameworks=()):
    return admit(conn, msg, [b"buf"], sched or state(), advert=advert(frameworks), draining=draining,
                 max_queue=max_queue, held=set(held), probe=probe)


def test_a_task_and_an_actor_are_admitted_and_recorded_on_their_connection():
    conn = Conn()
    task = decide(conn, submit(1, keep="k1", timeout=3.0))
    assert isinstance(task, Admit) and isinstance(task.task, TaskHolder)
    assert (task.task.task_id, task.task.keep, task.task.timeout, task.task.buffers) == (1, "k1", 3.0, [b"buf"])
    created = decide(conn, actor(2))
    assert isinstance(created, Admit) and isinstance(created.task, ActorHolder)
    assert created.task.class_name == "Counter" and conn.tasks == {1: task.task, 2: created.task}


def test_refusals_name_their_reason_and_record_nothing():
    conn = Conn()
    decide(conn, submit(1))
    assert decide(conn, submit(1)) == Reject(1, "bad-request", "task id 1 is already in use on this connection")
    conn.probing.add(5)
    assert decide(conn, submit(5)).message == "task id 5 is already in use on this connection"
    assert decide(conn, submit(6), draining=True) == Reject(6, "busy", "the peer is shutting down")
    bad = decide(conn, submit(7, req={"dev": 0}))
    assert isinstance(bad, Reject) and bad.code == "bad-request" and "devices" in bad.message.lower()
    assert decide(conn, submit(8, keep="k"), held={"k"}) == Reject(8, "bad-request",
                                                                   "the keep id names a result held already")
    gpu = decide(conn, submit(9, req={"acc": "cuda"}))
    assert isinstance(gpu, Reject) and gpu.code == "no-match" and "cuda" in gpu.message
    assert list(conn.tasks) == [1]


def test_a_full_queue_and_actors_on_every_slot_refuse_with_busy():
    sched = state(count=1)
    for task_id in (1, 2):  # the first holds the only slot, the second waits
        sched.task_arrived(TaskHolder(owner=Conn(), task_id=task_id, msg=submit(task_id), buffers=[],
                                      req=Requirements.build(), timeout=None), now=0.0)
    assert decide(Conn(), submit(3), sched, max_queue=1) == Reject(3, "busy", "the queue is full (1 tasks)")
    resident = ActorHolder(owner=Conn(), task_id=4, msg=actor(4), buffers=[], req=Requirements.build(), timeout=None,
                           class_name="Counter")
    resident.actor = object()  # type: ignore[assignment]  # a live actor holds the only slot
    sched.slots[0].task = resident
    assert decide(Conn(), submit(5), sched) == Reject(5, "busy", "actors hold the slots that fit")


def test_a_framework_the_job_interpreter_lacked_waits_for_a_probe_once_then_is_refused():
    conn = Conn()
    wants = submit(1, req={"fw": [["torch", ""]]})
    assert decide(conn, wants) == Probe(frozenset({"torch"}))
    assert conn.tasks == {}  # the peer records the wait (conn.probing) only if a probe is due
    conn.probing.add(1)
    after = decide(conn, wants, probe=False)  # after the probe (or with none due): the match decides
    assert isinstance(after, Reject) and after.code == "no-match" and "torch" in after.message
    found = decide(conn, wants, probe=False, frameworks=[("torch", "2.13.0+cpu", ())])
    assert isinstance(found, Admit)


def test_what_the_submitter_is_told_once_its_task_is_queued():
    conn = Conn()
    task, created = decide(conn, submit(1)).task, decide(conn, actor(2)).task
    assert acceptance(task, started=True) is None  # its outcome will say
    assert acceptance(task, started=False) == {"t": messages.ACCEPT, "id": 1, "w": True}
    assert acceptance(created, started=False) == {"t": messages.ACCEPT, "id": 2, "w": False}
    assert acceptance(created, started=True) == {"t": messages.ACCEPT, "id": 2, "s": True}
    task.answered = True  # answered as it was queued (a bad env)
    assert acceptance(task, started=False) is None
