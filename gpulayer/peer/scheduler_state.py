"""The scheduler's decisions as pure transitions: no event loop, no process, no socket.

`SchedulerState` holds the queue, the slots (planned and borrowed), the leases and the counts. Each
of its event methods (a task arrived, a task replied, a timeout, a cancel, a worker died, a wait
began or ended, a lease ended, a worker is ready...) changes that state and returns the actions that
follow, in order: whom to answer, what to send to which worker, which worker to replace, which timer
to stop. The asyncio side (`scheduler.py`) turns what happens into these calls and performs the
actions; the time is an argument (`now`, time.monotonic()). dask's `worker_state_machine.py` is the
model. What differs between a task, an actor and a lease is said by their types (`slots.py`).
"""

from __future__ import annotations

import math
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from itertools import islice
from typing import TYPE_CHECKING, Any, Union

from .. import accelerators
from ..jobs.queue import FairQueue
from ..matching import MEMORY_SLACK_GB, Requirements
from ..protocol import messages
from ..resources.utilisation import Sample
from ..taskenv import check_env, read_at_load
from .slots import ActorHolder, Holder, JobHolder, LeaseHolder, Queued, Slot, Submission, TaskOwner

if TYPE_CHECKING:
    from .actors import Actor
    from .worker_processes import Worker

LOOKAHEAD = 256  # how deep the queue is searched for a task that fits the free slots
CONTENDING_S = 2.0  # a submitter that queued a task this recently contends for the slots (ADR 0011)
IDLE_NOTICE_GAP_S = 0.02  # the least time between two rounds of telling contenders that a slot is free
MEASURE_MAX_AGE_S = 5.0  # an older measurement of free memory is not used (the sampler runs at 1 Hz)
LEASE_IDLE_S = 0.5  # a lease ends when no task came on it for this long (ADR 0013)
SPARE_IDLE_S = 10.0  # a borrowed slot's worker that no wait needs is kept this long for the next (ADR 0014)


# ---- actions: what the asyncio side does, in the order given ----------------------------------------

@dataclass(frozen=True, eq=False)
class Started:
    """Record that `holder` started on `device` (STATUS's running tasks)."""
    holder: Holder
    name: Any
    device: str


@dataclass(frozen=True, eq=False)
class Run:
    """Send `msg` to the slot's warm worker, then arm the task's timeout."""
    task: Submission
    worker: Worker
    msg: messages.Message
    buffers: list[Any]


@dataclass(frozen=True, eq=False)
class RunAlone:
    """Start a worker of the task's own on `slot` in place of its warm one `old`, which is killed (`env` on
    top of the slot's; no preloads if `bare`), then send it `msg` and arm the timeout."""
    task: Submission
    slot: Slot
    old: Worker | None
    env: dict[str, str]
    bare: bool
    msg: messages.Message
    buffers: list[Any]


@dataclass(frozen=True, eq=False)
class StartJob:
    """Run the job on its slots, with their device variables."""
    job: JobHolder
    group: list[Slot]
    env: dict[str, str]


@dataclass(frozen=True, eq=False)
class Answer:
    """Send a task's outcome to its submitter (the reply's "id" and "ran" are set) and record it."""
    task: Submission
    reply: messages.Outgoing
    buffers: list[Any]


@dataclass(frozen=True, eq=False)
class Ended:
    """Record that a lease ended with `reply` (nothing is sent: its connection is its worker's)."""
    holder: Holder
    reply: messages.Message


@dataclass(frozen=True, eq=False)
class Replace:
    """Kill the slot's worker `old` (None: there was none) and start a fresh warm one; `why` the peer
    stops it, None: it died by itself."""
    slot: Slot
    old: Worker | None
    why: str | None


@dataclass(frozen=True, eq=False)
class StopTimer:
    """Cancel the task's timeout."""
    task: Submission


@dataclass(frozen=True, eq=False)
class ToWorker:
    """Send `msg` to a worker (a lease's LEASE_END or CANCEL; an actor's CALL or CANCEL)."""
    worker: Worker
    msg: messages.Message
    buffers: messages.Buffers = ()


@dataclass(frozen=True, eq=False)
class TellIdle:
    """Tell these submitters (an unasked PONG with the load) that a slot is free (ADR 0011)."""
    owners: frozenset[TaskOwner]


@dataclass(frozen=True, eq=False)
class GoLive:
    """The actor's constructor returned: make the live actor in `worker`, which holds the slot, and put its
    id in `reply`."""
    task: Submission
    worker: Worker
    reply: messages.Message


@dataclass(frozen=True, eq=False)
class EndActor:
    """End a live actor (its calls get actor-died, its creator ACTOR_END)."""
    actor: Actor
    reason: str


@dataclass(frozen=True, eq=False)
class OpenBorrowed:
    """Give a new borrowed slot a warm worker (ADR 0014)."""
    slot: Slot


@dataclass(frozen=True, eq=False)
class StopWorker:
    """Stop a spare borrowed slot's worker."""
    worker: Worker


Action = Union[Started, Run, RunAlone, StartJob, Answer, Ended, Replace, StopTimer, ToWorker, TellIdle, GoLive,
               EndActor, OpenBorrowed, StopWorker]
Actions = list[Action]


class SchedulerState:
    """The queue, the slots and what holds them; by priority, the submitters in turn, then first come first
    served (jobs/queue.py), honouring device memory."""

    def __init__(self, slots: list[Slot], max_slots_per_user: int | None = None):
        self.slots = slots
        self.max_slots_per_user = max_slots_per_user  # the quota (--max-slots-per-user): None, no cap
        self.borrowed: list[Slot] = []  # slots lent by blocked tasks (`lent_by` set) and spare ones (ADR 0014)
        self.queue: FairQueue[Queued] = FairQueue()  # in start order (jobs/queue.py)
        self.leases: dict[str, LeaseHolder] = {}  # by lease id
        self.tasks_done = 0
        self.withdrawn = 0  # tasks their submitters took back from the queue (ADR 0011)
        self.measured: Sample | None = None  # the last measured utilisation
        self._contending: dict[TaskOwner, float] = {}  # submitter -> when it last queued a task
        self._idle_told = -math.inf  # when contenders were last told that a slot is free
        self._spare_since: dict[int, float] = {}  # a spare's index -> since when no wait needed it
        self._next_index = len(slots)

    # ---- what it reports ------------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Slots held, borrowed ones included (a blocked task is still running)."""
        busy = sum(s.task is not None for s in self.slots)
        return busy + sum(s.task is not None for s in self.borrowed) if self.borrowed else busy

    @property
    def held_by_actors(self) -> int:
        return sum(s.task is not None and s.task.resident for s in self.slots)

    @property
    def held_by_jobs(self) -> int:
        return sum(isinstance(s.task, JobHolder) for s in self.slots)

    @property
    def queued(self) -> int:
        return len(self.queue)

    def actors_hold_all(self, req: Requirements) -> bool:
        """Whether actors hold so many of the slots that fit `req` that it could never start here."""
        free = {s.device for s in self.slots
                if slot_memory_fits(req, s) and (s.task is None or not s.task.resident or s.task.blocked)}
        return len(free) < req.devices

    def load(self) -> list[int]:
        """[busy, queued]: a blocked task's slot counts as free while it is lent (a borrowed one, busy)."""
        if self.borrowed:
            return [self.busy - sum(s.lent_by is not None for s in self.borrowed), len(self.queue)]
        return [self.busy, len(self.queue)]

    def report(self, msg: messages.Outgoing, now: float) -> messages.Outgoing:
        """Add what a reply tells the submitter about this peer: its "load", its contending "submitters"
        and, on a GPU peer, its "free" GB (the most that one task may take now on one device)."""
        msg["load"] = self.load()
        msg["submitters"] = self.submitters(now)
        free = self.available_memory()
        if free:
            msg["free"] = round(max(free.values()), 3)
        return msg

    def submitters(self, now: float) -> int:
        """How many submitters contend for the slots (each lease or running job counts as one). Each
        submitter sizes its map's window by it (ADR 0011)."""
        return len(self._contenders(now)) + sum(isinstance(s.task, (LeaseHolder, JobHolder)) for s in self.slots)

    def _contenders(self, now: float) -> set[TaskOwner]:
        """The submitters with a task running here, or one queued in the last CONTENDING_S seconds."""
        cutoff = now - CONTENDING_S
        for owner in [o for o, seen in self._contending.items() if seen < cutoff]:
            del self._contending[owner]
        return {s.task.owner for s in self.slots if isinstance(s.task, Submission)} | self._contending.keys()

    def free_memory(self) -> dict[str, float]:
        """GB of each GPU device not reserved: its memory less the `gpu_memory_gb` that the holders of its
        slots declared (per device: a devices=N task reserves it on each of its N devices)."""
        free = {s.device: s.memory_gb for s in self.slots if s.memory_gb is not None}
        slots = [*self.slots, *self.borrowed] if self.borrowed else self.slots
        for holder in {s.task for s in slots if s.task is not None}:
            for device in {s.device for s in holder.group}:
                if device in free:
                    free[device] -= holder.req.gpu_memory_gb or 0.0
        return free

    def available_memory(self) -> dict[str, float]:
        """GB of each GPU device a task may take now: the unreserved memory (`free_memory`), or less where
        the last measurement finds less free. Memory in use beyond what running tasks declared (other
        programs, a task using more than it asked for) so holds tasks back."""
        free = self.free_memory()
        if not free:  # no GPU device with a known memory (a CPU peer): nothing to measure
            return free
        for device, measured in measured_free(self.slots, self.measured).items():
            if device in free:
                free[device] = min(free[device], measured)
        return free

    # ---- events from submitters ------------------------------------------------------------------

    def task_arrived(self, task: Queued, now: float) -> Actions:
        """An admitted task (or a job): queue it and start what can start. A task whose env breaks the
        rules of `taskenv.check_env` is answered with bad-request instead."""
        if isinstance(task, Submission):
            assert task.msg is not None
            try:
                task.env = check_env(task.msg.get("env"))
            except (TypeError, ValueError) as exc:
                return self._answer(task, messages.error("bad-request", str(exc)), now)
            self._contending[task.owner] = now
        self.queue.append(task)
        return self._start_queued(now)

    def cancel(self, task: Submission, code: str, message: str, notify: bool, now: float) -> Actions:
        """Drop a queued task, or stop a running one (its worker is replaced); answer it if `notify`."""
        if task.answered:
            return []
        actions: Actions = []
        if task.slot is None:
            if task in self.queue:  # not while its held arguments are fetched
                self.queue.remove(task)
        elif task.slot.task is task:
            actions = self._replace(task.slot, f"its task was stopped: {message}")
        if notify:
            return [*actions, *self._answer(task, messages.error(code, message), now)]
        task.answered = True
        return actions

    def withdraw(self, task: Queued) -> bool:
        """Take a task out of the queue for its submitter to place elsewhere; False once it started (or ended)."""
        if task.answered or task.slot is not None or task not in self.queue:
            return False
        self.queue.remove(task)
        task.answered = True
        self.withdrawn += 1
        return True

    def lease(self, lease: LeaseHolder, now: float) -> str | None:
        """Lend a ready warm worker of a slot that fits the lease's requirements to a submitter's connection
        (ADR 0013): the slot is held until the lease ends. Returns why not, or None: only a slot that
        nothing waits for is lent."""
        if self.queue:
            return "tasks wait in the queue"
        ready = [s for s in self.slots if s.ready and s.worker is not None and s.worker.direct]
        group = take_slots(lease.req, ready, self.available_memory()) if lease.req.devices == 1 else None
        if not group:
            return "no free slot that fits takes a lease"
        slot = lease.slot = group[0]
        slot.task, lease.group, lease.started = lease, [slot], now
        self.leases[lease.lease_id] = lease
        return None

    def lease_failed(self, lease: LeaseHolder, now: float) -> Actions:
        """The connection did not reach the leased worker: the slot is free again."""
        lease.answered = True
        failed: messages.Message = {"t": messages.ERROR, "code": "no-lease"}
        return [*self._release(lease), Ended(lease, failed), *self._start_queued(now)]

    def cancel_leased(self, lease_id: Any, submitter_id: str, task_id: int) -> Actions:
        """Stop a task on a lease of submitter `submitter_id` if it runs now, or keep it from starting: the leased
        worker decides, since only it knows which task runs."""
        lease = self.leases.get(lease_id) if isinstance(lease_id, str) else None
        if lease is None or lease.slot is None or lease.slot.worker is None or lease.submitter_id != submitter_id or task_id <= 0:
            return []
        return [ToWorker(lease.slot.worker, messages.cancel(task_id))]

    def end_leases(self) -> Actions:
        """Ask every leased worker to end its lease after the task it runs (the peer stops)."""
        return [action for lease in list(self.leases.values()) for action in self._yield(lease)]

    # ---- events from workers ---------------------------------------------------------------------

    def task_replied(self, task: Submission, reply: messages.Message, buffers: list[Any], now: float) -> Actions:
        """The worker of a running task (or an actor's creation) answered it."""
        if reply["t"] not in (messages.RESULT, messages.ERROR):
            return []
        assert task.slot is not None
        if task.keeps_slot(reply):
            assert task.slot.worker is not None
            actions: Actions = [StopTimer(task), GoLive(task, task.slot.worker, reply)]
        elif task.one_off:
            actions = self._replace(task.slot, "its task needed a worker of its own")  # back to a warm one
        else:
            actions = self._release(task)
        return [*actions, *self._answer(task, reply, now, buffers), *self._start_queued(now),
                *self._tell_idle(task.owner, now)]

    def lease_reported(self, lease: LeaseHolder, msg: messages.Message, now: float) -> Actions:
        """The leased worker ended the lease (a STATUS with "lease_end"), or asks to be killed (a BYE with
        "kill", after a timeout or a cancel of the task it ran). Either says how many tasks it served."""
        served = msg.get("served")
        if type(served) is int and served > 0:
            self.tasks_done += served
        assert lease.slot is not None and lease.slot.worker is not None
        if msg["t"] == messages.BYE:
            why = messages.printable(msg.get("reason"), 500)
            actions = self._replace(lease.slot, f"its leased task was stopped: {why}")
        elif msg["t"] == messages.STATUS and "lease_end" in msg:
            # the acknowledgement: it serves this peer again
            actions = [ToWorker(lease.slot.worker, {"t": messages.LEASE_END}), *self._release(lease)]
        else:
            return []
        lease.answered = True
        return [*actions, Ended(lease, {"t": messages.RESULT}), *self._start_queued(now), *self._tell_idle(None, now)]

    def timed_out(self, task: Submission, now: float) -> Actions:
        """A running task reached its timeout: answer it, and replace its worker."""
        task.timer = None
        actions = self._answer(task, messages.error("timeout", f"the task ran past its timeout of {task.timeout:g} s; "
                                                           "its worker was killed and replaced"), now)
        if task.slot is not None:
            actions += self._replace(task.slot, f"its task ran past its timeout of {task.timeout:g} s")
        return actions

    def worker_died(self, slot: Slot, pid: int | None, how: str, now: float) -> Actions:
        """The slot's worker (process `pid`) died by itself, as `how` says: a live actor ends, a task gets
        worker-died, a lease ends; the slot gets a fresh worker."""
        holder = slot.task
        if isinstance(holder, ActorHolder) and holder.actor is not None:
            worker = slot.worker
            reason = (f"the actor was stopped: {worker.last_words}" if worker is not None and worker.last_words
                      else f"its worker process {pid} died ({how})")
            return [EndActor(holder.actor, reason)]
        if isinstance(holder, JobHolder):  # the slot's idle warm worker died: the job's process runs on
            old, slot.worker = slot.worker, None
            return [Replace(slot, old, None)]
        actions = self._replace(slot, None)
        died = messages.error("worker-died", f"the worker process {pid} died while running the task ({how})")
        if isinstance(holder, Submission):
            actions += self._answer(holder, died, now)
        elif holder is not None and not holder.answered:
            holder.answered = True
            actions.append(Ended(holder, dict(died)))
        return actions

    def job_ended(self, job: JobHolder, outcome: str, now: float) -> Actions:
        """A job's process ended with `outcome` ("ok" or its state): its slots are free again."""
        actions = self._release(job)
        if not job.answered:
            job.answered = True
            self.tasks_done += 1
            actions.append(Ended(job, {"t": messages.RESULT} if outcome == "ok" else {"code": outcome}))
        return [*actions, *self._start_queued(now)]

    def one_off_failed(self, task: Submission, slot: Slot, why: str, now: float) -> Actions:
        """The worker started for one task did not start."""
        return [*self._answer(task, messages.error("worker-died", why), now), *self._replace(slot, "it did not start")]

    def actor_ended(self, slot: Slot, worker: Worker, why: str, now: float) -> Actions:
        """An actor ended: its worker is replaced (unless another has replaced it already)."""
        return self._replace(slot, why) if slot.worker is worker else self._start_queued(now)

    def worker_ready(self, now: float) -> Actions:
        """A worker started (a slot's new one, a borrowed one): start what can start."""
        return self._start_queued(now)

    def borrowed_failed(self, slot: Slot) -> None:
        """A borrowed slot's worker did not start: the slot goes, unless a task holds it."""
        if slot.task is None and slot in self.borrowed:
            self.borrowed.remove(slot)

    def measure(self, sample: Sample, now: float) -> Actions:
        """A new measurement of the devices' memory: start what it lets start."""
        self.measured = sample
        return self._start_queued(now)

    # ---- lending the slots of blocked tasks (ADR 0014) --------------------------------------------

    def wait_changed(self, holder: Holder, blocked: bool, now: float) -> Actions:
        """The holder's worker blocks on a future (lend its slots) or goes on (take them back)."""
        if holder.blocked == blocked:
            return []
        if not blocked:
            self._take_back(holder)
            return []
        holder.blocked = True
        actions = [action for slot in holder.group for action in self._lend(holder, slot)]
        return [*actions, *self._start_queued(now)]

    def _lend(self, holder: Holder, slot: Slot) -> Actions:
        """Open a borrowed slot of `slot`'s device for the queue while `holder` waits: a closed one whose task
        still runs (it runs on lent capacity again: a task that waits on one future after another keeps
        the peer within its concurrency), else a spare with a warm worker, else a new one. The task's
        memory stays reserved on the device, so only a task that fits beside it starts there."""
        closed = [b for b in self.borrowed if b.lent_by is None and b.env == slot.env]
        if closed:
            reopened = max(closed, key=lambda b: b.task is not None)
            self._spare_since.pop(reopened.index, None)
            reopened.lent_by = holder
            return []
        borrowed = Slot(self._next_index, slot.device, slot.memory_gb, dict(slot.env), slot.unified, lent_by=holder)
        self._next_index += 1
        self.borrowed.append(borrowed)
        return [OpenBorrowed(borrowed)]

    def _take_back(self, holder: Holder) -> None:
        """The holder goes on (or ended): its borrowed slots close. One that runs a task lets it end (the peer
        runs over its concurrency until then); no lease holds one (`lease` lends planned slots only)."""
        holder.blocked = False
        for slot in self.borrowed:
            if slot.lent_by is holder:
                slot.lent_by = None

    def spares_due(self, now: float) -> Actions:
        """Stop the workers of borrowed slots that no wait needed for SPARE_IDLE_S."""
        actions: Actions = []
        for slot in list(self.borrowed):
            if slot.lent_by is not None or slot.task is not None or slot.worker is None or not slot.worker.ready:
                self._spare_since.pop(slot.index, None)
            elif now - self._spare_since.setdefault(slot.index, now) >= SPARE_IDLE_S:
                del self._spare_since[slot.index]
                self.borrowed.remove(slot)
                actions.append(StopWorker(slot.worker))
        return actions

    # ---- the transitions' common steps -------------------------------------------------------------

    def _start_queued(self, now: float) -> Actions:
        """Start queued tasks on ready slots in the queue's order (priority, the submitters in turn, first
        come first served), honouring device memory.

        A task that cannot start now (too little memory on the free devices, or too few free devices
        for devices=N) lets the tasks behind it go first; the search looks LOOKAHEAD deep. When none can
        start, a lease whose slot would let one start is asked to end."""
        actions: Actions = []
        while self.queue:
            ready = [s for s in self.slots if s.ready]
            lent = [s for s in self.borrowed if s.lent_by is not None and s.ready] if self.borrowed else []
            every = ready + lent if lent else ready
            free = self.available_memory()
            found = next(((t, g) for t in islice(self._startable(), LOOKAHEAD)
                          if (g := take_slots(t.req, every if t.borrows else ready, free))), None) if every else None
            if found is None:
                if self.leases:
                    actions += self._yield_for_queue(ready, free)
                return actions
            task, group = found
            self.queue.remove(task)
            actions += self._start(task, group, now)
        return actions

    def within_quota(self, item: Queued, freed: Holder | None = None) -> bool:
        """Whether `item`'s user may take its slots now (--max-slots-per-user), with those of `freed` free."""
        held = self._held_by_users()
        if freed is not None:
            held[freed.user] -= len(freed.group)
        return self._fits_quota(item, held)

    def _held_by_users(self) -> Counter[str]:
        """The slots each user holds (the holders that count in a quota: tasks and jobs)."""
        held = Counter[str]()
        for holder in {s.task for s in [*self.slots, *self.borrowed] if s.task is not None and s.task.user}:
            held[holder.user] += len(holder.group)
        return held

    def _fits_quota(self, item: Queued, held: Counter[str]) -> bool:
        """Work that needs more slots than the quota starts only while its user holds none."""
        cap = self.max_slots_per_user
        return cap is None or not item.user or held[item.user] <= 0 or held[item.user] + item.req.devices <= cap

    def _startable(self) -> Iterator[Queued]:
        """The queue in start order, less the work whose user holds its quota of slots already
        (--max-slots-per-user): the others' work goes first."""
        if self.max_slots_per_user is None:
            return iter(self.queue)
        held = self._held_by_users()
        return (t for t in self.queue if self._fits_quota(t, held))

    def _start(self, task: Queued, group: list[Slot], now: float) -> Actions:
        lead = group[0]
        for slot in group:
            slot.task = task
        task.slot, task.group, task.started = lead, group, now
        started = Started(task, task.name, lead.device)
        if isinstance(task, JobHolder):
            return [started, StartJob(task, group, {**lead.env, **device_env(task.req, lead), **group_env(group)})]
        msg, buffers = task.work()
        env = {**task.env, **device_env(task.req, lead)}
        fresh = any(read_at_load(name) for name in task.env)
        if not task.needs_own_worker(fresh):  # the warm worker sets env for this task and restores it after
            if env:
                msg["env"] = env
            assert lead.worker is not None  # a ready slot's
            return [started, Run(task, lead.worker, msg, buffers)]
        # A worker of its own, started with env, in place of the lead's warm one (which is stopped, so
        # that the task has the device and its memory to itself): for several devices it sees all of
        # them; for a variable read at load it imports nothing before the task; an actor keeps it.
        env.update(group_env(group))
        task.one_off = True
        old, lead.worker = lead.worker, None  # until the one-off worker is made
        return [started, RunAlone(task, lead, old, env, fresh, msg, buffers)]

    def _yield_for_queue(self, ready: list[Slot], free: dict[str, float]) -> Actions:
        """Queued tasks cannot start: a lease whose slot would let one start ends after the task it runs.
        A queued task, of any submitter, goes before a lease (its own submitter's are its to pace)."""
        actions: Actions = []
        for lease in list(self.leases.values()):
            if lease.yielding or lease.slot is None:
                continue
            with_slot = [*ready, lease.slot]
            if any(take_slots(t.req, with_slot, free) for t in islice(self._startable(), LOOKAHEAD)):
                actions += self._yield(lease)
        return actions

    def _yield(self, lease: LeaseHolder) -> Actions:
        if lease.yielding or lease.slot is None or lease.slot.worker is None:
            return []
        lease.yielding = True
        return [ToWorker(lease.slot.worker, {"t": messages.LEASE_END})]

    def _tell_idle(self, answered: TaskOwner | None, now: float) -> Actions:
        """A slot is free and nothing waits: say so to the other contending submitters, so that one whose
        task waits in a busier peer's queue may withdraw it and send it here (ADR 0011). The submitter
        just answered knows it from its outcome. Once per IDLE_NOTICE_GAP_S at most: short tasks ending
        back to back do not flood the contenders."""
        if self.queue or now - self._idle_told < IDLE_NOTICE_GAP_S or not any(s.ready for s in self.slots):
            return []
        others = frozenset(o for o in self._contenders(now) if o is not answered)
        if not others:
            return []
        self._idle_told = now
        return [TellIdle(others)]

    def _release(self, holder: Holder) -> Actions:
        """Free the slots a holder holds and stop its timer."""
        for slot in holder.group:
            if slot.task is holder:
                slot.task = None
        if isinstance(holder, LeaseHolder):
            self.leases.pop(holder.lease_id, None)
        if holder.blocked:
            self._take_back(holder)
        return [StopTimer(holder)] if isinstance(holder, Submission) else []

    def _replace(self, slot: Slot, why: str | None) -> Actions:
        """Free the slot (and the others its holder holds) and replace its worker. `why` says why the
        peer stops the worker; None: it died by itself."""
        actions = self._release(slot.task) if slot.task is not None else []
        old, slot.worker = slot.worker, None
        return [*actions, Replace(slot, old, why)]

    def _answer(self, task: Submission, reply: messages.Outgoing, now: float,
                buffers: list[Any] | None = None) -> Actions:
        """The task's outcome, once."""
        if task.answered:
            return []
        task.answered = True
        self.tasks_done += 1
        reply["id"] = task.task_id
        if task.slot is not None:  # it started
            reply["ran"] = round(now - task.started, 6)
        return [Answer(task, reply, buffers or [])]


def device_env(req: Requirements, slot: Slot) -> dict[str, str]:
    """The task's device variable where it differs from its slot's: a cpu task on a GPU slot gets
    GPULAYER_DEVICE=cpu, so that gl.device() and Trainer(accelerator="auto") give it the CPU.

    The slot's GPU stays visible to it (CUDA_VISIBLE_DEVICES): hiding it needs a fresh process (CUDA
    reads the variable once, and a warm worker may have started CUDA for an earlier task), while the
    task holds that GPU's slot anyway, so no other task's device is in reach. A task that wants it
    hidden asks for env={"CUDA_VISIBLE_DEVICES": ""}, and so for a fresh worker.
    """
    if req.accelerator == accelerators.CPU and slot.env.get(accelerators.ENV_DEVICE) != accelerators.CPU:
        return {accelerators.ENV_DEVICE: accelerators.CPU}
    return {}


def group_env(group: list[Slot]) -> dict[str, str]:
    """What a process on several devices sees: all of them (CUDA_VISIBLE_DEVICES)."""
    if len(group) > 1:
        return {"CUDA_VISIBLE_DEVICES": ",".join(s.env["CUDA_VISIBLE_DEVICES"] for s in group)}
    return {}


def slot_memory_fits(req: Requirements, slot: Slot) -> bool:
    """Whether the slot's device has the memory the task asks for at all (reserved or not)."""
    return req.gpu_memory_gb is None or slot.memory_gb is None or slot.memory_gb >= req.gpu_memory_gb


def take_slots(req: Requirements, ready: Sequence[Slot], free: dict[str, float]) -> list[Slot] | None:
    """Ready slots for one task: one slot, or `devices` slots on distinct devices, each with the task's
    `gpu_memory_gb` free (not reserved, in `free`); None if too few."""
    chosen: dict[str, Slot] = {}
    for slot in ready:
        room = free.get(slot.device, math.inf) + MEMORY_SLACK_GB
        if slot_memory_fits(req, slot) and (req.gpu_memory_gb or 0.0) <= room:
            chosen.setdefault(slot.device, slot)
            if len(chosen) == req.devices:
                return list(chosen.values())
    return None


def measured_free(slots: list[Slot], sample: Sample | None, max_age: float = MEASURE_MAX_AGE_S) -> dict[str, float]:
    """GB free on each GPU device of `slots` as `sample` measured it: a dedicated GPU's memory less what
    NVML finds in use; a unified one the memory the system has available, where a GPU source (NVML,
    ioreg) measured this machine. Devices without a reading, and a sample older than `max_age`
    seconds (by the wall clock: the sample's own time), say nothing (so a peer emulated through the
    override is not held back by this host)."""
    if sample is None or time.time() - sample["t"] > max_age:
        return {}
    used = {g["index"]: g["memory_used_gb"] for g in sample["gpus"] if g["memory_used_gb"] is not None}
    free: dict[str, float] = {}
    for slot in slots:
        if slot.memory_gb is None:
            continue
        if slot.unified:
            if sample["source"] is not None:
                free[slot.device] = sample["ram_available_gb"]
        elif (index := int(slot.env.get(accelerators.ENV_DEVICE_INDEX, 0))) in used:
            free[slot.device] = max(slot.memory_gb - used[index], 0.0)
    return free
