"""The peer's scheduler: the queue, the slots, starting tasks, timeouts and worker replacement.

It runs on the peer's event loop. Admitted tasks come in through `enqueue`; each task's
single outcome (RESULT, or an ERROR such as timeout, cancelled or worker-died) and its output
go back to the connection it came from, through that connection's `TaskOwner` methods.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import shutil
import sys
import tempfile
import time
from collections import deque
from collections.abc import Coroutine
from dataclasses import dataclass, field
from itertools import islice
from typing import Any, Protocol

from .. import accelerators, wire
from .activity import Activity
from ..errors import WorkerDied
from ..matching import MEMORY_SLACK_GB, Requirements
from ..resources.model import Resources
from ..resources.utilisation import Sample
from .actors import Actor, Actors, CallOwner, grace_from_env, new_actor_id
from ..taskenv import check_env, read_at_load
from .worker_processes import Slot, Worker, describe_exit, job_pythonpath

log = logging.getLogger("gpulayer.peer")

_THREAD_VARS = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
LOOKAHEAD = 256  # how deep the queue is searched for a task that fits the free slots
CONTENDING_S = 2.0  # a submitter that queued a task this recently contends for the slots (ADR 0011)
IDLE_NOTICE_GAP_S = 0.02  # the least time between two rounds of telling contenders that a slot is free
MEASURE_MAX_AGE_S = 5.0  # an older measurement of free memory is not used (the sampler runs at 1 Hz)
LEASE_IDLE_S = 0.5  # a lease ends when no task came on it for this long (ADR 0013)
SPARE_IDLE_S = 10.0  # a borrowed slot's worker that no wait needs is kept this long for the next (ADR 0014)


class TaskOwner(Protocol):
    """The submitter connection a task came from."""

    address: str  # the submitter's "host:port"
    client: str  # the submitter's id (its AUTH's "client"): whose data its tasks' workers hold

    def task_done(self, task: ScheduledTask, reply: wire.Outgoing, buffers: list[Any]) -> None:
        """Send the task's outcome (once)."""

    def task_output(self, task: ScheduledTask, msg: wire.LogMessage) -> None:
        """Send a piece of the task's stdout or stderr."""

    def send(self, msg: wire.Outgoing, buffers: wire.Buffers = ()) -> None:
        """Send any message to the submitter."""


@dataclass(eq=False)
class ScheduledTask:
    """An admitted task: queued, then running on a group of slots, then answered."""

    owner: TaskOwner
    client_id: int
    msg: wire.Message | None  # its SUBMIT, until it starts
    buffers: list[Any] | None
    req: Requirements
    timeout: float | None
    env: dict[str, str] = field(default_factory=dict)  # its environment variables (the SUBMIT's "env")
    slot: Slot | None = None  # where its worker runs
    group: list[Slot] = field(default_factory=list)  # every slot it holds (devices=N holds N)
    one_off: bool = False  # it runs in a worker of its own, which a warm one replaces after it
    actor_class: str | None = None  # the class name of the actor it creates (an ACTOR message)
    actor: Actor | None = None  # that actor once its constructor returned: it holds the slot from then on
    timer: asyncio.TimerHandle | None = None
    answered: bool = False
    keep: str | None = None  # hold its result under this id (the SUBMIT's "keep"; peer/held.py)
    refs: list[tuple[str, bytes, list[Any]]] = field(default_factory=list)  # held results among its arguments
    started: float = 0.0  # time.monotonic() when it started: its outcome says how long it ran ("ran")
    lease: str | None = None  # not a task but a lease (ADR 0013): its worker runs a submitter's tasks itself
    yielding: bool = False  # the lease's worker was asked to end it
    blocked: bool = False  # its worker waits on a future: its slots are lent meanwhile (ADR 0014)
    actor_id: str = ""  # the id of the actor it creates, given to its worker with the ACTOR message


class LeaseOwner:
    """The submitter of a lease, as a TaskOwner: its connection is its worker's now, so nothing is sent
    to it from here; output that the worker writes to its file descriptors goes to the peer's log."""

    def __init__(self, address: str, client: str):
        self.address = address
        self.client = client

    def task_done(self, task: ScheduledTask, reply: wire.Outgoing, buffers: list[Any]) -> None:
        pass

    def task_output(self, task: ScheduledTask, msg: wire.LogMessage) -> None:
        log.info("leased worker of %s, %s: %s", self.address, msg["stream"],
                 msg["data"].decode("utf-8", "replace").rstrip())

    def send(self, msg: wire.Outgoing, buffers: wire.Buffers = ()) -> None:
        pass


def plan_slots(res: Resources, concurrency: int | None) -> list[Slot]:
    """One slot per GPU (or `concurrency` per GPU); CPU-only peers get one per core by default.

    CPU slots share the cores: each worker's math libraries get cores / slots threads (unless
    the operator set those variables), so that concurrent tasks do not fight over every core.
    """
    gpus = [d for d in res.devices if d.kind == res.accelerator]
    if not gpus:
        count = concurrency or res.cpu_count or 1
        threads = str(max(1, (res.cpu_count or 1) // count))
        env = {accelerators.ENV_DEVICE: accelerators.CPU, **{v: threads for v in _THREAD_VARS if v not in os.environ}}
        return [Slot(i, accelerators.CPU, env=dict(env)) for i in range(count)]
    slots: list[Slot] = []
    inherited = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    for gpu in gpus:
        if gpu.kind == accelerators.CUDA:  # the peer's own CUDA_VISIBLE_DEVICES numbers what it detected
            visible = inherited[gpu.index] if gpu.index < len(inherited) else str(gpu.index)
            env = {accelerators.ENV_DEVICE: "cuda:0", "CUDA_VISIBLE_DEVICES": visible}
        else:
            env = {accelerators.ENV_DEVICE: accelerators.MPS}
        env[accelerators.ENV_DEVICE_INDEX] = str(gpu.index)
        slots += [Slot(len(slots) + i, f"{gpu.kind}:{gpu.index}", gpu.memory_gb, env,
                       unified=gpu.memory_kind == accelerators.UNIFIED) for i in range(concurrency or 1)]
    return slots


def default_preload(res: Resources) -> list[str]:
    """Keep the frameworks that GPU tasks use warm in every worker."""
    if res.accelerator == accelerators.CPU:
        return []
    wanted = ["torch", "mlx"] if res.accelerator == accelerators.MPS else ["torch"]
    return [name for name in wanted if res.framework(name)]


class Scheduler:
    """Runs admitted tasks in warm workers, first come first served, honouring device memory."""

    def __init__(self, slots: list[Slot], python: str = sys.executable, preload: list[str] | None = None,
                 worker_start_timeout: float = 120.0, workdir: str | None = None):
        self.slots = slots
        self.python = python
        self.preload = preload or []
        self.worker_start_timeout = worker_start_timeout
        # where tasks start: the operator's folder, or a scratch folder of this peer's, removed at stop
        self.workdir = workdir or tempfile.mkdtemp(prefix="gpulayer-work-")
        self._own_workdir = workdir is None
        self.tasks_done = 0
        self.withdrawn = 0  # tasks their submitters took back from the queue (ADR 0011)
        self._idle_told = 0.0  # when contenders were last told that a slot is free
        self.activity = Activity()  # running and finished tasks, for STATUS
        self.stopping = False
        self._queue: deque[ScheduledTask] = deque()
        self._contending: dict[TaskOwner, float] = {}  # submitter -> when it last queued a task
        self.measured: Sample | None = None  # the last measured utilisation (`measure`)
        self.actors = Actors(self._free_actor_slot, grace_from_env())
        self.leases: dict[str, ScheduledTask] = {}  # by lease id
        # slots lent by blocked tasks (`lent_by` set) and spare ones kept warm for the next wait (ADR 0014)
        self.borrowed: list[Slot] = []
        self._spare_since: dict[int, float] = {}  # a spare's index -> since when no wait needed it
        self._retiring: asyncio.Task[Any] | None = None  # `_retire_spares`, while borrowed slots exist
        self._next_index = len(slots)
        self._background: set[asyncio.Task[Any]] = set()
        self._pythonpath = job_pythonpath(python)
        self._loop: asyncio.AbstractEventLoop | None = None

    # ---- life cycle -------------------------------------------------------------------------

    async def start(self) -> None:
        """Start one warm worker per slot. Raises WorkerDied when workers cannot start."""
        self._loop = asyncio.get_running_loop()
        for slot in self.slots:
            slot.worker = self._new_worker(slot)
        await asyncio.gather(*(self._worker(s).start(self.worker_start_timeout) for s in self.slots))

    async def stop(self) -> None:
        """Stop the workers and the background jobs (tasks must have been answered or cancelled)."""
        self.stopping = True
        await asyncio.gather(*(self._worker(s).stop() for s in [*self.slots, *self.borrowed]), return_exceptions=True)
        for job in list(self._background):
            job.cancel()
        if self._pythonpath:
            shutil.rmtree(self._pythonpath, ignore_errors=True)
        if self._own_workdir:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def spawn(self, coro: Coroutine[Any, Any, Any]) -> asyncio.Task[Any]:
        """Run a coroutine in the background; it is cancelled at stop."""
        assert self._loop is not None
        job = self._loop.create_task(coro)
        self._background.add(job)
        job.add_done_callback(self._background.discard)
        return job

    # ---- load ---------------------------------------------------------------------------------

    @property
    def busy(self) -> int:
        """Slots with a task, borrowed ones included (a blocked task is still running)."""
        busy = sum(s.task is not None for s in self.slots)
        return busy + sum(s.task is not None for s in self.borrowed) if self.borrowed else busy

    @property
    def held_by_actors(self) -> int:
        return sum(_actor_of(s) is not None for s in self.slots)

    def actors_hold_all(self, req: Requirements) -> bool:
        """Whether actors hold so many of the slots that fit `req` that it could never start here."""
        free = {s.device for s in self.slots
                if _fits(req, s) and (_actor_of(s) is None or s.task.blocked)}  # type: ignore[attr-defined]
        return len(free) < req.devices

    @property
    def queued(self) -> int:
        return len(self._queue)

    def load(self) -> list[int]:
        """[busy, queued]: a blocked task's slot counts as free while it is lent (a borrowed one, busy)."""
        if self.borrowed:
            return [self.busy - sum(s.lent_by is not None for s in self.borrowed), len(self._queue)]
        return [self.busy, len(self._queue)]

    def report(self, msg: wire.Outgoing) -> wire.Outgoing:
        """Add what a reply tells the submitter about this peer: its "load" and, on a GPU peer, its
        "free" GB (the most that one task may take now on one device, `available_memory`)."""
        msg["load"] = self.load()
        msg["submitters"] = self.submitters()
        free = self.available_memory()
        if free:
            msg["free"] = round(max(free.values()), 3)
        return msg

    def submitters(self) -> int:
        """How many submitters contend for the slots. Each submitter sizes its map's window by it (ADR 0011)."""
        return len(self._contenders())

    def _contenders(self) -> set[TaskOwner]:
        """The submitters' connections with a task running here, or one queued in the last CONTENDING_S seconds."""
        cutoff = time.monotonic() - CONTENDING_S
        for owner in [o for o, seen in self._contending.items() if seen < cutoff]:
            del self._contending[owner]
        return {s.task.owner for s in self.slots if isinstance(s.task, ScheduledTask)} | self._contending.keys()

    def _tell_idle(self, answered: TaskOwner) -> None:
        """A slot is free and nothing waits: say so (an unsolicited PONG with the load) to the other
        contending submitters, so that one whose task waits in a busier peer's queue may withdraw it
        and send it here (ADR 0011). The submitter just answered knows it from its outcome. Once per
        IDLE_NOTICE_GAP_S at most: short tasks ending back to back do not flood the contenders."""
        now = time.monotonic()
        if self._queue or now - self._idle_told < IDLE_NOTICE_GAP_S or not any(s.ready for s in self.slots):
            return
        others = self._contenders() - {answered}
        if others:
            self._idle_told = now
            news = self.report({"t": wire.PONG, "id": None})
            for owner in others:
                owner.send(news)

    # ---- tasks --------------------------------------------------------------------------------

    def enqueue(self, task: ScheduledTask) -> bool:
        """Queue an admitted task and start what can start; True if it started at once.

        A task whose env breaks the rules of `taskenv.check_env` is answered with bad-request instead.
        """
        assert task.msg is not None
        try:
            task.env = check_env(task.msg.get("env"))
        except (TypeError, ValueError) as exc:
            self._answer(task, wire.error("bad-request", str(exc)))
            return False
        self._queue.append(task)
        self._contending[task.owner] = time.monotonic()
        self._start_queued()
        return task.slot is not None

    def cancel(self, task: ScheduledTask, code: str, message: str, notify: bool = True) -> None:
        """Drop a queued task, or stop a running one (its worker is killed and replaced)."""
        if task.answered:
            return
        if task.slot is None:
            if task in self._queue:  # not while its held arguments are fetched
                self._queue.remove(task)
        elif task.slot.task is task:
            self._replace_worker(task.slot, f"its task was stopped: {message}")
        if notify:
            self._answer(task, wire.error(code, message))
        else:
            task.answered = True

    def withdraw(self, task: ScheduledTask) -> bool:
        """Take a task out of the queue for its submitter to place elsewhere; False once it started (or ended)."""
        if task.answered or task.slot is not None or task not in self._queue:
            return False
        self._queue.remove(task)
        task.answered = True
        self.withdrawn += 1
        return True

    def lease(self, owner: LeaseOwner, req: Requirements) -> ScheduledTask | str:
        """Lend a ready warm worker of a slot that fits `req` to a submitter's connection (ADR 0013): the
        slot counts as busy until the lease ends. Returns the lease, or why there is none: only a slot
        that nothing waits for is lent."""
        if self._queue:
            return "tasks wait in the queue"
        ready = [s for s in self.slots if s.ready and self._worker(s).direct]
        group = _group(req, ready, self.available_memory()) if req.devices == 1 else None
        if not group:
            return "no free slot that fits takes a lease"
        task = ScheduledTask(owner, 0, None, None, req, None, lease=os.urandom(8).hex())
        slot = task.slot = group[0]
        slot.task, task.group, task.started = task, [slot], time.monotonic()
        self.leases[task.lease] = task  # type: ignore[index]
        self.activity.started(task, "(lease)", owner.address, slot.device)
        return task

    def lease_message(self, task: ScheduledTask) -> wire.Message:
        """What the leased worker is told with the connection: its device variables and idle limit."""
        assert task.slot is not None
        return {"t": wire.LEASE, "env": _device_env(task.req, task.slot), "idle": LEASE_IDLE_S,
                "owner": task.owner.client}

    def lease_failed(self, task: ScheduledTask) -> None:
        """The connection did not reach the leased worker: the slot is free again."""
        self._release(task)
        task.answered = True
        self.activity.ended(task, {"t": wire.ERROR, "code": "no-lease"})
        self._start_queued()

    def cancel_leased(self, lease_id: Any, client: str, task_id: int) -> None:
        """Stop a task on a lease of `client` if it runs now (its worker is then killed and replaced), or
        keep it from starting: the leased worker decides, since only it knows which task runs."""
        task = self.leases.get(lease_id) if isinstance(lease_id, str) else None
        if task is not None and task.slot is not None and getattr(task.owner, "client", None) == client \
                and task_id > 0:
            self._worker(task.slot).send(wire.cancel(task_id))

    def end_leases(self) -> None:
        """Ask every leased worker to end its lease after the task it runs (the peer stops)."""
        for task in list(self.leases.values()):
            self._yield(task)

    def _yield(self, task: ScheduledTask) -> None:
        if not task.yielding and task.slot is not None:
            task.yielding = True
            self._worker(task.slot).send({"t": wire.LEASE_END})

    def _yield_for_queue(self, ready: list[Slot], free: dict[str, float]) -> None:
        """Queued tasks cannot start: a lease whose slot would let one start ends after the task it runs.
        A queued task, of any submitter, goes before a lease (its own submitter's are its to pace)."""
        for task in list(self.leases.values()):
            if task.yielding or task.slot is None:
                continue
            with_slot = [*ready, task.slot]
            if any(_group(t.req, with_slot, free) for t in islice(self._queue, LOOKAHEAD)):
                self._yield(task)

    def _on_lease_message(self, task: ScheduledTask, worker: Worker, msg: wire.Message) -> None:
        """The leased worker ended the lease (a STATUS with "lease_end"), or asks to be killed (a BYE
        with "kill", after a timeout or a cancel of the task it ran)."""
        served = msg.get("served")
        if type(served) is int and served > 0:
            self.tasks_done += served
        if msg["t"] == wire.BYE:
            self._replace_worker(worker.slot, f"its leased task was stopped: {worker.last_words}")
        elif msg["t"] == wire.STATUS and "lease_end" in msg:
            worker.send({"t": wire.LEASE_END})  # the acknowledgement: it serves this peer again
            self._release(task)
        else:
            return
        task.answered = True
        self.activity.ended(task, {"t": wire.RESULT})
        self._start_queued()
        self._tell_idle(task.owner)

    def free_memory(self) -> dict[str, float]:
        """GB of each GPU device not reserved: its memory less the `gpu_memory_gb` that the tasks and actors
        holding its slots declared (per device: a devices=N task reserves it on each of its N devices)."""
        free = {s.device: s.memory_gb for s in self.slots if s.memory_gb is not None}
        slots = [*self.slots, *self.borrowed] if self.borrowed else self.slots
        for task in {s.task for s in slots if isinstance(s.task, ScheduledTask)}:
            for device in {s.device for s in task.group}:
                if device in free:
                    free[device] -= task.req.gpu_memory_gb or 0.0
        return free

    def available_memory(self) -> dict[str, float]:
        """GB of each GPU device a task may take now: the unreserved memory (`free_memory`), or less
        where the last measurement (`measure`) finds less free. Memory in use beyond what running
        tasks declared (other programs, a task using more than it asked for) so holds tasks back."""
        free = self.free_memory()
        if not free:  # no GPU device with a known memory (a CPU peer): nothing to measure
            return free
        for device, measured in measured_free(self.slots, self.measured).items():
            if device in free:
                free[device] = min(free[device], measured)
        return free

    def measure(self, sample: Sample) -> None:
        """Take a new measurement of the devices' memory, and start what it lets start."""
        self.measured = sample
        self._start_queued()

    def _start_queued(self) -> None:
        """Start queued tasks on ready slots, first come first served, honouring device memory.

        A task that cannot start now (too little memory on the free devices, or too few free
        devices for devices=N) lets the tasks behind it go first; the search looks LOOKAHEAD deep.
        """
        while self._queue:
            ready = [s for s in self.slots if s.ready]
            lent = [s for s in self.borrowed if s.lent_by is not None and s.ready] if self.borrowed else []
            every = ready + lent if lent else ready  # an actor never starts on a lent slot: it would keep it
            free = self.available_memory()
            found = next(((t, g) for t in islice(self._queue, LOOKAHEAD)
                          if (g := _group(t.req, ready if t.actor_class else every, free))), None) if every else None
            if found is None:
                if self.leases:
                    self._yield_for_queue(ready, free)
                return
            task, group = found
            self._queue.remove(task)
            self._start(task, group)

    def _start(self, task: ScheduledTask, group: list[Slot]) -> None:
        lead = group[0]
        for slot in group:
            slot.task = task
        task.slot, task.group = lead, group
        task.started = time.monotonic()
        self.activity.started(task, task.msg and task.msg.get("name"), task.owner.address, lead.device)
        assert task.msg is not None
        if task.actor_class is None:
            msg = {"t": wire.SUBMIT, "id": task.client_id, "fn": task.msg["fn"], "args": task.msg["args"],
                   "owner": task.owner.client}
            if task.refs:  # after the task's own buffers: each held result's, in order
                msg["ab"] = len(task.buffers or [])
                msg["refs"] = [[rid, data, len(bufs)] for rid, data, bufs in task.refs]
                task.buffers = [*(task.buffers or []), *(b for _, _, bufs in task.refs for b in bufs)]
                task.refs = []
        else:
            task.actor_id = new_actor_id()
            msg = {"t": wire.ACTOR, "id": task.client_id, "cls": task.msg["cls"], "args": task.msg["args"],
                   "conc": task.msg["conc"], "actor": task.actor_id}
        buffers, task.msg, task.buffers = task.buffers or [], None, None
        env = {**task.env, **_device_env(task.req, lead)}
        fresh = any(read_at_load(name) for name in task.env)
        if len(group) == 1 and not fresh and task.actor_class is None:
            # the warm worker sets env for this task and restores it after
            if env:
                msg["env"] = env
            self._worker(lead).send(msg, buffers)
            self._arm_timeout(task)
            return
        # A worker of its own, started with env, in place of the lead's warm one (which is stopped, so
        # that the task has the device and its memory to itself): for several devices it sees all of
        # them; for a variable read at load it imports nothing before the task; an actor keeps it.
        if len(group) > 1:
            env["CUDA_VISIBLE_DEVICES"] = ",".join(s.env["CUDA_VISIBLE_DEVICES"] for s in group)
        task.one_off = True
        old = self._worker(lead)
        lead.worker = self._new_worker(lead, env, [] if fresh else None)
        self.spawn(self._start_one_off(task, old, lead.worker, msg, buffers))

    async def _start_one_off(self, task: ScheduledTask, old: Worker, worker: Worker, msg: wire.Message,
                             buffers: list[Any]) -> None:
        await old.kill()
        try:
            await worker.start(self.worker_start_timeout)
        except (WorkerDied, OSError) as exc:
            if worker.slot.worker is worker:
                self._answer(task, wire.error("worker-died", str(exc)))
                self._replace_worker(worker.slot, "it did not start")
            return
        if worker.slot.worker is not worker or worker.slot.task is not task:  # cancelled while it started
            await worker.kill()
            return
        worker.send(msg, buffers)
        self._arm_timeout(task)

    def _arm_timeout(self, task: ScheduledTask) -> None:
        if task.timeout:
            assert self._loop is not None
            task.timer = self._loop.call_later(task.timeout, self._on_timeout, task)

    def _on_timeout(self, task: ScheduledTask) -> None:
        task.timer = None
        self._answer(task, wire.error("timeout", f"the task ran past its timeout of {task.timeout:g} s; "
                                                 "its worker was killed and replaced"))
        if task.slot is not None:
            self._replace_worker(task.slot, f"its task ran past its timeout of {task.timeout:g} s")

    def _release(self, task: ScheduledTask) -> None:
        """Free the slots a task holds and stop its timer."""
        for slot in task.group:
            if slot.task is task:
                slot.task = None
        if task.lease is not None:
            self.leases.pop(task.lease, None)
        if task.blocked:
            self._take_back(task)
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None

    def _answer(self, task: ScheduledTask, reply: wire.Outgoing, buffers: list[Any] | None = None) -> None:
        """Send the task's outcome, once."""
        if task.answered:
            return
        task.answered = True
        self.tasks_done += 1
        self.activity.ended(task, reply)
        reply["id"] = task.client_id
        if task.started:
            reply["ran"] = round(time.monotonic() - task.started, 6)
        task.owner.task_done(task, self.report(reply), buffers or [])

    # ---- workers ------------------------------------------------------------------------------

    @staticmethod
    def _worker(slot: Slot) -> Worker:
        assert slot.worker is not None
        return slot.worker

    def _new_worker(self, slot: Slot, env: dict[str, str] | None = None, preload: list[str] | None = None) -> Worker:
        """A worker for `slot`, not started: a warm one, or one with `env` on top of the slot's and other preloads."""
        return Worker(slot, self.python, self.preload if preload is None else preload, self._on_reply,
                      self._on_output, self._on_worker_exit, self._on_wait, self._pythonpath, env, self.workdir,
                      keep_folders=not self._own_workdir)

    def _on_reply(self, worker: Worker, reply: wire.Message, buffers: list[Any]) -> None:
        slot = worker.slot
        task = slot.task
        if not isinstance(task, ScheduledTask) or slot.worker is not worker:
            return
        if task.lease is not None:
            self._on_lease_message(task, worker, reply)
            return
        if task.actor is not None:
            self.actors.reply(task.actor, reply, buffers)
            return
        if reply["t"] not in (wire.RESULT, wire.ERROR):
            return
        if task.actor_class is not None and reply["t"] == wire.RESULT:  # its constructor returned: it lives
            self._go_live(task, worker, reply)
        elif task.one_off:
            self._replace_worker(slot, "its task needed a worker of its own")  # back to a warm one
        else:
            self._release(task)
        self._answer(task, reply, buffers)
        self._start_queued()
        self._tell_idle(task.owner)

    # ---- lending the slots of blocked tasks (ADR 0014) -------------------------------------------

    def _on_wait(self, worker: Worker, blocked: bool) -> None:
        """The worker's task blocks on a future (lend its slots) or goes on (take them back)."""
        task = worker.slot.task
        if worker.slot.worker is not worker or not isinstance(task, ScheduledTask) or task.blocked == blocked:
            return
        if blocked:
            task.blocked = True
            for slot in task.group:
                self._lend(task, slot)
            self._start_queued()
        else:
            self._take_back(task)

    def _lend(self, task: ScheduledTask, slot: Slot) -> None:
        """Open a borrowed slot of `slot`'s device for the queue while `task` waits: a closed one whose task
        still runs (it runs on lent capacity again: a task that waits on one future after another keeps
        the peer within its concurrency), else a spare with a warm worker, else a new one. The task's
        memory stays reserved on the device, so only a task that fits beside it starts there."""
        closed = [b for b in self.borrowed if b.lent_by is None and b.env == slot.env]
        if closed:
            reopened = max(closed, key=lambda b: b.task is not None)
            self._spare_since.pop(reopened.index, None)
            reopened.lent_by = task
            return
        borrowed = Slot(self._next_index, slot.device, slot.memory_gb, dict(slot.env), slot.unified, lent_by=task)
        self._next_index += 1
        borrowed.worker = self._new_worker(borrowed)
        self.borrowed.append(borrowed)
        if self._retiring is None or self._retiring.done():
            self._retiring = self.spawn(self._retire_spares())
        self.spawn(self._start_borrowed(borrowed))

    async def _start_borrowed(self, slot: Slot) -> None:
        try:
            await self._worker(slot).start(self.worker_start_timeout)
        except (WorkerDied, OSError) as exc:
            log.error("no worker for a lent slot: %s", exc)
            if slot.task is None:
                self.borrowed.remove(slot)
            return
        self._start_queued()

    def _take_back(self, task: ScheduledTask) -> None:
        """The task goes on (or ended): its borrowed slots close. One that runs a task lets it end (the peer
        runs over its concurrency until then); no lease holds one (`lease` lends planned slots only)."""
        task.blocked = False
        for slot in self.borrowed:
            if slot.lent_by is task:
                slot.lent_by = None

    async def _retire_spares(self) -> None:
        """Stop the workers of borrowed slots that no wait needed for SPARE_IDLE_S; ends when none is left."""
        while self.borrowed:
            await asyncio.sleep(SPARE_IDLE_S / 2)
            now = time.monotonic()
            for slot in list(self.borrowed):
                if slot.lent_by is not None or slot.task is not None or not self._worker(slot).ready:
                    self._spare_since.pop(slot.index, None)
                elif now - self._spare_since.setdefault(slot.index, now) >= SPARE_IDLE_S:
                    del self._spare_since[slot.index]
                    self.borrowed.remove(slot)
                    self.spawn(self._worker(slot).stop())

    def _on_worker_exit(self, worker: Worker, code: int | None) -> None:
        slot = worker.slot
        if slot.worker is not worker:
            return
        task = slot.task
        log.warning("worker %s of slot %d died (%s)", worker.pid, slot.index, describe_exit(code))
        if isinstance(task, ScheduledTask) and task.actor is not None:
            self.actors.end(task.actor, "died", f"the actor was stopped: {worker.last_words}" if worker.last_words
                            else f"its worker process {worker.pid} died ({describe_exit(code)})")
            return
        self._replace_worker(slot, None)
        if isinstance(task, ScheduledTask):
            self._answer(task, wire.error("worker-died", f"the worker process {worker.pid} died while running "
                                                         f"the task ({describe_exit(code)})"))

    def _on_output(self, worker: Worker, stream: str, data: bytes) -> None:
        task = worker.slot.task if worker.slot.worker is worker else None
        if isinstance(task, ScheduledTask) and task.actor is not None and \
                self.actors.output(task.actor, stream, data):
            return
        if not isinstance(task, ScheduledTask) or task.answered:
            log.info("worker %s %s: %s", worker.pid, stream, data.decode("utf-8", "replace").rstrip())
            return
        task.owner.task_output(task, wire.log(task.client_id, stream, data))

    def _go_live(self, task: ScheduledTask, worker: Worker, reply: wire.Message) -> None:
        """The actor's constructor returned: its slot stays held, and the answer carries the actor's id."""
        if task.timer is not None:
            task.timer.cancel()
            task.timer = None
        assert task.actor_class is not None
        owner: CallOwner = task.owner  # type: ignore[assignment]  # a connection is both
        task.actor = Actor(task.actor_id, task.actor_class, owner.client, owner, worker.slot, worker)
        self.actors.add(task.actor)
        reply["actor"], reply["slot"] = task.actor.actor_id, worker.slot.index

    def _free_actor_slot(self, slot: Slot, worker: Worker, why: str) -> None:
        """An actor ended: kill its worker (unless it is gone already) and give the slot a warm one."""
        if slot.worker is worker:
            self._replace_worker(slot, why)
        else:
            self._start_queued()

    def _replace_worker(self, slot: Slot, why: str | None) -> None:
        """Free the slot (and the others its task holds), kill its worker and start a fresh one. `why`
        says why the peer stops the worker; None: it died by itself."""
        if isinstance(slot.task, ScheduledTask):
            self._release(slot.task)
        old = self._worker(slot)
        slot.worker = self._new_worker(slot)
        self.spawn(self._restart(old, slot, why))

    async def _restart(self, old: Worker, slot: Slot, why: str | None) -> None:
        code = await old.kill()
        ended = f"stopped by the peer: {why}" if why else describe_exit(code)  # a kill of ours is no crash
        log.info("worker %s of slot %d ended (%s); starting a new one", old.pid, slot.index, ended)
        delay = 0.5
        while not self.stopping:
            try:
                await self._worker(slot).start(self.worker_start_timeout)
            except (WorkerDied, OSError) as exc:
                log.error("%s; retrying in %.1f s", exc, delay)
                await asyncio.sleep(delay)
                delay = min(delay * 2, 30.0)
                slot.worker = self._new_worker(slot)
                continue
            self._start_queued()
            return


def _device_env(req: Requirements, slot: Slot) -> dict[str, str]:
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


def _fits(req: Requirements, slot: Slot) -> bool:
    return req.gpu_memory_gb is None or slot.memory_gb is None or slot.memory_gb >= req.gpu_memory_gb


def _group(req: Requirements, ready: list[Slot], free: dict[str, float]) -> list[Slot] | None:
    """Ready slots for one task: one slot, or `devices` slots on distinct devices, each with the task's
    `gpu_memory_gb` free (not reserved, in `free`); None if too few."""
    chosen: dict[str, Slot] = {}
    for slot in ready:
        if _fits(req, slot) and (req.gpu_memory_gb or 0.0) <= free.get(slot.device, math.inf) + MEMORY_SLACK_GB:
            chosen.setdefault(slot.device, slot)
            if len(chosen) == req.devices:
                return list(chosen.values())
    return None


def measured_free(slots: list[Slot], sample: Sample | None, max_age: float = MEASURE_MAX_AGE_S) -> dict[str, float]:
    """GB free on each GPU device of `slots` as `sample` measured it: a dedicated GPU's memory less what
    NVML finds in use; a unified one the memory the system has available, where a GPU source (NVML,
    ioreg) measured this machine. Devices without a reading, and a sample older than `max_age`
    seconds, say nothing (so a peer emulated through the override is not held back by this host)."""
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


def _actor_of(slot: Slot) -> Actor | None:
    """The live actor that holds `slot`, if any."""
    return slot.task.actor if isinstance(slot.task, ScheduledTask) else None
